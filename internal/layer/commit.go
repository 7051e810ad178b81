package layer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// CommitOptions says which overlay upper directory to turn into a layer.
type CommitOptions struct {
	Kind        Kind // workspace or toolkit
	Name        string
	Version     string
	Compression string
	// Upper is the writable upper directory of an overlay (a sandbox's).
	// It is read, never modified; the overlay may stay mounted.
	Upper string
	// Exclude lists paths of the sandbox's root ("/.shoal") left out of the
	// layer, with everything under them.
	Exclude []string
	// Origin is recorded as the layer's Source ("commit of sandbox ID").
	Origin   string
	Progress func(Progress)
}

// Overlayfs's extended attributes (the "trusted." namespace: overlays
// mounted by root without userxattr).
const (
	ovlPrefix   = "trusted.overlay."
	ovlOpaque   = ovlPrefix + "opaque"
	ovlRedirect = ovlPrefix + "redirect"
	ovlMetacopy = ovlPrefix + "metacopy"
)

// Commit makes a layer of an overlay upper directory. The upper is copied
// to scratch space first (so the sandbox may keep running, and the
// overlay's private attributes are left behind), keeping what overlayfs
// needs to read the layer as a lower the way it read the upper:
//   - whiteouts (character devices 0/0: files the sandbox deleted) stay
//     whiteouts, which EROFS stores as they are;
//   - opaque directories (trusted.overlay.opaque=y: directories the sandbox
//     removed and made again) stay opaque;
//   - every other trusted.overlay.* attribute (origin, impure, ...) is
//     dropped; redirects and metacopy (not made by Shoal's overlays) are
//     refused.
//
// Sockets are skipped (with a note to Progress); other device nodes and
// fifos are refused. Kind must be workspace or toolkit: a commit records
// changes on top of other layers, which a base has not.
//
// The copy is a snapshot of the upper as the sandbox's writes left it while
// copying; files written during the copy may be caught half-way.
func (s *Store) Commit(ctx context.Context, o CommitOptions) (Layer, error) {
	l, err := s.commit(ctx, o)
	if err != nil {
		return Layer{}, fmt.Errorf("commit layer %s:%s: %w", o.Name, o.Version, err)
	}
	return l, nil
}

func (s *Store) commit(ctx context.Context, o CommitOptions) (Layer, error) {
	start := time.Now()
	rep := newReporter(o.Progress)
	spec, err := newSpec(o.Kind, o.Name, o.Version, o.Compression)
	if err != nil {
		return Layer{}, err
	}
	if o.Kind == KindBase {
		return Layer{}, errdefs.New(errdefs.ErrInvalidArgument, "a commit is a workspace or a toolkit layer, not a base: it holds the changes made on top of other layers")
	}
	fi, err := os.Lstat(o.Upper)
	if err != nil || !fi.IsDir() {
		return Layer{}, errdefs.New(errdefs.ErrFailedPrecondition, "no writable layer at %s: %v", o.Upper, err)
	}
	exclude := map[string]bool{}
	for _, p := range o.Exclude {
		rel, err := cleanName(p)
		if err != nil || rel == "." {
			return Layer{}, errdefs.New(errdefs.ErrInvalidArgument, "exclude %q: want a path below /", p)
		}
		exclude[rel] = true
	}
	work, err := os.MkdirTemp(s.tmp, "commit-")
	if err != nil {
		return Layer{}, err
	}
	defer os.RemoveAll(work)

	st, err := scanUpper(ctx, o.Upper, exclude)
	if err != nil {
		return Layer{}, fmt.Errorf("scan %s: %w", o.Upper, err)
	}
	rep.start(StageCopy, "bytes", st.bytes, "copying the sandbox's changes (%d entries, %.1f MiB)", st.files, mib(st.bytes))
	tree := filepath.Join(work, "root")
	c := &upperCopier{src: o.Upper, dst: tree, exclude: exclude, links: map[[2]uint64]string{}, rep: rep, total: st.bytes}
	if err := c.copy(ctx); err != nil {
		if ctx.Err() != nil {
			return Layer{}, ctx.Err()
		}
		return Layer{}, err
	}
	spec.source = o.Origin
	if spec.source == "" {
		spec.source = "commit of " + o.Upper
	}
	spec.tree, spec.whiteouts, spec.start = tree, true, start
	return s.make(ctx, work, spec, rep)
}

// scanUpper counts the entries and bytes of what a commit copies.
func scanUpper(ctx context.Context, upper string, exclude map[string]bool) (treeStats, error) {
	var st treeStats
	err := filepath.WalkDir(upper, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		rel, _ := filepath.Rel(upper, p)
		if exclude[rel] {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		if rel == "." {
			return nil
		}
		st.files++
		if d.Type().IsRegular() {
			if fi, err := d.Info(); err == nil {
				st.bytes += fi.Size()
			}
		}
		return nil
	})
	return st, err
}

// upperCopier copies an overlay upper directory into a layer tree; not safe
// for concurrent use.
type upperCopier struct {
	src, dst string
	exclude  map[string]bool
	links    map[[2]uint64]string // (dev, ino) of files with several links -> first copy
	rep      *reporter
	copied   int64
	total    int64
}

func (c *upperCopier) copy(ctx context.Context) error {
	if err := os.Mkdir(c.dst, 0o755); err != nil {
		return err
	}
	var dirs []string // metadata applied last, deepest first
	err := filepath.WalkDir(c.src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		rel, err := filepath.Rel(c.src, p)
		if err != nil {
			return err
		}
		if c.exclude[rel] {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		if err := c.entry(rel); err != nil {
			return fmt.Errorf("/%s: %w", strings.TrimPrefix(rel, "."), err)
		}
		if d.IsDir() {
			dirs = append(dirs, rel)
		}
		return nil
	})
	if err != nil {
		return err
	}
	for _, rel := range slices.Backward(dirs) {
		if err := c.meta(rel, true); err != nil {
			return fmt.Errorf("/%s: %w", strings.TrimPrefix(rel, "."), err)
		}
	}
	return nil
}

// entry copies one entry (a directory's metadata comes later, in meta).
func (c *upperCopier) entry(rel string) error {
	src, dst := filepath.Join(c.src, rel), filepath.Join(c.dst, rel)
	var st unix.Stat_t
	if err := unix.Lstat(src, &st); err != nil {
		return err
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		if rel == "." {
			return nil
		}
		return os.Mkdir(dst, 0o700)
	case unix.S_IFREG:
		key := [2]uint64{st.Dev, st.Ino}
		if st.Nlink > 1 {
			if first, ok := c.links[key]; ok {
				return os.Link(first, dst)
			}
			c.links[key] = dst
		}
		if err := c.copyFile(src, dst); err != nil {
			return err
		}
	case unix.S_IFLNK:
		target, err := os.Readlink(src)
		if err != nil {
			return err
		}
		if err := os.Symlink(target, dst); err != nil {
			return err
		}
	case unix.S_IFCHR:
		if st.Rdev != 0 {
			return errdefs.New(errdefs.ErrFailedPrecondition, "a character device (%d:%d): device nodes are not allowed in a layer (only overlay whiteouts, 0:0)", unix.Major(st.Rdev), unix.Minor(st.Rdev))
		}
		if err := unix.Mknod(dst, unix.S_IFCHR|(st.Mode&0o7777), 0); err != nil {
			return fmt.Errorf("make whiteout: %w", err)
		}
	case unix.S_IFSOCK:
		c.rep.note("skipping socket /%s: a layer cannot hold sockets", rel)
		return nil
	case unix.S_IFBLK:
		return errdefs.New(errdefs.ErrFailedPrecondition, "a block device: device nodes are not allowed in a layer")
	case unix.S_IFIFO:
		return errdefs.New(errdefs.ErrFailedPrecondition, "a fifo: fifos are not allowed in a layer")
	default:
		return fmt.Errorf("unknown file type %#o", st.Mode&unix.S_IFMT)
	}
	return c.meta(rel, false)
}

func (c *upperCopier) copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	defer out.Close()
	n, err := io.Copy(out, in) // copy_file_range: a reflink where the file system can
	c.copied += n
	c.rep.update(min(c.copied, c.total), c.total)
	if err != nil {
		return err
	}
	return out.Close()
}

// meta copies owner, mode and extended attributes (filtered: see Commit)
// of src to dst. Directories get theirs after their content is in.
func (c *upperCopier) meta(rel string, dir bool) error {
	src, dst := filepath.Join(c.src, rel), filepath.Join(c.dst, rel)
	var st unix.Stat_t
	if err := unix.Lstat(src, &st); err != nil {
		return err
	}
	isDir := st.Mode&unix.S_IFMT == unix.S_IFDIR
	if isDir != dir {
		return nil
	}
	if err := copyXattrs(src, dst, isDir); err != nil {
		return err
	}
	if err := unix.Lchown(dst, int(st.Uid), int(st.Gid)); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFLNK { // after chown, which clears set-id bits
		if err := unix.Chmod(dst, st.Mode&0o7777); err != nil {
			return err
		}
	}
	return nil
}

// copyXattrs copies src's extended attributes to dst, keeping of
// overlayfs's own only the opaque flag of directories.
func copyXattrs(src, dst string, isDir bool) error {
	names, err := listXattrs(src)
	if err != nil {
		return err
	}
	for _, n := range names {
		if strings.HasPrefix(n, ovlPrefix) {
			switch n {
			case ovlRedirect, ovlMetacopy:
				return errdefs.New(errdefs.ErrFailedPrecondition, "has overlay attribute %s (a renamed directory or a metadata-only copy): not supported in a commit; mount overlays with redirect_dir=off, metacopy=off", n)
			case ovlOpaque:
				if v, err := getXattr(src, n); err == nil && isDir && string(v) == "y" {
					if err := unix.Lsetxattr(dst, n, v, 0); err != nil {
						return fmt.Errorf("set %s: %w", n, err)
					}
				}
			}
			continue
		}
		v, err := getXattr(src, n)
		if errors.Is(err, unix.ENODATA) {
			continue
		}
		if err != nil {
			return fmt.Errorf("read xattr %s: %w", n, err)
		}
		if err := unix.Lsetxattr(dst, n, v, 0); err != nil {
			return fmt.Errorf("set xattr %s: %w", n, err)
		}
	}
	return nil
}

func listXattrs(p string) ([]string, error) {
	buf := make([]byte, 1024)
	for {
		n, err := unix.Llistxattr(p, buf)
		if errors.Is(err, unix.ERANGE) {
			buf = make([]byte, len(buf)*4)
			continue
		}
		if errors.Is(err, unix.ENOTSUP) {
			return nil, nil
		}
		if err != nil {
			return nil, fmt.Errorf("list xattrs: %w", err)
		}
		var names []string
		for _, s := range strings.Split(string(buf[:n]), "\x00") {
			if s != "" {
				names = append(names, s)
			}
		}
		return names, nil
	}
}

func getXattr(p, name string) ([]byte, error) {
	buf := make([]byte, 256)
	for {
		n, err := unix.Lgetxattr(p, name, buf)
		if errors.Is(err, unix.ERANGE) {
			buf = make([]byte, len(buf)*4)
			continue
		}
		if err != nil {
			return nil, err
		}
		return buf[:n], nil
	}
}

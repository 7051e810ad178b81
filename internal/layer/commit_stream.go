package layer

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// A commit stream is an overlay upper directory as a tar archive (POSIX
// pax), for a writable layer that is not on this host's file system (a
// VM's, inside its guest: the guest agent writes it, see
// internal/agent's OpExportUpper). Its producer may be hostile, so the
// format is strict and every rule is checked here:
//
//   - the first entry is the root directory, named ".";
//   - every other entry is named by its path below the root in canonical
//     form (no leading "/", no empty, "." or ".." elements, no trailing
//     "/"), appears once, and its parent directory came earlier;
//   - types: directories, regular files, symlinks (stored, never
//     followed), hard links (to an earlier regular file of the stream) and
//     overlay whiteouts (character devices 0:0); nothing else (no other
//     device, fifo, sparse file or global header);
//   - owner, group and permission bits (07777) are kept; extended
//     attributes travel as pax "SCHILY.xattr.NAME" records and are
//     filtered as a host upper's are (copyXattrs): an opaque directory has
//     trusted.overlay.opaque=y, other overlay attributes are dropped,
//     redirects and metacopy refused.
//
// The stream ends after the tar's end; the bounds of a commit (entries,
// bytes of regular files, depth, path length) are checked as it is read.
// Extraction goes through descriptors only: each parent is opened one
// element at a time below the tree's root (openat2 RESOLVE_BENEATH |
// RESOLVE_NO_SYMLINKS), entries are created with O_EXCL/mkdirat/mknodat/
// symlinkat (an existing name is refused, never followed), and metadata is
// applied to what was just made.

// exportStall bounds how long a commit stream may send nothing before the
// commit gives up (a stuck or hostile guest must not hold the commit, and
// its sandbox's commit slot, for ever).
var exportStall = time.Minute

// copyExport reads the commit stream that o.Export returns into tree.
func copyExport(ctx context.Context, o CommitOptions, tree string, exclude map[string]bool, lim commitLimits, rep *reporter) error {
	rc, err := o.Export(ctx, lim.depth)
	if err != nil {
		return err
	}
	g := newStallGuard(rc, exportStall)
	defer g.Close()
	rep.start(StageCopy, "bytes", 0, "copying the sandbox's changes from its guest (its processes stopped)")
	if err := os.Mkdir(tree, 0o755); err != nil {
		return err
	}
	// The longest path below tree that system calls accept (see copyUpper).
	maxPath := unix.PathMax - 1 - len(tree) - 1
	err = extractCommitStream(ctx, g, tree, exclude, lim, maxPath, rep)
	if g.stalled.Load() {
		return errdefs.New(errdefs.ErrUnavailable, "the sandbox sent nothing of its writable layer for %s: giving up", exportStall)
	}
	return err
}

// stallGuard closes a reader that gives nothing for longer than d.
type stallGuard struct {
	rc      io.ReadCloser
	t       *time.Timer
	d       time.Duration
	stalled atomic.Bool
	once    sync.Once
}

func newStallGuard(rc io.ReadCloser, d time.Duration) *stallGuard {
	g := &stallGuard{rc: rc, d: d}
	g.t = time.AfterFunc(d, func() {
		g.stalled.Store(true)
		rc.Close()
	})
	return g
}

func (g *stallGuard) Read(p []byte) (int, error) {
	n, err := g.rc.Read(p)
	if n > 0 && !g.stalled.Load() {
		g.t.Reset(g.d)
	}
	return n, err
}

func (g *stallGuard) Close() error {
	var err error
	g.once.Do(func() {
		g.t.Stop()
		err = g.rc.Close()
	})
	return err
}

// extractCommitStream extracts a commit stream from r into the empty
// directory tree (see the format above).
func extractCommitStream(ctx context.Context, r io.Reader, tree string, exclude map[string]bool, lim commitLimits, maxPath int, rep *reporter) error {
	root, err := unix.Open(tree, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	x := &streamExtractor{lim: lim, maxPath: maxPath, exclude: exclude, rep: rep, chain: []openDir{{rel: ".", fd: root}}}
	defer x.closeAll()
	tr := tar.NewReader(r)
	first := true
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			if first {
				return errdefs.New(errdefs.ErrInvalidArgument, "bad commit stream: empty")
			}
			break
		}
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return streamErr(fmt.Errorf("read: %w", err))
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if first {
			first = false
			if hdr.Name != "." || hdr.Typeflag != tar.TypeDir || hdr.Size != 0 {
				return streamErr(fmt.Errorf("the first entry must be the root directory \".\", not %q", hdr.Name))
			}
			if err := x.meta(xfd{fd: root}, hdr, true, false); err != nil {
				return &entryError{".", err}
			}
			continue
		}
		if err := x.entry(hdr, tr); err != nil {
			var ee *entryError
			if errors.As(err, &ee) || errors.Is(err, errStream) {
				return err
			}
			return &entryError{streamName(hdr.Name), err}
		}
	}
	// The producer's end: anything but a clean end after the archive (an
	// error it reported last) fails the commit.
	if _, err := io.Copy(io.Discard, io.LimitReader(r, 1<<20)); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return streamErr(fmt.Errorf("after the archive: %w", err))
	}
	return nil
}

var errStream = errors.New("bad commit stream")

func streamErr(err error) error {
	return errdefs.Mark(errdefs.ErrInvalidArgument, fmt.Errorf("%w: %w", errStream, err))
}

// streamName is name as an error may quote it (bounded).
func streamName(name string) string {
	if len(name) > 240 {
		return name[:100] + "..." + name[len(name)-100:]
	}
	return name
}

// openDir is an open directory of the tree being extracted.
type openDir struct {
	rel string
	fd  int
}

// streamExtractor is one extraction of a commit stream; not safe for
// concurrent use.
type streamExtractor struct {
	lim     commitLimits
	maxPath int
	exclude map[string]bool
	rep     *reporter
	// chain holds the open directories from the root down to the parent of
	// the last entry (a stream lists a directory's entries after it, so
	// most entries reuse it): chain[0] is the root.
	chain   []openDir
	entries int64
	bytes   int64
}

func (x *streamExtractor) closeAll() {
	for _, d := range x.chain {
		unix.Close(d.fd)
	}
	x.chain = nil
}

// validName checks that name is in the canonical form of the format and
// returns its depth (number of elements).
func validName(name string) (int, error) {
	if name == "" || name == "." || strings.HasPrefix(name, "/") || strings.HasSuffix(name, "/") || strings.IndexByte(name, 0) >= 0 {
		return 0, fmt.Errorf("bad entry name %q", streamName(name))
	}
	depth := 0
	for el := range strings.SplitSeq(name, "/") {
		if el == "" || el == "." || el == ".." {
			return 0, fmt.Errorf("bad entry name %q: empty, \".\" or \"..\" element", streamName(name))
		}
		depth++
	}
	return depth, nil
}

// excluded tells whether name or one of its parents is left out.
func (x *streamExtractor) excluded(name string) bool {
	if len(x.exclude) == 0 {
		return false
	}
	for p := name; p != "."; p = path.Dir(p) {
		if x.exclude[p] {
			return true
		}
	}
	return false
}

// dir returns an open descriptor of the directory rel of the tree (owned by
// the chain), opening it element by element below the deepest directory
// of the chain that holds it: never through a symlink, never outside the
// tree.
func (x *streamExtractor) dir(rel string) (int, error) {
	for len(x.chain) > 1 {
		top := x.chain[len(x.chain)-1].rel
		if rel == top || strings.HasPrefix(rel, top+"/") {
			break
		}
		unix.Close(x.chain[len(x.chain)-1].fd)
		x.chain = x.chain[:len(x.chain)-1]
	}
	top := x.chain[len(x.chain)-1]
	if rel == top.rel {
		return top.fd, nil
	}
	rest := rel
	if top.rel != "." {
		rest = strings.TrimPrefix(rel, top.rel+"/")
	}
	cur := top
	for el := range strings.SplitSeq(rest, "/") {
		fd, err := openBeneath(cur.fd, el, unix.O_RDONLY|unix.O_DIRECTORY)
		if err != nil {
			if errors.Is(err, unix.ENOENT) {
				return -1, fmt.Errorf("parent %q did not come earlier in the stream", streamName(rel))
			}
			if errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.ELOOP) || errors.Is(err, unix.EXDEV) {
				return -1, fmt.Errorf("parent %q is not a directory: refusing to extract through it", streamName(rel))
			}
			return -1, err
		}
		n := el
		if cur.rel != "." {
			n = cur.rel + "/" + el
		}
		cur = openDir{rel: n, fd: fd}
		x.chain = append(x.chain, cur)
	}
	return cur.fd, nil
}

// entry extracts one entry (not the root).
func (x *streamExtractor) entry(hdr *tar.Header, r io.Reader) error {
	name := hdr.Name
	depth, err := validName(name)
	if err != nil {
		return streamErr(err)
	}
	for k := range hdr.PAXRecords {
		if strings.HasPrefix(k, "GNU.sparse.") {
			return streamErr(fmt.Errorf("%q: sparse files are not part of the format", streamName(name)))
		}
	}
	if hdr.Size != 0 && hdr.Typeflag != tar.TypeReg {
		return streamErr(fmt.Errorf("%q: data in an entry that is not a regular file", streamName(name)))
	}
	if x.excluded(name) {
		// Its data is skipped, but counted: a stream's bytes are bounded
		// whatever they are for.
		if x.bytes += hdr.Size; hdr.Size < 0 || x.bytes > x.lim.bytes {
			return errdefs.New(errdefs.ErrResourceExhausted, "more than %d bytes (%.1f GiB) of files: a commit holds at most that", x.lim.bytes, float64(x.lim.bytes)/(1<<30))
		}
		return nil
	}
	if depth > x.lim.depth {
		return errdefs.New(errdefs.ErrFailedPrecondition, "more than %d levels of directories: a commit holds at most %d", x.lim.depth, x.lim.depth)
	}
	if len(name) > x.maxPath {
		return errdefs.New(errdefs.ErrFailedPrecondition, "path longer than %d bytes: too long for a layer", x.maxPath)
	}
	if x.entries++; x.entries > x.lim.entries {
		return errdefs.New(errdefs.ErrResourceExhausted, "more than %d files and directories: a commit holds at most %d", x.lim.entries, x.lim.entries)
	}
	pdir, base := path.Dir(name), path.Base(name)
	pfd, err := x.dir(pdir)
	if err != nil {
		return streamErr(err)
	}
	exists := func(err error) error {
		if errors.Is(err, unix.EEXIST) {
			return streamErr(fmt.Errorf("%q appears twice", streamName(name)))
		}
		return err
	}
	switch hdr.Typeflag {
	case tar.TypeDir:
		if err := unix.Mkdirat(pfd, base, 0o700); err != nil {
			return exists(err)
		}
		fd, err := openBeneath(pfd, base, unix.O_RDONLY|unix.O_DIRECTORY)
		if err != nil {
			return err
		}
		// Its entries most likely come next: keep it open in the chain.
		x.chain = append(x.chain, openDir{rel: name, fd: fd})
		return x.meta(xfd{fd: fd}, hdr, true, false)
	case tar.TypeReg:
		if hdr.Size < 0 {
			return streamErr(fmt.Errorf("%q: negative size", streamName(name)))
		}
		if x.bytes += hdr.Size; x.bytes > x.lim.bytes {
			return errdefs.New(errdefs.ErrResourceExhausted, "more than %d bytes (%.1f GiB) of files: a commit holds at most that", x.lim.bytes, float64(x.lim.bytes)/(1<<30))
		}
		fd, err := openBeneath(pfd, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL)
		if err != nil {
			return exists(err)
		}
		f := os.NewFile(uintptr(fd), base)
		defer f.Close()
		// The tar reader gives exactly hdr.Size bytes, or an error.
		n, err := io.Copy(f, r)
		if err != nil {
			return streamErr(fmt.Errorf("%q: %w", streamName(name), err))
		}
		if n != hdr.Size {
			return streamErr(fmt.Errorf("%q: %d bytes, not %d", streamName(name), n, hdr.Size))
		}
		x.rep.update(x.bytes, 0)
		if err := x.meta(xfd{fd: fd}, hdr, false, false); err != nil {
			return err
		}
		return f.Close()
	case tar.TypeSymlink:
		t := hdr.Linkname
		if t == "" || len(t) >= unix.PathMax || strings.IndexByte(t, 0) >= 0 {
			return streamErr(fmt.Errorf("%q: bad symlink target", streamName(name)))
		}
		if err := unix.Symlinkat(t, pfd, base); err != nil {
			return exists(err)
		}
		return x.metaAt(pfd, base, hdr, true)
	case tar.TypeChar:
		if hdr.Devmajor != 0 || hdr.Devminor != 0 {
			return errdefs.New(errdefs.ErrFailedPrecondition, "a character device (%d:%d): device nodes are not allowed in a layer (only overlay whiteouts, 0:0)", hdr.Devmajor, hdr.Devminor)
		}
		if err := unix.Mknodat(pfd, base, unix.S_IFCHR|uint32(hdr.Mode&0o7777), 0); err != nil {
			return exists(err)
		}
		return x.metaAt(pfd, base, hdr, false)
	case tar.TypeLink:
		return x.link(hdr, pfd, base)
	case tar.TypeBlock:
		return errdefs.New(errdefs.ErrFailedPrecondition, "a block device: device nodes are not allowed in a layer")
	case tar.TypeFifo:
		return errdefs.New(errdefs.ErrFailedPrecondition, "a fifo: fifos are not allowed in a layer")
	default:
		return streamErr(fmt.Errorf("%q: entry type %q is not part of the format", streamName(name), hdr.Typeflag))
	}
}

// link makes base in the directory pfd a hard link to the earlier regular
// file hdr.Linkname, opened below the root without following anything.
func (x *streamExtractor) link(hdr *tar.Header, pfd int, base string) error {
	target := hdr.Linkname
	if _, err := validName(target); err != nil {
		return streamErr(fmt.Errorf("hard link target: %w", err))
	}
	// Open the target first: dir may reshape the chain, which pfd is in.
	tdir, err := x.dir(path.Dir(target))
	if err != nil {
		return streamErr(fmt.Errorf("hard link target: %w", err))
	}
	fd, err := openBeneath(tdir, path.Base(target), unix.O_PATH)
	if err != nil {
		return streamErr(fmt.Errorf("hard link to %q, which is not an earlier file of the stream: %w", streamName(target), err))
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return streamErr(fmt.Errorf("hard link to %q, which is not a regular file", streamName(target)))
	}
	pfd, err = x.dir(path.Dir(hdr.Name))
	if err != nil {
		return streamErr(err)
	}
	if err := unix.Linkat(fd, "", pfd, base, unix.AT_EMPTY_PATH); err != nil {
		if errors.Is(err, unix.EEXIST) {
			return streamErr(fmt.Errorf("%q appears twice", streamName(hdr.Name)))
		}
		return err
	}
	return nil
}

// metaAt gives the symlink or whiteout base, just made in pfd, hdr's
// metadata through an O_PATH descriptor.
func (x *streamExtractor) metaAt(pfd int, base string, hdr *tar.Header, symlink bool) error {
	fd, err := openBeneath(pfd, base, unix.O_PATH)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return x.meta(xfd{fd: fd, opath: true}, hdr, false, symlink)
}

// meta gives dst the owner, the extended attributes (filtered as
// copyXattrs does) and the mode of hdr, in that order (see
// upperWalker.meta).
func (x *streamExtractor) meta(dst xfd, hdr *tar.Header, isDir, symlink bool) error {
	if hdr.Uid < 0 || hdr.Gid < 0 || hdr.Uid >= 1<<32-1 || hdr.Gid >= 1<<32-1 {
		return streamErr(fmt.Errorf("bad owner %d:%d", hdr.Uid, hdr.Gid))
	}
	uid, gid := hdr.Uid, hdr.Gid
	if hdr.Typeflag == tar.TypeChar {
		uid, gid = 0, 0 // a whiteout: see upperWalker.meta
	}
	if err := unix.Fchownat(dst.fd, "", uid, gid, unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("chown: %w", err)
	}
	for k, v := range hdr.PAXRecords {
		n, ok := strings.CutPrefix(k, "SCHILY.xattr.")
		if !ok {
			continue
		}
		if n == "" {
			return streamErr(errors.New("an extended attribute without a name"))
		}
		keep, err := keepXattr(n, []byte(v), isDir)
		if err != nil {
			return err
		}
		if !keep {
			continue
		}
		if err := dst.setxattr(n, []byte(v)); err != nil {
			return fmt.Errorf("set xattr %s: %w", n, err)
		}
	}
	if symlink {
		return nil
	}
	if err := dst.chmod(uint32(hdr.Mode) & 0o7777); err != nil {
		return fmt.Errorf("chmod: %w", err)
	}
	return nil
}

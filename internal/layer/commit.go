package layer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// CommitOptions says which overlay upper directory to turn into a layer.
type CommitOptions struct {
	// Tenant is the namespace of the tag (owner.go); "" for a shared one
	// (the admin's).
	Tenant string

	Kind        Kind // workspace or toolkit
	Name        string
	Version     string
	Compression string
	// Upper is the writable upper directory of an overlay (a sandbox's).
	// It is read, never modified, and only through file descriptors (see
	// Commit); the overlay may stay mounted.
	Upper string
	// Export, if not nil, stands for Upper when the writable layer is not
	// on this host's file system (a VM's is inside its guest): it returns
	// the upper as a commit stream (see commit_stream.go), which is read
	// as the untrusted input it is; the reader is closed when the copy is
	// over. Freeze is not called: the producer stops the sandbox's
	// writers for as long as it sends (a VM's agent stops its processes).
	// maxDepth is the commit's depth bound, for the producer not to walk
	// deeper than the host accepts.
	Export func(ctx context.Context, maxDepth int) (io.ReadCloser, error)
	// Exclude lists paths of the sandbox's root ("/.shoal") left out of the
	// layer, with everything under them.
	Exclude []string
	// Origin is recorded as the layer's Source ("commit of sandbox ID").
	Origin string
	// Freeze, if not nil, is called before the upper is read, to stop
	// whatever writes to it (the node freezes the sandbox). The thaw
	// function it returns, if not nil, is called as soon as the copy is
	// over, whether it worked or not, before the image is built. An error
	// fails the commit.
	Freeze func(ctx context.Context) (thaw func(), err error)
	// Bounds of what a commit copies from the upper; zero means the
	// default (DefaultCommitMaxBytes, DefaultCommitMaxEntries,
	// DefaultCommitMaxDepth). Bytes are the sum of the regular files'
	// sizes (a file with several links counted once).
	MaxBytes   int64
	MaxEntries int64
	MaxDepth   int
	Progress   func(Progress)
	// IDMap, if not nil, is the host range of the sandbox's user namespace:
	// the upper holds host ids of that range, which the layer stores as the
	// sandbox's own (host id HostUID+u as u), so that the layer means the
	// same in any sandbox; an id outside the range is stored as what the
	// sandbox saw it as, the overflow id 65534.
	IDMap *sandbox.IDMap
}

// Default bounds of a commit (see CommitOptions).
const (
	DefaultCommitMaxBytes   int64 = 64 << 30
	DefaultCommitMaxEntries int64 = 4 << 20
	// DefaultCommitMaxDepth: levels of directories below the root. Far
	// deeper trees crash mkfs.erofs (1.5, at ~1,950 levels).
	DefaultCommitMaxDepth = 256
)

// Overlayfs's extended attributes (the "trusted." namespace: overlays
// mounted by root without userxattr).
const (
	ovlPrefix   = "trusted.overlay."
	ovlOpaque   = ovlPrefix + "opaque"
	ovlRedirect = ovlPrefix + "redirect"
	ovlMetacopy = ovlPrefix + "metacopy"
)

// Commit makes a layer of an overlay upper directory. The upper is copied
// to scratch space first (so the overlay's private attributes are left
// behind, and the image is built from a tree nobody else writes to),
// keeping what overlayfs needs to read the layer as a lower the way it read
// the upper:
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
// The upper belongs to a sandbox that may be hostile, so it is read the
// way an untrusted tree must be: through file descriptors, one name at a
// time below a directory already open (openat2 with RESOLVE_BENEATH,
// RESOLVE_NO_SYMLINKS, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_XDEV and
// O_NOFOLLOW), each entry opened as an O_PATH descriptor first and typed by
// fstat on it. Symlinks are read from that descriptor (readlinkat) and kept
// as symlinks, never followed; a regular file is opened for reading through
// its descriptor (so never a device or a fifo put in its place) with
// O_NONBLOCK, checked to be the same regular file, and at most the size it
// had is copied. The copy is made with descriptors too (mkdirat, openat
// with O_EXCL, fchown, fchmod, fsetxattr on what was just created): nothing
// outside the upper is read and nothing outside the scratch tree written,
// whatever the sandbox swaps in during the commit. o.Freeze stops the
// sandbox for the copy, so that the copy is a consistent snapshot; without
// it, files written during the copy may be caught half-way.
//
// The upper is walked twice (a scan, then the copy) and refused, before
// anything is copied, when it is deeper than MaxDepth or has paths too
// long for the scratch tree (errdefs.ErrFailedPrecondition), or more than
// MaxEntries entries or MaxBytes bytes (errdefs.ErrResourceExhausted).
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
	if spec.tenant, err = checkTenant(o.Tenant); err != nil {
		return Layer{}, err
	}
	if o.Kind == KindBase {
		return Layer{}, errdefs.New(errdefs.ErrInvalidArgument, "a commit is a workspace or a toolkit layer, not a base: it holds the changes made on top of other layers")
	}
	lim, err := o.limits()
	if err != nil {
		return Layer{}, err
	}
	exclude := map[string]bool{}
	for _, p := range o.Exclude {
		rel, err := cleanName(p)
		if err != nil || rel == "." {
			return Layer{}, errdefs.New(errdefs.ErrInvalidArgument, "exclude %q: want a path below /", p)
		}
		exclude[rel] = true
	}
	if o.Export == nil {
		root, err := openUpper(o.Upper)
		if err != nil {
			return Layer{}, err
		}
		root.Close()
	}
	work, err := os.MkdirTemp(s.tmp, "commit-")
	if err != nil {
		return Layer{}, err
	}
	defer os.RemoveAll(work)

	tree := filepath.Join(work, "root")
	copyFn := copyUpper
	if o.Export != nil {
		copyFn = copyExport
	}
	if err := copyFn(ctx, o, tree, exclude, lim, rep); err != nil {
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

// commitLimits are a commit's bounds, defaults applied.
type commitLimits struct {
	bytes, entries int64
	depth          int
}

func (o CommitOptions) limits() (commitLimits, error) {
	if o.MaxBytes < 0 || o.MaxEntries < 0 || o.MaxDepth < 0 {
		return commitLimits{}, errdefs.New(errdefs.ErrInvalidArgument, "negative commit bound (bytes %d, entries %d, depth %d)", o.MaxBytes, o.MaxEntries, o.MaxDepth)
	}
	l := commitLimits{bytes: o.MaxBytes, entries: o.MaxEntries, depth: o.MaxDepth}
	if l.bytes == 0 {
		l.bytes = DefaultCommitMaxBytes
	}
	if l.entries == 0 {
		l.entries = DefaultCommitMaxEntries
	}
	if l.depth == 0 {
		l.depth = DefaultCommitMaxDepth
	}
	return l, nil
}

// openUpper opens the upper directory itself (a path of the node's, not
// the sandbox's), refusing a symlink.
func openUpper(upper string) (*os.File, error) {
	fd, err := unix.Open(upper, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "no writable layer at %s: %v", upper, err)
	}
	return os.NewFile(uintptr(fd), upper), nil
}

// copyUpper freezes the upper's writers (o.Freeze), checks the upper
// against the bounds and copies it to tree, then thaws them.
func copyUpper(ctx context.Context, o CommitOptions, tree string, exclude map[string]bool, lim commitLimits, rep *reporter) error {
	frozen := false
	if o.Freeze != nil {
		thaw, err := o.Freeze(ctx)
		if err != nil {
			return err
		}
		if thaw != nil {
			defer thaw()
			frozen = true
		} else {
			rep.note("the sandbox cannot be frozen: files written during the copy may be caught half-way")
		}
	}
	// The longest path below tree that system calls accept (PATH_MAX
	// counts the terminating NUL); mkfs.erofs reads the tree by path.
	maxPath := unix.PathMax - 1 - len(tree) - 1

	scan := &upperWalker{exclude: exclude, lim: lim, maxPath: maxPath, links: map[[2]uint64]string{}}
	if err := scan.walk(ctx, o.Upper, -1); err != nil {
		return err
	}
	how := ""
	if frozen {
		how = ", sandbox frozen"
	}
	rep.start(StageCopy, "bytes", scan.bytes, "copying the sandbox's changes (%d entries, %.1f MiB%s)", scan.entries, mib(scan.bytes), how)

	if err := os.Mkdir(tree, 0o755); err != nil {
		return err
	}
	dst, err := unix.Open(tree, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(dst)
	c := &upperWalker{exclude: exclude, lim: lim, maxPath: maxPath, links: map[[2]uint64]string{},
		copy: true, dstRoot: dst, rep: rep, total: scan.bytes, idmap: o.IDMap}
	return c.walk(ctx, o.Upper, dst)
}

// upperWalker walks an overlay upper directory through file descriptors
// (see Commit), checking it against the bounds and, with copy set, copying
// it into the directory open as dstRoot. Not safe for concurrent use.
type upperWalker struct {
	exclude map[string]bool // paths relative to the root, left out
	lim     commitLimits
	maxPath int // the longest relative path allowed, in bytes
	// links maps the (dev, ino) of files with several links to the path of
	// their first link, relative to the root (in the copy, for linkat).
	links map[[2]uint64]string

	idmap *sandbox.IDMap // see CommitOptions.IDMap

	copy    bool // false: only count and check
	dstRoot int  // the copy's root directory (copy)
	rep     *reporter
	total   int64 // bytes to copy, for progress (copy)

	entries int64 // entries met, the root not counted
	bytes   int64 // sizes of the regular files met, each inode once
	copied  int64 // bytes copied (copy)
}

// entryError is an error about one entry of the upper, named by its path
// in the sandbox.
type entryError struct {
	rel string // relative to the root; "." for the root
	err error
}

func (e *entryError) Error() string {
	p := "/"
	if e.rel != "." {
		p += e.rel
	}
	if len(p) > 240 { // deep trees: keep the message readable
		p = p[:100] + "..." + p[len(p)-100:]
	}
	return p + ": " + e.err.Error()
}

func (e *entryError) Unwrap() error { return e.err }

// walk walks the upper at path upper; with copy set, dst is the open copy
// of its root.
func (w *upperWalker) walk(ctx context.Context, upper string, dst int) error {
	root, err := openUpper(upper)
	if err != nil {
		return err
	}
	defer root.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(root.Fd()), &st); err != nil {
		return err
	}
	if err := w.dir(ctx, root, dst, ".", 0); err != nil {
		return err
	}
	if w.copy {
		if err := w.meta(xfd{fd: int(root.Fd())}, xfd{fd: dst}, &st); err != nil {
			return &entryError{".", err}
		}
	}
	return nil
}

// dir walks the entries of the directory src (rel, at depth levels below
// the root); dst is its open copy (copy). Entries come in directory order:
// mkfs.erofs sorts them.
func (w *upperWalker) dir(ctx context.Context, src *os.File, dst int, rel string, depth int) error {
	srcFD := int(src.Fd())
	for {
		names, err := src.Readdirnames(256)
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return &entryError{rel, fmt.Errorf("read directory: %w", err)}
		}
		for _, name := range names {
			if err := ctx.Err(); err != nil {
				return err
			}
			crel := name
			if rel != "." {
				crel = rel + "/" + name
			}
			if name == "" || name == "." || name == ".." || strings.ContainsRune(name, '/') {
				return &entryError{rel, fmt.Errorf("bad directory entry name %q", name)}
			}
			if w.exclude[crel] {
				continue
			}
			if err := w.entry(ctx, srcFD, dst, name, crel, depth+1); err != nil {
				var ee *entryError
				if !errors.As(err, &ee) && ctx.Err() == nil {
					err = &entryError{crel, err}
				}
				return err
			}
		}
	}
}

// resolveBeneath is how every name of the upper is opened: one component
// below a directory already open, never through a symlink or a magic link,
// never onto another mount.
const resolveBeneath = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV

// openBeneath opens name (one path component) in the directory dirfd.
func openBeneath(dirfd int, name string, flags int) (int, error) {
	for try := 0; ; try++ {
		fd, err := unix.Openat2(dirfd, name, &unix.OpenHow{Flags: uint64(flags | unix.O_NOFOLLOW | unix.O_CLOEXEC), Resolve: resolveBeneath})
		if (errors.Is(err, unix.EINTR) || errors.Is(err, unix.EAGAIN)) && try < 100 {
			continue // EAGAIN: a rename raced with RESOLVE_BENEATH's checks
		}
		if errors.Is(err, unix.ENOSYS) {
			// Before Linux 5.6. name is one component: O_NOFOLLOW is
			// enough to never follow a symlink.
			return unix.Openat(dirfd, name, flags|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		}
		return fd, err
	}
}

// entry checks, and with copy set copies, the entry name of the directory
// srcDir (rel, depth levels below the root) into dstDir.
func (w *upperWalker) entry(ctx context.Context, srcDir, dstDir int, name, rel string, depth int) error {
	if depth > w.lim.depth {
		return errdefs.New(errdefs.ErrFailedPrecondition, "more than %d levels of directories: a commit holds at most %d", w.lim.depth, w.lim.depth)
	}
	if len(rel) > w.maxPath {
		return errdefs.New(errdefs.ErrFailedPrecondition, "path longer than %d bytes: too long for a layer", w.maxPath)
	}
	if w.entries++; w.entries > w.lim.entries {
		return errdefs.New(errdefs.ErrResourceExhausted, "more than %d files and directories: a commit holds at most %d", w.lim.entries, w.lim.entries)
	}
	fd, err := openBeneath(srcDir, name, unix.O_PATH)
	if err != nil {
		return err
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return err
	}
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		// The directory itself, opened for reading through the O_PATH
		// descriptor ("." never leaves it); one descriptor per level.
		d, err := unix.Openat(fd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		unix.Close(fd)
		if err != nil {
			return err
		}
		src := os.NewFile(uintptr(d), rel)
		defer src.Close()
		return w.subdir(ctx, src, dstDir, name, rel, depth, &st)
	}
	defer unix.Close(fd)
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		return w.file(fd, dstDir, name, rel, &st)
	case unix.S_IFLNK:
		target, err := readlinkFd(fd)
		if err != nil {
			return err
		}
		if !w.copy {
			return nil
		}
		if err := unix.Symlinkat(target, dstDir, name); err != nil {
			return err
		}
		return w.metaAt(xfd{fd: fd, opath: true}, dstDir, name, &st)
	case unix.S_IFCHR:
		if st.Rdev != 0 {
			return errdefs.New(errdefs.ErrFailedPrecondition, "a character device (%d:%d): device nodes are not allowed in a layer (only overlay whiteouts, 0:0)", unix.Major(st.Rdev), unix.Minor(st.Rdev))
		}
		if !w.copy {
			return nil
		}
		if err := unix.Mknodat(dstDir, name, unix.S_IFCHR|(st.Mode&0o7777), 0); err != nil {
			return fmt.Errorf("make whiteout: %w", err)
		}
		return w.metaAt(xfd{fd: fd, opath: true}, dstDir, name, &st)
	case unix.S_IFSOCK:
		if w.copy {
			w.rep.note("skipping socket /%s: a layer cannot hold sockets", rel)
		}
		return nil
	case unix.S_IFBLK:
		return errdefs.New(errdefs.ErrFailedPrecondition, "a block device: device nodes are not allowed in a layer")
	case unix.S_IFIFO:
		return errdefs.New(errdefs.ErrFailedPrecondition, "a fifo: fifos are not allowed in a layer")
	default:
		return fmt.Errorf("unknown file type %#o", st.Mode&unix.S_IFMT)
	}
}

// subdir walks the directory src, and with copy set makes its copy in
// dstDir, metadata last (a read-only directory can still be filled).
func (w *upperWalker) subdir(ctx context.Context, src *os.File, dstDir int, name, rel string, depth int, st *unix.Stat_t) error {
	if !w.copy {
		return w.dir(ctx, src, -1, rel, depth)
	}
	if err := unix.Mkdirat(dstDir, name, 0o700); err != nil {
		return err
	}
	dst, err := openBeneath(dstDir, name, unix.O_RDONLY|unix.O_DIRECTORY)
	if err != nil {
		return err
	}
	defer unix.Close(dst)
	if err := w.dir(ctx, src, dst, rel, depth); err != nil {
		return err
	}
	return w.meta(xfd{fd: int(src.Fd())}, xfd{fd: dst}, st)
}

// file counts, and with copy set copies, the regular file open as the
// O_PATH descriptor fd.
func (w *upperWalker) file(fd, dstDir int, name, rel string, st *unix.Stat_t) error {
	if st.Nlink > 1 {
		key := [2]uint64{st.Dev, st.Ino}
		if first, ok := w.links[key]; ok {
			if !w.copy {
				return nil
			}
			return unix.Linkat(w.dstRoot, first, dstDir, name, 0)
		}
		w.links[key] = rel
	}
	if w.bytes += st.Size; w.bytes > w.lim.bytes {
		return errdefs.New(errdefs.ErrResourceExhausted, "more than %d bytes (%.1f GiB) of files: a commit holds at most that", w.lim.bytes, float64(w.lim.bytes)/(1<<30))
	}
	if !w.copy {
		return nil
	}
	// Open the very inode fd refers to (its magic link in /proc is our
	// own, not the sandbox's), non-blocking, and check it is still that
	// regular file.
	in, err := unix.Open("/proc/self/fd/"+strconv.Itoa(fd), unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open: %w", err)
	}
	inF := os.NewFile(uintptr(in), rel)
	defer inF.Close()
	var ist unix.Stat_t
	if err := unix.Fstat(in, &ist); err != nil {
		return err
	}
	if ist.Mode&unix.S_IFMT != unix.S_IFREG || ist.Dev != st.Dev || ist.Ino != st.Ino {
		return fmt.Errorf("changed while being committed (opened mode %#o)", ist.Mode)
	}
	out, err := openBeneath(dstDir, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL)
	if err != nil {
		return err
	}
	outF := os.NewFile(uintptr(out), name)
	defer outF.Close()
	// At most the size it had: a file that grows is not followed.
	n, err := io.Copy(outF, &io.LimitedReader{R: inF, N: st.Size}) // copy_file_range: a reflink where the file system can
	w.copied += n
	w.rep.update(min(w.copied, w.total), w.total)
	if err != nil {
		return err
	}
	if err := w.meta(xfd{fd: in}, xfd{fd: out}, st); err != nil {
		return err
	}
	return outF.Close()
}

// readlinkFd reads the symlink open as the O_PATH descriptor fd.
func readlinkFd(fd int) (string, error) {
	for size := 256; ; size *= 4 {
		buf := make([]byte, size)
		n, err := unix.Readlinkat(fd, "", buf)
		if err != nil {
			return "", fmt.Errorf("read symlink: %w", err)
		}
		if n < size {
			return string(buf[:n]), nil
		}
	}
}

// metaAt gives the entry name just made in dstDir (a symlink or a
// whiteout) the metadata of src, through an O_PATH descriptor of it.
func (w *upperWalker) metaAt(src xfd, dstDir int, name string, st *unix.Stat_t) error {
	fd, err := openBeneath(dstDir, name, unix.O_PATH)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return w.meta(src, xfd{fd: fd, opath: true}, st)
}

// meta gives dst the owner, extended attributes (filtered: see Commit) and
// mode st and src have, in that order: a chown clears set-id bits and file
// capabilities, a mode change does not. A symlink's mode is not changed.
func (w *upperWalker) meta(src, dst xfd, st *unix.Stat_t) error {
	uid, gid := st.Uid, st.Gid
	switch {
	case st.Mode&unix.S_IFMT == unix.S_IFCHR:
		// A whiteout (the only device a commit holds): overlayfs makes it
		// as whoever mounted the overlay (the host's root, outside a
		// container's id range; a VM guest's root), and its owner means
		// nothing. Stored as 0:0, so that the same changes make the same
		// layer on every backend.
		uid, gid = 0, 0
	case w.idmap != nil:
		uid, gid = w.idmap.FromHost(uid, gid)
	}
	if err := unix.Fchownat(dst.fd, "", int(uid), int(gid), unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("chown: %w", err)
	}
	if err := copyXattrs(src, dst, st.Mode&unix.S_IFMT == unix.S_IFDIR); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT == unix.S_IFLNK {
		return nil
	}
	if err := dst.chmod(st.Mode & 0o7777); err != nil {
		return fmt.Errorf("chmod: %w", err)
	}
	return nil
}

// xfd is an open descriptor for extended attributes and modes: a regular
// one, or an O_PATH one (of a symlink or a whiteout), which the f*xattr
// calls refuse and which is reached through its /proc/self/fd magic link
// instead (that link leads to the very inode, a symlink included, and is
// ours: the sandbox cannot change it).
type xfd struct {
	fd    int
	opath bool
}

func (x xfd) proc() string { return "/proc/self/fd/" + strconv.Itoa(x.fd) }

func (x xfd) listxattr(buf []byte) (int, error) {
	if x.opath {
		return unix.Listxattr(x.proc(), buf)
	}
	return unix.Flistxattr(x.fd, buf)
}

func (x xfd) getxattr(name string, buf []byte) (int, error) {
	if x.opath {
		return unix.Getxattr(x.proc(), name, buf)
	}
	return unix.Fgetxattr(x.fd, name, buf)
}

func (x xfd) setxattr(name string, v []byte) error {
	if x.opath {
		return unix.Setxattr(x.proc(), name, v, 0)
	}
	return unix.Fsetxattr(x.fd, name, v, 0)
}

// chmod changes the mode of a regular file, a directory or (O_PATH) a
// whiteout, never of a symlink (whose magic link would not be followed
// further, but chmod of a symlink is meaningless anyway).
func (x xfd) chmod(mode uint32) error {
	if x.opath {
		return unix.Chmod(x.proc(), mode)
	}
	return unix.Fchmod(x.fd, mode)
}

// copyXattrs copies src's extended attributes to dst, keeping of
// overlayfs's own only the opaque flag of directories.
func copyXattrs(src, dst xfd, isDir bool) error {
	names, err := listXattrsFd(src)
	if err != nil {
		return err
	}
	for _, n := range names {
		if _, err := keepXattr(n, nil, isDir); err != nil {
			return err
		}
		v, err := getXattrFd(src, n)
		if errors.Is(err, unix.ENODATA) {
			continue
		}
		if err != nil {
			if strings.HasPrefix(n, ovlPrefix) {
				continue
			}
			return fmt.Errorf("read xattr %s: %w", n, err)
		}
		if keep, _ := keepXattr(n, v, isDir); !keep {
			continue
		}
		if err := dst.setxattr(n, v); err != nil {
			return fmt.Errorf("set xattr %s: %w", n, err)
		}
	}
	return nil
}

// keepXattr says whether a commit keeps the extended attribute n (value v)
// of an entry of an upper directory: of overlayfs's own only the opaque
// flag of a directory ("y"), and an error for a redirect or a metacopy,
// which a commit cannot carry; every other attribute is kept.
func keepXattr(n string, v []byte, isDir bool) (bool, error) {
	if !strings.HasPrefix(n, ovlPrefix) {
		return true, nil
	}
	switch n {
	case ovlRedirect, ovlMetacopy:
		return false, errdefs.New(errdefs.ErrFailedPrecondition, "has overlay attribute %s (a renamed directory or a metadata-only copy): not supported in a commit; mount overlays with redirect_dir=off, metacopy=off", n)
	case ovlOpaque:
		return isDir && string(v) == "y", nil
	}
	return false, nil
}

func listXattrsFd(x xfd) ([]string, error) { return listXattrNames(x.listxattr) }

// listXattrNames calls list (listxattr and friends) with a buffer that
// grows until the names fit, and splits them.
func listXattrNames(list func(buf []byte) (int, error)) ([]string, error) {
	buf := make([]byte, 1024)
	for {
		n, err := list(buf)
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

func getXattrFd(x xfd, name string) ([]byte, error) {
	buf := make([]byte, 256)
	for {
		n, err := x.getxattr(name, buf)
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

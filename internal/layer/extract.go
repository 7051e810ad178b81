package layer

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"

	"github.com/klauspost/compress/zstd"
	"golang.org/x/sys/unix"
)

// treeStats counts what goes into an image, for progress lines.
type treeStats struct {
	files int   // entries other than the root directory
	bytes int64 // sum of regular file sizes
	// devLeftOut: the device nodes under dev/ a build leaves out
	// (relative paths; see underDev).
	devLeftOut []string
}

// maxDevLeftOut bounds the device nodes under /dev a build leaves out (each
// is an argument of mkfs.erofs); debootstrap makes ten or so.
const maxDevLeftOut = 256

// underDev tells whether rel (a cleaned path relative to the root of the
// tree) is below its /dev. A root made by debootstrap or docker export holds
// device nodes there (/dev/console, /dev/null...); a build leaves them out,
// as the sandbox gets its own /dev. A device node anywhere else is refused.
func underDev(rel string) bool { return strings.HasPrefix(rel, "dev/") }

// noteDevLeftOut sends the one warning line of a build that left device
// nodes under /dev out.
// noteDevLeftOut sends the one warning line of a build that left n device
// nodes under /dev out, rels the first of them.
func noteDevLeftOut(rep *reporter, rels []string, n int) {
	if n == 0 {
		return
	}
	const shown = 6
	list := "/" + strings.Join(rels[:min(len(rels), shown)], ", /")
	if n > shown {
		list += fmt.Sprintf(" and %d more", n-shown)
	}
	rep.note("warning: left out %d device node(s) under /dev (%s): the sandbox gets its own /dev", n, list)
}

// Magic numbers of the compressions a tarball may come in.
var (
	gzipMagic = []byte{0x1f, 0x8b}
	zstdMagic = []byte{0x28, 0xb5, 0x2f, 0xfd}
)

// tarFile is an open tarball, decompressed if need be.
type tarFile struct {
	f           *os.File
	r           io.Reader // the uncompressed tar stream
	compression string    // "tar", "tar.gz" or "tar.zst"
	closeFn     func()
}

func (t *tarFile) Close() {
	if t.closeFn != nil {
		t.closeFn()
	}
	t.f.Close()
}

// openTar opens a tar file, plain or gzip- or zstd-compressed (told apart by
// their magic numbers, not by the file name). Reads of the file are reported
// to rep, if not nil, against the file's size. A file that is none of these
// is refused.
func openTar(src string, rep *reporter) (*tarFile, error) {
	f, err := os.Open(src)
	if err != nil {
		return nil, err
	}
	var raw io.Reader = f
	if rep != nil {
		if fi, err := f.Stat(); err == nil {
			raw = &countingReader{r: f, total: fi.Size(), rep: rep}
		}
	}
	br := bufio.NewReaderSize(raw, 1<<20)
	t := &tarFile{f: f, r: br, compression: "tar"}
	magic, _ := br.Peek(4)
	switch {
	case bytes.HasPrefix(magic, gzipMagic):
		zr, err := gzip.NewReader(br)
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("gzip: %w", err)
		}
		zr.Multistream(true)
		t.r, t.compression, t.closeFn = zr, "tar.gz", func() { zr.Close() }
	case bytes.HasPrefix(magic, zstdMagic):
		zr, err := zstd.NewReader(br, zstd.WithDecoderConcurrency(1))
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("zstd: %w", err)
		}
		t.r, t.compression, t.closeFn = zr, "tar.zst", zr.Close
	}
	// Check that it is a tar: the "ustar" magic of the first header block
	// (POSIX, GNU and PAX archives all have it).
	head := bufio.NewReaderSize(t.r, 4096)
	block, err := head.Peek(512)
	if err != nil || !bytes.Equal(block[257:262], []byte("ustar")) {
		t.Close()
		return nil, errors.New("not a tar archive (plain, gzip or zstd compressed)")
	}
	t.r = head
	return t, nil
}

// imageEntryRE matches the names an image archive (docker save, OCI image
// layout as a tar) starts with, and a root file system tarball never does.
var imageEntryRE = regexp.MustCompile(`^(\./)?(oci-layout|index\.json|manifest\.json|repositories|blobs(/.*)?|(sha256:)?[0-9a-f]{64}(\.json|\.tar(\.gz|\.zst)?|/.*)?)$`)

// Layouts of a tar file.
const (
	layoutRootfs        = "rootfs"         // a root file system
	layoutDockerArchive = "docker-archive" // `docker save`: manifest.json at the root
	layoutOCIArchive    = "oci-archive"    // an OCI image layout: oci-layout at the root
)

// tarLayout says what a tar file holds, from its entries, and how it is
// compressed ("tar", "tar.gz", "tar.zst"). Only the first entry is read of
// a root file system tarball; an image archive is read to its end.
func tarLayout(src string) (layout, compression string, err error) {
	t, err := openTar(src, nil)
	if err != nil {
		return "", "", err
	}
	defer t.Close()
	tr := tar.NewReader(t.r)
	hdr, err := tr.Next()
	for err == nil && path.Clean(hdr.Name) == "." { // `tar -C dir -cf x.tar .` starts with "./"
		hdr, err = tr.Next()
	}
	if err == io.EOF {
		return layoutRootfs, t.compression, nil
	}
	if err != nil {
		return "", "", err
	}
	if !imageEntryRE.MatchString(strings.TrimSuffix(hdr.Name, "/")) {
		return layoutRootfs, t.compression, nil
	}
	var manifest, ociLayout bool
	for ; err == nil; hdr, err = tr.Next() {
		switch path.Clean(hdr.Name) {
		case "manifest.json":
			manifest = true
		case "oci-layout":
			ociLayout = true
		}
	}
	if err != io.EOF {
		return "", "", err
	}
	switch {
	case manifest:
		return layoutDockerArchive, t.compression, nil
	case ociLayout:
		return layoutOCIArchive, t.compression, nil
	}
	return "", "", errors.New("looks like an image archive but has neither manifest.json (docker save) nor oci-layout (OCI image layout)")
}

// decompressTar writes the uncompressed tar stream of src to dst.
func decompressTar(src, dst string) error {
	t, err := openTar(src, nil)
	if err != nil {
		return err
	}
	defer t.Close()
	f, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := io.Copy(f, t.r); err != nil {
		return fmt.Errorf("decompress %s: %w", src, err)
	}
	return f.Close()
}

// checkTree walks a source directory (without following symlinks) and
// refuses device nodes, fifos and sockets, which a layer must not carry;
// with whiteouts set it allows overlayfs whiteouts (character devices 0/0),
// which a committed upper directory holds; without, it lists the device
// nodes under dev/ in devLeftOut (for mkfs.erofs to leave out) rather than
// refusing them. It counts the tree's entries and bytes, reporting them to
// rep.
func checkTree(ctx context.Context, dir string, whiteouts bool, rep *reporter) (treeStats, error) {
	var st treeStats
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if p == dir {
			return nil
		}
		if t := d.Type(); t&(fs.ModeDevice|fs.ModeCharDevice|fs.ModeNamedPipe|fs.ModeSocket) != 0 {
			if whiteouts && isWhiteout(p) {
				st.files++
				return nil
			}
			rel, _ := filepath.Rel(dir, p)
			if !whiteouts && t&fs.ModeDevice != 0 && underDev(filepath.ToSlash(rel)) {
				if len(st.devLeftOut) == maxDevLeftOut {
					return fmt.Errorf("%s: more than %d device nodes under /dev (a build leaves them out, the sandbox gets its own /dev): remove them from the source", rel, maxDevLeftOut)
				}
				st.devLeftOut = append(st.devLeftOut, filepath.ToSlash(rel))
				return nil
			}
			return fmt.Errorf("%s is a %s: device nodes, fifos and sockets are not allowed in a layer (device nodes under /dev only are left out)", rel, typeName(t))
		}
		st.files++
		if d.Type().IsRegular() {
			fi, err := d.Info()
			if err != nil {
				return err
			}
			st.bytes += fi.Size()
		}
		rep.update(int64(st.files), 0)
		return nil
	})
	return st, err
}

// isWhiteout reports whether p is an overlayfs whiteout: a character device
// with device number 0/0.
func isWhiteout(p string) bool {
	var stx unix.Stat_t
	if err := unix.Lstat(p, &stx); err != nil {
		return false
	}
	return stx.Mode&unix.S_IFMT == unix.S_IFCHR && stx.Rdev == 0
}

func typeName(m fs.FileMode) string {
	switch {
	case m&fs.ModeCharDevice != 0:
		return "character device"
	case m&fs.ModeDevice != 0:
		return "block device"
	case m&fs.ModeNamedPipe != 0:
		return "fifo"
	case m&fs.ModeSocket != 0:
		return "socket"
	}
	return m.Type().String()
}

// extractTarball unpacks a tar file (plain, gzip or zstd) into dst, which
// must not exist. It never follows a symlink: every entry is created through
// an os.Root (no path can leave dst), and an entry whose parent is a symlink
// the archive created is refused. Symlinks are kept as they are, absolute or
// not. Hard links must point at an earlier file of the archive. Device nodes
// and fifos are refused, but for the device nodes under /dev of a root
// file system (rootfs set), which are left out with one warning to rep.
// Mode, owner (when running as root), mtime and "SCHILY.xattr." records
// are kept for files and directories. Reads of src are reported to rep.
func extractTarball(ctx context.Context, src, dst string, rootfs bool, rep *reporter) error {
	t, err := openTar(src, rep)
	if err != nil {
		return err
	}
	defer t.Close()
	x, err := newExtractor(dst, false)
	if err != nil {
		return err
	}
	defer x.close()
	x.rootfs = rootfs
	if err := x.apply(ctx, t.r); err != nil {
		return err
	}
	if err := x.finishDirs(); err != nil {
		return err
	}
	noteDevLeftOut(rep, x.devLeftOut, x.devLeft)
	return nil
}

// extractor is the state of one extraction; not safe for concurrent use.
// Several tar streams may be applied in turn to the same tree (the layers
// of an image, bottom first); with whiteouts set, their ".wh." entries
// delete what earlier streams made, as the OCI image spec says.
type extractor struct {
	root *os.Root
	// entries holds every path created so far (cleaned, relative to the
	// root, "." for the root) with its type, and the header of directories,
	// whose metadata is applied once all their children exist.
	entries map[string]*entry
	// whiteouts: ".wh.NAME" deletes NAME of earlier streams and
	// ".wh..wh..opq" empties its directory of what earlier streams put
	// there. Off for root file system tarballs, where they are plain files.
	whiteouts bool
	// current holds the paths the stream being applied created (whiteouts
	// only apply to earlier streams).
	current map[string]bool
	// rootfs: the tree is a root file system, whose device nodes under
	// /dev are left out (underDev): devLeft counts them, devLeftOut holds
	// the first maxDevLeftOut. Else every device node is refused.
	rootfs     bool
	devLeft    int
	devLeftOut []string
	// maxEntries, if not 0, bounds the entries of one stream (pull.go).
	maxEntries int
	// overlay: one OCI layer kept as a layer of its own (pull.go): its
	// whiteouts become overlayfs's (a character device 0/0 for ".wh.NAME",
	// trusted.overlay.opaque=y for ".wh..wh..opq"), for the layers below
	// it in a stack. Exclusive with whiteouts.
	overlay bool
}

// newExtractor makes dst (which must not exist) and returns an extractor
// into it.
func newExtractor(dst string, whiteouts bool) (*extractor, error) {
	if err := os.Mkdir(dst, 0o755); err != nil {
		return nil, err
	}
	root, err := os.OpenRoot(dst)
	if err != nil {
		return nil, err
	}
	return &extractor{root: root, entries: map[string]*entry{".": {typ: tar.TypeDir}}, whiteouts: whiteouts}, nil
}

func (x *extractor) close() { x.root.Close() }

// apply extracts one tar stream into the tree.
func (x *extractor) apply(ctx context.Context, r io.Reader) error {
	x.current = map[string]bool{}
	tr := tar.NewReader(r)
	for n := 1; ; n++ {
		if x.maxEntries > 0 && n > x.maxEntries {
			return fmt.Errorf("more than %d entries", x.maxEntries)
		}
		hdr, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := x.extract(hdr, tr); err != nil {
			return fmt.Errorf("entry %q: %w", hdr.Name, err)
		}
	}
}

type entry struct {
	typ byte        // tar.TypeDir, tar.TypeReg or tar.TypeSymlink
	hdr *tar.Header // directories only; nil for implied parents
}

func (x *extractor) extract(hdr *tar.Header, r io.Reader) error {
	typ := hdr.Typeflag
	switch typ {
	case tar.TypeXGlobalHeader:
		return nil
	case tar.TypeChar, tar.TypeBlock:
		if name, err := cleanName(hdr.Name); err == nil && x.rootfs && underDev(name) {
			if x.devLeft++; len(x.devLeftOut) < maxDevLeftOut {
				x.devLeftOut = append(x.devLeftOut, name)
			}
			return nil
		}
		return fmt.Errorf("%s is a %s: device nodes and fifos are not allowed in a layer (device nodes under /dev only are left out)", path.Clean(hdr.Name), typeName(hdr.FileInfo().Mode()))
	case tar.TypeFifo:
		return fmt.Errorf("%s is a %s: device nodes and fifos are not allowed in a layer", path.Clean(hdr.Name), typeName(hdr.FileInfo().Mode()))
	case tar.TypeReg, tar.TypeCont, tar.TypeGNUSparse: // the reader turns TypeRegA into TypeReg
		typ = tar.TypeReg
	case tar.TypeDir, tar.TypeSymlink, tar.TypeLink:
	default:
		return fmt.Errorf("unsupported tar entry type %q", hdr.Typeflag)
	}
	name, err := cleanName(hdr.Name)
	if err != nil {
		return err
	}
	if x.whiteouts {
		if base := path.Base(name); strings.HasPrefix(base, whiteoutPrefix) {
			return x.whiteout(path.Dir(name), base)
		}
	}
	if x.overlay {
		if base := path.Base(name); strings.HasPrefix(base, whiteoutPrefix) {
			return x.overlayWhiteout(path.Dir(name), base)
		}
	}
	// Only the whiteouts and opaque marks an extraction makes itself may
	// steer overlayfs, in any layer: a tar's own (a redirect, a metacopy)
	// would reach into the layers stacked with it.
	dropOverlayXattrs(hdr)
	if name == "." {
		if typ != tar.TypeDir {
			return errors.New("the root of the archive must be a directory")
		}
		x.entries["."].hdr = hdr
		return nil
	}
	// A directory where this layer whited out what lower layers have:
	// it hides their directory (pull.go).
	hides := x.overlay && x.entries[name] != nil && x.entries[name].typ == tar.TypeChar
	if err := x.prepare(name, typ); err != nil {
		return err
	}
	x.current[name] = true

	switch typ {
	case tar.TypeDir:
		if e := x.entries[name]; e != nil { // a directory again: update metadata
			e.hdr = hdr
			return nil
		}
		if err := x.root.Mkdir(name, 0o700); err != nil {
			return err
		}
		x.entries[name] = &entry{typ: tar.TypeDir, hdr: hdr}
		if hides {
			return x.markOpaque(name)
		}
	case tar.TypeReg:
		f, err := x.root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return err
		}
		defer f.Close()
		if _, err := io.Copy(f, r); err != nil {
			return err
		}
		if err := setMeta(f, hdr); err != nil {
			return err
		}
		if err := f.Close(); err != nil {
			return err
		}
		x.entries[name] = &entry{typ: tar.TypeReg}
	case tar.TypeSymlink:
		if err := x.root.Symlink(hdr.Linkname, name); err != nil {
			return err
		}
		if os.Geteuid() == 0 {
			if err := x.root.Lchown(name, hdr.Uid, hdr.Gid); err != nil {
				return err
			}
		}
		x.entries[name] = &entry{typ: tar.TypeSymlink}
	case tar.TypeLink:
		target, err := cleanName(hdr.Linkname)
		if err != nil {
			return fmt.Errorf("hard link target: %w", err)
		}
		e := x.entries[target]
		if e == nil || e.typ == tar.TypeDir || e.typ == tar.TypeChar {
			return fmt.Errorf("hard link to %q, which is not an earlier file of the archive", hdr.Linkname)
		}
		if err := x.root.Link(target, name); err != nil {
			return err
		}
		x.entries[name] = &entry{typ: e.typ}
	}
	return nil
}

// prepare makes name's parent directories (refusing to go through anything
// but a directory the archive made) and removes an earlier entry at name,
// unless both are directories: in a tar file, the last entry wins.
func (x *extractor) prepare(name string, typ byte) error {
	dir := path.Dir(name)
	var missing []string
	for p := dir; p != "."; p = path.Dir(p) {
		if e := x.entries[p]; e != nil {
			if e.typ != tar.TypeDir {
				return fmt.Errorf("parent %q is not a directory (a %s): refusing to extract through it", p, typeWord(e.typ))
			}
			break
		}
		missing = append(missing, p)
	}
	if len(missing) > 0 {
		if err := x.root.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		for _, p := range missing {
			x.entries[p] = &entry{typ: tar.TypeDir}
			x.current[p] = true
		}
	}
	e := x.entries[name]
	if e == nil || (e.typ == tar.TypeDir && typ == tar.TypeDir) {
		return nil
	}
	return x.remove(name)
}

// remove deletes name (recursively) from the tree and from entries.
func (x *extractor) remove(name string) error {
	e := x.entries[name]
	if e == nil {
		return nil
	}
	if err := x.root.RemoveAll(name); err != nil {
		return err
	}
	delete(x.entries, name)
	if e.typ == tar.TypeDir {
		for p := range x.entries {
			if strings.HasPrefix(p, name+"/") {
				delete(x.entries, p)
			}
		}
	}
	return nil
}

// Whiteout names of the OCI image spec (from AUFS).
const (
	whiteoutPrefix = ".wh."
	whiteoutMeta   = ".wh..wh."     // AUFS metadata, ignored
	whiteoutOpaque = ".wh..wh..opq" // "dir is opaque"
)

// whiteout applies a whiteout entry named base in dir: ".wh..wh..opq"
// removes everything earlier streams put in dir, ".wh.NAME" removes NAME
// (unless this stream made it). Whiteouts of missing paths do nothing.
func (x *extractor) whiteout(dir, base string) error {
	if d := x.entries[dir]; d == nil || d.typ != tar.TypeDir {
		return nil // nothing below to hide
	}
	switch {
	case base == whiteoutOpaque:
		return x.opaque(dir)
	case strings.HasPrefix(base, whiteoutMeta):
		return nil
	}
	name := path.Join(dir, strings.TrimPrefix(base, whiteoutPrefix))
	if name == dir || !filepath.IsLocal(name) {
		return fmt.Errorf("bad whiteout %q", base)
	}
	if x.current[name] {
		return nil
	}
	return x.remove(name)
}

// opaque removes from dir everything that earlier streams made, keeping
// what the current one made (and, in directories it made, only its own).
func (x *extractor) opaque(dir string) error {
	prefix := dir + "/"
	if dir == "." {
		prefix = ""
	}
	var children []string
	for p := range x.entries {
		if p != "." && strings.HasPrefix(p, prefix) && !strings.Contains(p[len(prefix):], "/") {
			children = append(children, p)
		}
	}
	slices.Sort(children)
	for _, p := range children {
		if !x.current[p] {
			if err := x.remove(p); err != nil {
				return err
			}
			continue
		}
		if x.entries[p].typ == tar.TypeDir {
			if err := x.opaque(p); err != nil {
				return err
			}
		}
	}
	return nil
}

// finishDirs applies the directories' metadata, now that their contents no
// longer change. Directories are opened, never followed: each path was
// checked to be a directory made by this extraction.
func (x *extractor) finishDirs() error {
	for _, name := range slices.Sorted(maps.Keys(x.entries)) {
		e := x.entries[name]
		if e.typ != tar.TypeDir || e.hdr == nil {
			continue
		}
		err := func() error {
			d, err := x.root.Open(name)
			if err != nil {
				return err
			}
			defer d.Close()
			return setMeta(d, e.hdr)
		}()
		if err != nil {
			return fmt.Errorf("directory %q: %w", name, err)
		}
	}
	return nil
}

// setMeta applies owner (when running as root), mode, mtime and xattrs
// from hdr to an open file or directory.
func setMeta(f *os.File, hdr *tar.Header) error {
	fd := int(f.Fd())
	if os.Geteuid() == 0 {
		if err := f.Chown(hdr.Uid, hdr.Gid); err != nil {
			return err
		}
	}
	for k, v := range hdr.PAXRecords {
		if attr, ok := strings.CutPrefix(k, "SCHILY.xattr."); ok {
			if err := unix.Fsetxattr(fd, attr, []byte(v), 0); err != nil {
				return fmt.Errorf("set xattr %s: %w", attr, err)
			}
		}
	}
	// After chown, which clears the set-id bits.
	mode := hdr.FileInfo().Mode() & (fs.ModePerm | fs.ModeSetuid | fs.ModeSetgid | fs.ModeSticky)
	if err := f.Chmod(mode); err != nil {
		return err
	}
	mtime := unix.NsecToTimeval(hdr.ModTime.UnixNano())
	atime := mtime
	if !hdr.AccessTime.IsZero() {
		atime = unix.NsecToTimeval(hdr.AccessTime.UnixNano())
	}
	if err := unix.Futimes(fd, []unix.Timeval{atime, mtime}); err != nil {
		return fmt.Errorf("set times: %w", err)
	}
	return nil
}

// cleanName returns a tar entry name relative to the root ("." for the root
// itself), or an error if it would escape the root. A leading "/" is
// dropped, as tar does.
func cleanName(name string) (string, error) {
	c := path.Clean(strings.TrimLeft(name, "/"))
	if c != "." && !filepath.IsLocal(c) {
		return "", fmt.Errorf("path %q escapes the root of the layer", name)
	}
	return c, nil
}

func typeWord(typ byte) string {
	switch typ {
	case tar.TypeSymlink:
		return "symlink"
	case tar.TypeReg:
		return "file"
	}
	return "directory"
}

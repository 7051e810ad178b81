package layer

import (
	"archive/tar"
	"bufio"
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
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// treeStats counts what goes into an image, for progress lines.
type treeStats struct {
	files int   // entries other than the root directory
	bytes int64 // sum of regular file sizes
}

func isTarball(p string) bool {
	for _, ext := range []string{".tar", ".tar.gz", ".tgz"} {
		if strings.HasSuffix(p, ext) {
			return true
		}
	}
	return false
}

// checkTree walks a source directory (without following symlinks) and
// refuses device nodes, fifos and sockets, which a layer must not carry.
func checkTree(ctx context.Context, dir string) (treeStats, error) {
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
		st.files++
		if t := d.Type(); t&(fs.ModeDevice|fs.ModeCharDevice|fs.ModeNamedPipe|fs.ModeSocket) != 0 {
			return fmt.Errorf("%s is a %s: device nodes, fifos and sockets are not allowed in a layer", p, typeName(t))
		}
		if d.Type().IsRegular() {
			fi, err := d.Info()
			if err != nil {
				return err
			}
			st.bytes += fi.Size()
		}
		return nil
	})
	return st, err
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

// extractTarball unpacks a tar or gzip-compressed tar file into dst, which
// must not exist. It never follows a symlink: every entry is created through
// an os.Root (no path can leave dst), and an entry whose parent is a symlink
// the archive created is refused. Symlinks are kept as they are, absolute or
// not. Hard links must point at an earlier file of the archive. Device nodes
// and fifos are refused. Mode, owner (when running as root), mtime and
// "SCHILY.xattr." records are kept for files and directories.
func extractTarball(ctx context.Context, src, dst string) (treeStats, error) {
	f, err := os.Open(src)
	if err != nil {
		return treeStats{}, err
	}
	defer f.Close()
	br := bufio.NewReaderSize(f, 1<<20)
	var r io.Reader = br
	if magic, _ := br.Peek(2); len(magic) == 2 && magic[0] == 0x1f && magic[1] == 0x8b {
		zr, err := gzip.NewReader(br)
		if err != nil {
			return treeStats{}, err
		}
		defer zr.Close()
		r = zr
	}
	if err := os.Mkdir(dst, 0o755); err != nil {
		return treeStats{}, err
	}
	root, err := os.OpenRoot(dst)
	if err != nil {
		return treeStats{}, err
	}
	defer root.Close()

	x := &extractor{root: root, entries: map[string]*entry{".": {typ: tar.TypeDir}}}
	tr := tar.NewReader(r)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return x.st, err
		}
		if err := ctx.Err(); err != nil {
			return x.st, err
		}
		if err := x.extract(hdr, tr); err != nil {
			return x.st, fmt.Errorf("entry %q: %w", hdr.Name, err)
		}
	}
	return x.st, x.finishDirs()
}

// extractor is the state of one extraction; not safe for concurrent use.
type extractor struct {
	root *os.Root
	// entries holds every path created so far (cleaned, relative to the
	// root, "." for the root) with its type, and the header of directories,
	// whose metadata is applied once all their children exist.
	entries map[string]*entry
	st      treeStats
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
	case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
		return fmt.Errorf("%s: device nodes and fifos are not allowed in a layer", typeName(hdr.FileInfo().Mode()))
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
	if name == "." {
		if typ != tar.TypeDir {
			return errors.New("the root of the archive must be a directory")
		}
		x.entries["."].hdr = hdr
		return nil
	}
	if err := x.prepare(name, typ); err != nil {
		return err
	}
	x.st.files++

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
	case tar.TypeReg:
		f, err := x.root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return err
		}
		defer f.Close()
		n, err := io.Copy(f, r)
		if err != nil {
			return err
		}
		x.st.bytes += n
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
		if e == nil || e.typ == tar.TypeDir {
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
		}
	}
	e := x.entries[name]
	if e == nil || (e.typ == tar.TypeDir && typ == tar.TypeDir) {
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

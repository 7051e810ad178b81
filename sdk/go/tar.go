package shoal

import (
	"archive/tar"
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
)

// WriteTar writes the tree under dir to w as a PAX tar stream, the way a
// layer build from a directory on the server would read it: the root
// directory first (as "./"), then every entry in lexical order, with its
// mode (set-id and sticky bits included), numeric owner, mtime and extended
// attributes (as SCHILY.xattr records: security.capability, user.*, ACLs).
// Symlinks are stored as symlinks, never followed; a file linked more than
// once is stored once and then as hard links to it; device nodes and fifos
// are stored as such (a build leaves the device nodes under /dev out, with
// a warning, and refuses the others, as it does for a directory it reads
// itself). Sockets cannot be stored in a tar: a socket
// is an error. Nothing is read into memory beyond one file's header.
func WriteTar(w io.Writer, dir string) error { return writeTar(w, dir, nil) }

// writeTar is WriteTar leaving out the entries (named as in the archive,
// without "./") skip says to, and what is below them.
func writeTar(w io.Writer, dir string, skip func(name string, isDir bool) bool) error {
	tw := tar.NewWriter(w)
	t := &tarWalker{tw: tw, links: map[[2]uint64]string{}, skip: skip}
	fi, err := os.Lstat(dir)
	if err != nil {
		return err
	}
	if !fi.IsDir() {
		return fmt.Errorf("%s is not a directory", dir)
	}
	if err := t.walk(dir, "."); err != nil {
		return err
	}
	return tw.Close()
}

type tarWalker struct {
	skip  func(name string, isDir bool) bool
	tw    *tar.Writer
	links map[[2]uint64]string // (dev, ino) of files with nlink > 1 -> first name
}

// walk writes the entry at path p, named name in the archive, and below it.
// Directories are walked with an explicit stack: trees may be deep.
func (t *tarWalker) walk(root, rootName string) error {
	type item struct{ path, name string }
	stack := []item{{root, rootName}}
	for len(stack) > 0 {
		it := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		if t.skip != nil && it.name != "." {
			fi, err := os.Lstat(it.path)
			if err != nil {
				return err
			}
			if t.skip(it.name, fi.IsDir()) {
				continue
			}
		}
		isDir, err := t.add(it.path, it.name)
		if err != nil {
			return err
		}
		if !isDir {
			continue
		}
		names, err := readDirNames(it.path)
		if err != nil {
			return err
		}
		// Pushed in reverse: popped in lexical order.
		for _, n := range slices.Backward(names) {
			child := n
			if it.name != "." {
				child = it.name + "/" + n
			}
			stack = append(stack, item{filepath.Join(it.path, n), child})
		}
	}
	return nil
}

func readDirNames(dir string) ([]string, error) {
	f, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	names, err := f.Readdirnames(-1)
	if err != nil {
		return nil, err
	}
	slices.Sort(names)
	return names, nil
}

// add writes one entry; it reports whether it is a directory.
func (t *tarWalker) add(p, name string) (bool, error) {
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		return false, &fs.PathError{Op: "lstat", Path: p, Err: err}
	}
	hdr := &tar.Header{
		Name:    name,
		Mode:    int64(st.Mode & 0o7777),
		Uid:     int(st.Uid),
		Gid:     int(st.Gid),
		ModTime: time.Unix(st.Mtim.Unix()),
		Format:  tar.FormatPAX,
	}
	var file *os.File
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		hdr.Typeflag = tar.TypeDir
		if name != "." {
			hdr.Name = name + "/"
		} else {
			hdr.Name = "./"
		}
	case unix.S_IFREG:
		if st.Nlink > 1 {
			key := [2]uint64{st.Dev, st.Ino}
			if first, ok := t.links[key]; ok {
				hdr.Typeflag, hdr.Linkname = tar.TypeLink, first
				break
			}
			t.links[key] = name
		}
		f, err := os.Open(p)
		if err != nil {
			return false, err
		}
		defer f.Close()
		// What was opened is what was stat'ed: a file swapped meanwhile
		// would give a header that does not match its content.
		var fst unix.Stat_t
		if err := unix.Fstat(int(f.Fd()), &fst); err != nil {
			return false, err
		}
		if fst.Ino != st.Ino || fst.Dev != st.Dev {
			return false, fmt.Errorf("%s changed while it was being read", p)
		}
		hdr.Typeflag, hdr.Size, file = tar.TypeReg, fst.Size, f
	case unix.S_IFLNK:
		target, err := os.Readlink(p)
		if err != nil {
			return false, err
		}
		hdr.Typeflag, hdr.Linkname = tar.TypeSymlink, target
	case unix.S_IFCHR, unix.S_IFBLK:
		hdr.Typeflag = tar.TypeChar
		if st.Mode&unix.S_IFMT == unix.S_IFBLK {
			hdr.Typeflag = tar.TypeBlock
		}
		hdr.Devmajor, hdr.Devminor = int64(unix.Major(st.Rdev)), int64(unix.Minor(st.Rdev))
	case unix.S_IFIFO:
		hdr.Typeflag = tar.TypeFifo
	default:
		return false, fmt.Errorf("%s is a socket: a tar cannot hold it", p)
	}
	if hdr.Typeflag != tar.TypeSymlink && hdr.Typeflag != tar.TypeLink {
		if err := addXattrs(hdr, p); err != nil {
			return false, err
		}
	}
	if err := t.tw.WriteHeader(hdr); err != nil {
		return false, fmt.Errorf("%s: %w", p, err)
	}
	if file != nil {
		n, err := io.Copy(t.tw, io.LimitReader(file, hdr.Size))
		if err != nil {
			return false, fmt.Errorf("%s: %w", p, err)
		}
		if n != hdr.Size {
			return false, fmt.Errorf("%s shrank while it was being read", p)
		}
	}
	return hdr.Typeflag == tar.TypeDir, nil
}

// addXattrs records p's extended attributes in hdr's PAX records.
func addXattrs(hdr *tar.Header, p string) error {
	size, err := unix.Llistxattr(p, nil)
	if errors.Is(err, unix.ENOTSUP) || size == 0 {
		return nil
	}
	if err != nil {
		return fmt.Errorf("list xattrs of %s: %w", p, err)
	}
	buf := make([]byte, size)
	if size, err = unix.Llistxattr(p, buf); err != nil {
		return fmt.Errorf("list xattrs of %s: %w", p, err)
	}
	for _, attr := range strings.Split(strings.TrimRight(string(buf[:size]), "\x00"), "\x00") {
		if attr == "" {
			continue
		}
		n, err := unix.Lgetxattr(p, attr, nil)
		if errors.Is(err, unix.ENODATA) {
			continue // removed meanwhile
		}
		if err != nil {
			return fmt.Errorf("xattr %s of %s: %w", attr, p, err)
		}
		val := make([]byte, n)
		if n, err = unix.Lgetxattr(p, attr, val); err != nil {
			return fmt.Errorf("xattr %s of %s: %w", attr, p, err)
		}
		if hdr.PAXRecords == nil {
			hdr.PAXRecords = map[string]string{}
		}
		hdr.PAXRecords["SCHILY.xattr."+attr] = string(val[:n])
	}
	return nil
}

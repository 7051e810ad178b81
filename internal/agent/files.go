package agent

import (
	"errors"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// File operations of the agent.
//
// Containment: the agent runs inside the sandbox's own root (its mount
// namespace and root, or the VM's root file system), so every path,
// including the targets of symlinks, resolves inside the sandbox; there is
// nothing outside it for a path to escape to. Paths must still be absolute
// and free of ".." elements and NUL bytes, so that what a caller sees in a
// request is what the agent touches.

const errBadPath = "path must be absolute and must not contain '..'"

// cleanPath validates p and returns it cleaned (no "." elements, no
// repeated or trailing slashes).
func cleanPath(p string) (string, bool) {
	if p == "" || p[0] != '/' || strings.IndexByte(p, 0) >= 0 {
		return "", false
	}
	for rest := p; rest != ""; {
		var el string
		el, rest, _ = strings.Cut(rest, "/")
		if el == ".." {
			return "", false
		}
	}
	return filepath.Clean(p), true
}

var emptyReply = []byte("{}")

// permBits keeps the bits of mode that chmod applies.
func permBits(mode uint32, def fs.FileMode) fs.FileMode {
	m := fs.FileMode(mode) & (fs.ModePerm | fs.ModeSetuid | fs.ModeSetgid | fs.ModeSticky)
	if m == 0 {
		return def
	}
	return m
}

func toWire(fi fs.FileInfo, path string, names *idNames) wireFileInfo {
	w := wireFileInfo{
		Name:    fi.Name(),
		Size:    fi.Size(),
		Mode:    uint32(fi.Mode()),
		MTimeNs: fi.ModTime().UnixNano(),
	}
	if fi.Mode()&fs.ModeSymlink != 0 {
		w.Link, _ = os.Readlink(path)
		// What it resolves to, and what that is (E2B's entries give a
		// symlink its target's type). The agent is inside the sandbox's
		// root: nothing resolves outside it.
		w.Target = path // as E2B's envd has it when the link cannot be resolved
		if t, err := filepath.EvalSymlinks(path); err == nil {
			w.Target = t
		}
		if tfi, err := os.Stat(path); err == nil {
			m := uint32(tfi.Mode())
			w.TargetMode = &m
		}
	}
	if names != nil && names.xattrs {
		w.Xattrs = readXattrs(path)
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		uid, gid := st.Uid, st.Gid
		w.UID, w.GID = &uid, &gid
		names.fill(&w)
	}
	return w
}

func stat(c net.Conn, path string, xattrs bool) {
	fi, err := os.Lstat(path)
	if err != nil {
		sendOSError(c, err, path)
		return
	}
	writeJSONFrame(c, FrameReply, toWire(fi, path, &idNames{xattrs: xattrs}))
}

// readFile streams a regular file: R(fileinfo), D*, F; an error while
// reading ends the stream with X instead of F.
func readFile(c net.Conn, path string) {
	// O_NONBLOCK: opening a FIFO must not hang; non-regular files are
	// refused below, and the flag does nothing to a regular file.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		sendOSError(c, err, path)
		return
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		sendOSError(c, err, path)
		return
	}
	if fi.IsDir() {
		sendError(c, CodeIsDir, "is a directory")
		return
	}
	if !fi.Mode().IsRegular() {
		sendError(c, CodeInvalid, "not a regular file")
		return
	}
	if writeJSONFrame(c, FrameReply, toWire(fi, path, &idNames{})) != nil {
		return
	}
	bp := bufPool.Get().(*[]byte)
	defer bufPool.Put(bp)
	buf := *bp
	for {
		n, err := f.Read(buf[headerSize:])
		if n > 0 {
			if writeDataFrame(c, FrameData, buf, n) != nil {
				return
			}
		}
		if err == io.EOF {
			writeFrame(c, FrameEOF, nil)
			return
		}
		if err != nil {
			sendOSError(c, err, path)
			return
		}
	}
}

// writeFile receives a file atomically: it writes a temp file in the same
// directory, fsyncs it, renames it over path and fsyncs the directory. If
// the stream ends any other way than with F, the temp file is removed and
// path is untouched. The mode is applied exactly (no umask).
//
// With an owner, the file and every directory created for it are given to
// that user (its uid and primary gid) before anything is written in them.
func writeFile(c net.Conn, path string, mode uint32, xattrs map[string]string, owner *userInfo) {
	if werr := checkXattrs(xattrs); werr != nil {
		writeJSONFrame(c, FrameError, werr)
		return
	}
	if fi, err := os.Lstat(path); err == nil && fi.IsDir() {
		sendError(c, CodeIsDir, "is a directory")
		return
	}
	dir, base := filepath.Split(path)
	if err := mkdirAll(dir, 0o755, owner); err != nil {
		sendOSError(c, err, path)
		return
	}
	prefix := "." + base
	if len(prefix) > 200 { // leave room under NAME_MAX for the suffix
		prefix = prefix[:200]
	}
	tmp, err := os.CreateTemp(dir, prefix+".shoal-tmp-*")
	if err != nil {
		sendOSError(c, err, path)
		return
	}
	committed := false
	defer func() {
		if !committed {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	if owner != nil {
		// Before the chmod: a chown clears setuid and setgid bits.
		if err := tmp.Chown(int(owner.UID), int(owner.GID)); err != nil {
			sendOSError(c, err, path)
			return
		}
	}
	if err := tmp.Chmod(permBits(mode, 0o644)); err != nil {
		sendOSError(c, err, path)
		return
	}
	if err := setXattrs(tmp, xattrs); err != nil {
		sendOSError(c, err, path)
		return
	}
	if writeFrame(c, FrameReply, emptyReply) != nil {
		return
	}
	bp := bufPool.Get().(*[]byte)
	defer bufPool.Put(bp)
	buf := *bp
	var hdr [headerSize]byte
	var size int64
	for {
		typ, n, err := readHeader(c, &hdr)
		if err != nil {
			return // the stream broke: discard
		}
		if typ == FrameEOF {
			break
		}
		if typ != FrameData || n > MaxDataChunk {
			sendError(c, CodeProtocol, "expected a data frame of at most 64 KiB")
			return
		}
		if _, err := io.ReadFull(c, buf[:n]); err != nil {
			return
		}
		if _, err := tmp.Write(buf[:n]); err != nil {
			sendOSError(c, err, path)
			return
		}
		size += int64(n)
	}
	if err := tmp.Sync(); err != nil {
		sendOSError(c, err, path)
		return
	}
	if err := tmp.Close(); err != nil {
		sendOSError(c, err, path)
		return
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		sendOSError(c, err, path)
		return
	}
	committed = true
	if d, err := os.Open(dir); err == nil {
		d.Sync() // make the rename durable
		d.Close()
	}
	writeJSONFrame(c, FrameReply, wireWriteReply{Size: size})
}

// listDir streams entries in batches (D frames holding JSON arrays), then F,
// so that a huge directory never becomes one huge message.
func listDir(c net.Conn, path string, xattrs bool) {
	f, err := os.Open(path)
	if err != nil {
		sendOSError(c, err, path)
		return
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil {
		sendOSError(c, err, path)
		return
	} else if !fi.IsDir() {
		sendError(c, CodeNotDir, "not a directory")
		return
	}
	names := &idNames{xattrs: xattrs}
	for {
		ents, rerr := f.ReadDir(256)
		batch := make([]wireFileInfo, 0, len(ents))
		for _, e := range ents {
			fi, err := e.Info() // lstat
			if err != nil {
				continue // removed meanwhile
			}
			batch = append(batch, toWire(fi, filepath.Join(path, e.Name()), names))
		}
		if len(batch) > 0 {
			if writeJSONFrame(c, FrameData, batch) != nil {
				return
			}
		}
		if rerr == io.EOF || (rerr == nil && len(ents) == 0) {
			writeFrame(c, FrameEOF, nil)
			return
		}
		if rerr != nil {
			sendOSError(c, rerr, path)
			return
		}
	}
}

// makeDir is mkdir -p (with the umask applied, like mkdir -p); with an
// owner, each directory it creates is given to that user.
func makeDir(c net.Conn, path string, mode uint32, owner *userInfo) {
	if err := mkdirAll(path, permBits(mode, 0o755), owner); err != nil {
		if fi, serr := os.Stat(path); serr == nil && !fi.IsDir() {
			sendError(c, CodeExist, "exists and is not a directory")
			return
		}
		sendOSError(c, err, path)
		return
	}
	writeFrame(c, FrameReply, emptyReply)
}

// remove removes a file, a symlink (not its target) or an empty directory;
// with recursive, a whole tree. A missing path is an error either way.
func remove(c net.Conn, path string, recursive bool) {
	if path == "/" {
		sendError(c, CodeInvalid, "refusing to remove /")
		return
	}
	if _, err := os.Lstat(path); err != nil {
		sendOSError(c, err, path)
		return
	}
	var err error
	if recursive {
		err = os.RemoveAll(path)
	} else {
		err = os.Remove(path)
	}
	if err != nil {
		sendOSError(c, err, path)
		return
	}
	writeFrame(c, FrameReply, emptyReply)
}

// mkdirAll is os.MkdirAll that gives each directory it creates to owner
// (its uid and primary gid; nil: they stay the caller's) before anything
// is made in it. A directory that another process made meanwhile is left
// as it is. The chown does not follow a symlink put in the new
// directory's place.
func mkdirAll(path string, perm fs.FileMode, owner *userInfo) error {
	if owner == nil {
		return os.MkdirAll(path, perm)
	}
	var missing []string
	for p := filepath.Clean(path); ; p = filepath.Dir(p) {
		fi, err := os.Stat(p)
		if err == nil {
			if !fi.IsDir() {
				return &os.PathError{Op: "mkdir", Path: p, Err: syscall.ENOTDIR}
			}
			break
		}
		if !errors.Is(err, fs.ErrNotExist) || p == "/" {
			return err
		}
		missing = append(missing, p)
	}
	for i := len(missing) - 1; i >= 0; i-- {
		p := missing[i]
		if err := os.Mkdir(p, perm); err != nil {
			if errors.Is(err, fs.ErrExist) {
				if fi, serr := os.Stat(p); serr == nil && fi.IsDir() {
					continue
				}
			}
			return err
		}
		if err := os.Lchown(p, int(owner.UID), int(owner.GID)); err != nil {
			return err
		}
	}
	return nil
}

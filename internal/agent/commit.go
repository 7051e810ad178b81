package agent

// Export of the sandbox's writable layer (OpExportUpper), for a commit of
// a sandbox whose upper directory is not on the host's file system (a
// VM's, inside the guest). The agent opens the overlay's upper directory
// at boot, before any workload runs (Config.Upper), and keeps that
// descriptor: what the workload mounts or links later cannot redirect it.
// On request it stops the guest's workload (a microVM's commands frozen
// in their cgroup, cgroup.go; a full system's processes with SIGSTOP),
// writes the upper as a commit stream (a tar archive: the format
// internal/layer reads, see its commit_stream.go) in data frames, and lets
// them go on:
//
//	exportupper: Q({"max_depth"}) → R | X;  then D* (the tar) F | X
//
// The host reads the stream as untrusted input: this side only makes it
// right for an honest guest.

import (
	"archive/tar"
	"bufio"
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// wireExportRequest asks for the writable layer.
type wireExportRequest struct {
	// MaxDepth: entries deeper than this many levels are sent but not
	// descended into (the host refuses them; the guest must not walk a
	// tree of unbounded depth). 0: DefaultExportMaxDepth.
	MaxDepth int `json:"max_depth,omitempty"`
}

// DefaultExportMaxDepth is the depth walked when a request names none
// (the host's own bound of a commit).
const DefaultExportMaxDepth = 256

// exportStall bounds how long one data frame of an export may wait for
// the host to read it: a host gone mid-export must not keep the guest's
// processes stopped.
var exportStall = time.Minute

func (s *Server) exportUpper(c net.Conn, req *wireExportRequest) {
	if s.cfg.Upper == nil {
		sendError(c, CodeUnsupported, "this sandbox's writable layer is not the agent's to export (a container's is on the host)")
		return
	}
	depth := req.MaxDepth
	if depth <= 0 || depth > 4096 {
		depth = DefaultExportMaxDepth
	}
	s.exportMu.Lock() // one export at a time: a second would thaw the first's processes
	defer s.exportMu.Unlock()
	cont, err := s.stopWorkload()
	if err != nil {
		sendError(c, CodeIO, "stop the sandbox's processes: "+err.Error())
		return
	}
	defer cont()
	if writeFrame(c, FrameReply, emptyReply) != nil {
		return
	}
	fw := bufio.NewWriterSize(&frameWriter{c: c}, MaxDataChunk)
	if err := WriteUpper(fw, s.cfg.Upper, depth); err != nil {
		if errors.Is(err, errFrameWrite) {
			return // the host is gone or stopped reading
		}
		fw.Flush()
		sendError(c, CodeIO, err.Error())
		return
	}
	if fw.Flush() != nil {
		return
	}
	c.SetWriteDeadline(time.Now().Add(exportStall))
	writeFrame(c, FrameEOF, nil)
}

var errFrameWrite = errors.New("write to the host")

// frameWriter sends what is written to it as data frames of at most
// MaxDataChunk bytes, each within exportStall.
type frameWriter struct {
	c   net.Conn
	buf []byte
}

func (w *frameWriter) Write(p []byte) (int, error) {
	if w.buf == nil {
		w.buf = make([]byte, headerSize+MaxDataChunk)
	}
	n := 0
	for len(p) > 0 {
		k := copy(w.buf[headerSize:], p)
		w.c.SetWriteDeadline(time.Now().Add(exportStall))
		if err := writeDataFrame(w.c, FrameData, w.buf, k); err != nil {
			return n, fmt.Errorf("%w: %w", errFrameWrite, err)
		}
		n += k
		p = p[k:]
	}
	return n, nil
}

// stopOthers stops every process of the guest but the agent (SIGSTOP to
// all: as PID 1, kill(-1) reaches every process but itself, also those
// forked meanwhile), waits (bounded) until they are stopped, and returns
// the function that continues them, except those that were stopped before.
// Only PID 1 of a VM, or the service of a full system's VM (system: as
// root, kill(-1) reaches every process but init and itself; init is not
// waited for), does this; elsewhere (tests) nothing is stopped.
func stopOthers(system bool) (cont func(), err error) {
	if os.Getpid() != 1 && !system {
		return func() {}, nil
	}
	others := func() []procInfo {
		ps := listProcs()
		if system {
			ps = slices.DeleteFunc(ps, func(p procInfo) bool { return p.pid == 1 })
		}
		return ps
	}
	before := stoppedProcs()
	if err := unix.Kill(-1, unix.SIGSTOP); err != nil && !errors.Is(err, unix.ESRCH) {
		return nil, err
	}
	cont = func() {
		continueYoungestFirst(slices.DeleteFunc(others(), func(p procInfo) bool { return before[p.key()] || p.kthread }))
	}
	// A process in the middle of a system call stops when it returns
	// from it: wait for that, but not for ever (a task stuck in the
	// kernel, a new one that a request started meanwhile).
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		running := false
		for _, p := range others() {
			if !p.kthread && !strings.ContainsRune("TtZXx", rune(p.state)) {
				running = true
				break
			}
		}
		if !running {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	return cont, nil
}

type procInfo struct {
	pid     int
	state   byte
	start   string // start time (clock ticks since boot): with pid, who it is
	started uint64 // start, parsed
	kthread bool
}

func (p procInfo) key() string { return strconv.Itoa(p.pid) + "/" + p.start }

// continueYoungestFirst sends SIGCONT to ps, the youngest first: a child
// goes on before its parent, so that a parent waiting for it (WUNTRACED)
// finds it running again.
func continueYoungestFirst(ps []procInfo) {
	slices.SortFunc(ps, func(a, b procInfo) int { return cmp.Or(cmp.Compare(b.started, a.started), cmp.Compare(b.pid, a.pid)) })
	for _, p := range ps {
		unix.Kill(p.pid, unix.SIGCONT)
	}
}

// listProcs lists the guest's processes other than the agent.
func listProcs() []procInfo {
	d, err := os.Open("/proc")
	if err != nil {
		return nil
	}
	defer d.Close()
	names, _ := d.Readdirnames(-1)
	var out []procInfo
	self := os.Getpid()
	for _, n := range names {
		pid, err := strconv.Atoi(n)
		if err != nil || pid == self {
			continue
		}
		if p, ok := readProc(pid); ok {
			out = append(out, p)
		}
	}
	return out
}

// readProc reads process pid's /proc/PID/stat.
func readProc(pid int) (procInfo, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return procInfo{}, false
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || len(b) < i+3 {
		return procInfo{}, false
	}
	f := strings.Fields(string(b[i+2:]))
	// Fields after the name: state(0) ppid(1) ... flags(6) ... starttime(19).
	if len(f) < 20 {
		return procInfo{}, false
	}
	flags, _ := strconv.ParseUint(f[6], 10, 64)
	started, _ := strconv.ParseUint(f[19], 10, 64)
	return procInfo{pid: pid, state: f[0][0], start: f[19], started: started, kthread: flags&0x00200000 != 0}, true // PF_KTHREAD
}

// stoppedProcs are the processes stopped before the export.
func stoppedProcs() map[string]bool {
	m := map[string]bool{}
	for _, p := range listProcs() {
		if p.state == 'T' || p.state == 't' {
			m[p.key()] = true
		}
	}
	return m
}

// WriteUpper writes the overlay upper directory open as root to w as a
// commit stream: a pax tar archive whose first entry is the root (".")
// and whose every other entry follows its parent directory, named by its
// path below the root; regular files, directories, symlinks, hard links
// (a file with several links is sent once, then as links to that first
// path), character devices (overlay whiteouts are 0:0), fifos and block
// devices as they are (the host refuses what a layer cannot hold);
// sockets are left out. Extended attributes travel as "SCHILY.xattr."
// records, overlayfs's own (trusted.overlay.opaque) included. Entries are
// opened below their directory's descriptor, never through a symlink.
// Directories deeper than maxDepth levels are sent but not walked.
func WriteUpper(w io.Writer, root *os.File, maxDepth int) error {
	u := &upperTar{tw: tar.NewWriter(w), links: map[[2]uint64]string{}, maxDepth: maxDepth}
	var st unix.Stat_t
	if err := unix.Fstat(int(root.Fd()), &st); err != nil {
		return err
	}
	hdr := u.header(".", &st, tar.TypeDir)
	if err := u.xattrs(hdr, int(root.Fd()), false); err != nil {
		return err
	}
	if err := u.tw.WriteHeader(hdr); err != nil {
		return err
	}
	d, err := unix.Openat(int(root.Fd()), ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	if err := u.dir(os.NewFile(uintptr(d), "/"), "", 0); err != nil {
		return err
	}
	return u.tw.Close()
}

type upperTar struct {
	tw       *tar.Writer
	links    map[[2]uint64]string // (dev, ino) of files with several links → first path
	maxDepth int
}

func fdPath(fd int) string { return "/proc/self/fd/" + strconv.Itoa(fd) }

func (u *upperTar) header(name string, st *unix.Stat_t, typ byte) *tar.Header {
	return &tar.Header{
		Typeflag: typ, Name: name, Mode: int64(st.Mode & 0o7777),
		Uid: int(st.Uid), Gid: int(st.Gid), ModTime: time.Unix(st.Mtim.Sec, 0),
		Format: tar.FormatPAX,
	}
}

// xattrs reads the extended attributes of the file open as fd into hdr's
// pax records; an O_PATH descriptor (a symlink, a device) is read through
// its /proc/self/fd magic link (the very inode, a symlink included).
func (u *upperTar) xattrs(hdr *tar.Header, fd int, opath bool) error {
	p := fdPath(fd)
	list := func(buf []byte) (int, error) {
		if opath {
			return unix.Listxattr(p, buf)
		}
		return unix.Flistxattr(fd, buf)
	}
	get := func(name string, buf []byte) (int, error) {
		if opath {
			return unix.Getxattr(p, name, buf)
		}
		return unix.Fgetxattr(fd, name, buf)
	}
	buf := make([]byte, 4096)
	var n int
	var err error
	for {
		n, err = list(buf)
		if errors.Is(err, unix.ERANGE) && len(buf) < 1<<20 {
			buf = make([]byte, len(buf)*4)
			continue
		}
		break
	}
	if errors.Is(err, unix.ENOTSUP) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("%s: list xattrs: %w", hdr.Name, err)
	}
	val := make([]byte, 64<<10) // XATTR_SIZE_MAX
	for _, name := range strings.Split(string(buf[:n]), "\x00") {
		if name == "" {
			continue
		}
		m, err := get(name, val)
		if errors.Is(err, unix.ENODATA) {
			continue
		}
		if err != nil {
			return fmt.Errorf("%s: read xattr %s: %w", hdr.Name, name, err)
		}
		if hdr.PAXRecords == nil {
			hdr.PAXRecords = map[string]string{}
		}
		hdr.PAXRecords["SCHILY.xattr."+name] = string(val[:m])
	}
	return nil
}

// dir writes the entries of the directory d (rel below the root, depth
// levels down) and closes it: one descriptor per level.
func (u *upperTar) dir(d *os.File, rel string, depth int) error {
	defer d.Close()
	nfd := int(d.Fd())
	for {
		names, err := d.Readdirnames(256)
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("/%s: read directory: %w", rel, err)
		}
		for _, name := range names {
			crel := name
			if rel != "" {
				crel = rel + "/" + name
			}
			if err := u.entry(nfd, name, crel, depth+1); err != nil {
				return err
			}
		}
	}
}

// entry writes the entry name of the directory dfd.
func (u *upperTar) entry(dfd int, name, rel string, depth int) error {
	fd, err := unix.Openat(dfd, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		return nil // removed meanwhile (by a request served during the export)
	}
	if err != nil {
		return fmt.Errorf("/%s: %w", rel, err)
	}
	defer func() {
		if fd >= 0 {
			unix.Close(fd)
		}
	}()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("/%s: %w", rel, err)
	}
	var hdr *tar.Header
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		hdr = u.header(rel, &st, tar.TypeDir)
	case unix.S_IFREG:
		if st.Nlink > 1 {
			key := [2]uint64{st.Dev, st.Ino}
			if first, ok := u.links[key]; ok {
				hdr = u.header(rel, &st, tar.TypeLink)
				hdr.Linkname = first
				return u.tw.WriteHeader(hdr)
			}
			u.links[key] = rel
		}
		hdr = u.header(rel, &st, tar.TypeReg)
		hdr.Size = st.Size
	case unix.S_IFLNK:
		hdr = u.header(rel, &st, tar.TypeSymlink)
		buf := make([]byte, unix.PathMax)
		n, err := unix.Readlinkat(fd, "", buf)
		if err != nil {
			return fmt.Errorf("/%s: read symlink: %w", rel, err)
		}
		hdr.Linkname = string(buf[:n])
	case unix.S_IFCHR, unix.S_IFBLK:
		hdr = u.header(rel, &st, tar.TypeChar)
		if st.Mode&unix.S_IFMT == unix.S_IFBLK {
			hdr.Typeflag = tar.TypeBlock
		}
		hdr.Devmajor, hdr.Devminor = int64(unix.Major(st.Rdev)), int64(unix.Minor(st.Rdev))
	case unix.S_IFIFO:
		hdr = u.header(rel, &st, tar.TypeFifo)
	default:
		return nil // sockets: a layer cannot hold them
	}
	switch hdr.Typeflag {
	case tar.TypeReg:
		// Opened again for reading (never a device or a fifo: checked to
		// be the inode fstat saw), exactly the size announced is sent.
		in, err := unix.Openat(dfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("/%s: open: %w", rel, err)
		}
		f := os.NewFile(uintptr(in), rel)
		defer f.Close()
		var ist unix.Stat_t
		if err := unix.Fstat(in, &ist); err != nil || ist.Dev != st.Dev || ist.Ino != st.Ino {
			return fmt.Errorf("/%s: changed while being exported", rel)
		}
		if err := u.xattrs(hdr, in, false); err != nil {
			return err
		}
		if err := u.tw.WriteHeader(hdr); err != nil {
			return err
		}
		if n, err := io.Copy(u.tw, io.LimitReader(f, st.Size)); err != nil || n != st.Size {
			if errors.Is(err, errFrameWrite) {
				return err
			}
			return fmt.Errorf("/%s: changed while being exported (%d of %d bytes): %v", rel, n, st.Size, err)
		}
		return nil
	case tar.TypeDir:
		d, err := unix.Openat(fd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("/%s: %w", rel, err)
		}
		unix.Close(fd)
		fd = -1
		df := os.NewFile(uintptr(d), rel)
		if err := u.xattrs(hdr, d, false); err != nil {
			df.Close()
			return err
		}
		if err := u.tw.WriteHeader(hdr); err != nil {
			df.Close()
			return err
		}
		if depth > u.maxDepth {
			df.Close()
			return nil // the host refuses it; do not walk further
		}
		return u.dir(df, rel, depth)
	}
	if err := u.xattrs(hdr, fd, true); err != nil {
		return err
	}
	return u.tw.WriteHeader(hdr)
}

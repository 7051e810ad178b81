package agent

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Watch (OpWatch) streams file system changes under a path, from inotify:
//
//	Q({"path","recursive"}) → R({}) | X;  then D(JSON array of events)* …
//
// The reply is sent once every watch is in place, so a change made after it
// is reported. The stream runs until the client closes the connection; it
// ends with F when the watched path itself is removed or moved away.
//
// Sync: the client may send A(8-byte big-endian n): the agent then reads
// every event already in the kernel's queue (every change made before the
// A arrived; inotify queues an event within the system call that causes
// it), reports them, along with what it held back (a move whose pair has
// not come, which is then a move out; a coalesced write), and answers
// R({"sync":n}) after them. A poll that syncs first sees every change made
// before it (the polling watcher of E2B's face). Any other frame from the
// client, or its EOF, ends the watch.
//
// Memory is bounded: the agent keeps no queue of its own. It reads one
// buffer of events from the kernel, sends them, and reads again; when the
// client reads slowly, its writes block and events wait in the sandbox
// kernel's inotify queue (fs.inotify.max_queued_events). When that queue
// overflows the kernel drops events and the client gets one "overflow"
// event naming the watched path, so it knows to re-scan.
//
// Event semantics (see WatchDirEvent in the API):
//   - create: created, or moved in from outside the tree. When a recursive
//     watch picks up a new directory, the entries already in it are
//     reported as created too (closing the race between mkdir and the new
//     inotify watch); one may be reported twice.
//   - write: IN_MODIFY and IN_CLOSE_WRITE, coalesced per file: at most one
//     event per writeWindow while a file keeps changing, and a change not
//     yet reported is reported at the end of the window or when the writer
//     closes the file.
//   - remove: removed, or moved out of the tree.
//   - rename: moved within the tree (IN_MOVED_FROM and IN_MOVED_TO paired by
//     cookie), with the old path.
//   - chmod: IN_ATTRIB (mode, owner, times, link count).
//   - overflow: events were lost; path says where to re-scan.

// maxWatchDirs bounds the directories one recursive watch follows (each
// costs a kernel watch and an entry in the agent's maps). A variable only so
// that a test can check the bound without making 16k directories.
var maxWatchDirs = 16384

const (
	// writeWindow is the coalescing window of write events per file.
	writeWindow = 50 * time.Millisecond
	// renameWait is how long an IN_MOVED_FROM waits for its IN_MOVED_TO
	// before it is reported as a removal (moved out of the tree).
	renameWait = 20 * time.Millisecond
	// maxWriteStates bounds the files whose write coalescing state is kept;
	// past it the state is dropped (at worst one extra write event).
	maxWriteStates = 1024
	// maxSyncReads bounds the reads of the inotify queue one sync makes
	// (a workload that changes files without pause would otherwise keep
	// it from answering); the queue itself holds at most
	// fs.inotify.max_queued_events.
	maxSyncReads = 256
	// watchBatch is the most events sent in one frame.
	watchBatch = 256

	watchMask = unix.IN_CREATE | unix.IN_MODIFY | unix.IN_CLOSE_WRITE | unix.IN_DELETE |
		unix.IN_MOVED_FROM | unix.IN_MOVED_TO | unix.IN_ATTRIB | unix.IN_DELETE_SELF |
		unix.IN_MOVE_SELF | unix.IN_EXCL_UNLINK
)

// Event ops on the wire.
const (
	WatchCreate   = "create"
	WatchWrite    = "write"
	WatchRemove   = "remove"
	WatchRename   = "rename"
	WatchChmod    = "chmod"
	WatchOverflow = "overflow"
)

// CodeTooMany: a recursive list or watch would exceed the agent's bound.
const CodeTooMany ErrorCode = "too_many"

type wireWatchRequest struct {
	Path      string `json:"path"`
	Recursive bool   `json:"recursive,omitempty"`
	User      string `json:"user,omitempty"` // arm it as this user (users.go)
}

// wireWatchSync answers a client's sync (A frame).
type wireWatchSync struct {
	Sync uint64 `json:"sync"`
}

type wireWatchEvent struct {
	Op   string `json:"op"`
	Path string `json:"path"`
	Old  string `json:"old,omitempty"`
	Dir  bool   `json:"dir,omitempty"`
}

// skipDescend are the pseudo file systems a recursive walk (watch or list)
// does not enter unless they are where it starts.
func skipDescend(path string) bool {
	return path == "/proc" || path == "/sys" || path == "/dev"
}

func joinPath(dir, name string) string {
	if name == "" {
		return dir
	}
	if dir == "/" {
		return "/" + name
	}
	return dir + "/" + name
}

type writeState struct {
	emitted time.Time // when the last write event of this file was sent
	dirty   bool      // changed since then
}

type movedFrom struct {
	cookie uint32
	path   string
	dir    bool
	at     time.Time
}

type watcher struct {
	c         net.Conn
	f         *os.File // the inotify instance
	fd        int
	root      string
	rootWd    int32
	rootIsDir bool
	recursive bool
	dirs      map[int32]string // wd → path of the watched directory
	writes    map[string]*writeState
	from      *movedFrom // an IN_MOVED_FROM waiting for its IN_MOVED_TO
	out       []wireWatchEvent
	ended     bool  // the watched path is gone
	werr      error // sticky error writing to the client
}

// watch arms a watch (as req.User: the path is resolved and every initial
// inotify watch added with the user's file-system identity, so the kernel
// checks the user's permissions), answers, then streams events until the
// client goes or the path does. Directories created later are watched by
// the agent's own identity: a user cannot go where root created a directory
// it may not read, but its watch reports names there (a request's user is
// the caller's choice, not a boundary between callers).
func (s *Server) watch(c net.Conn, req *wireWatchRequest) {
	var w *watcher
	asUser(c, req.User, func() { w = armWatch(c, req) })
	if w == nil {
		return
	}
	defer w.f.Close()
	if writeFrame(c, FrameReply, emptyReply) != nil {
		return
	}
	w.run()
}

// armWatch sets up the inotify instance and the initial watches, or sends
// the error and returns nil.
func armWatch(c net.Conn, req *wireWatchRequest) *watcher {
	root, ok := cleanPath(req.Path)
	if !ok {
		sendError(c, CodeInvalid, errBadPath)
		return nil
	}
	fi, err := os.Stat(root)
	if err != nil {
		sendOSError(c, err, root)
		return nil
	}
	if req.Recursive && !fi.IsDir() {
		sendError(c, CodeNotDir, "not a directory (a recursive watch needs one)")
		return nil
	}
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		if err == unix.EMFILE {
			sendError(c, CodeTooMany, "too many inotify instances: the limit is fs.inotify.max_user_instances of the sandbox's user")
			return nil
		}
		sendOSError(c, os.NewSyscallError("inotify_init1", err), root)
		return nil
	}
	// Non-blocking, so os.File puts it in the runtime's poller: a waiting
	// watch holds no OS thread, and read deadlines work.
	f := os.NewFile(uintptr(fd), "inotify")
	armed := false
	defer func() {
		if !armed {
			f.Close()
		}
	}()
	if err := f.SetReadDeadline(time.Time{}); err != nil {
		sendError(c, CodeIO, "inotify is not pollable: "+err.Error())
		return nil
	}
	w := &watcher{
		c: c, f: f, fd: fd, root: root, rootIsDir: fi.IsDir(), recursive: req.Recursive,
		dirs:   make(map[int32]string),
		writes: make(map[string]*writeState),
	}
	mask := uint32(watchMask)
	if fi.IsDir() {
		mask |= unix.IN_ONLYDIR
	}
	wd, err := unix.InotifyAddWatch(fd, root, mask)
	if err != nil {
		sendWatchError(c, err, root)
		return nil
	}
	w.rootWd = int32(wd)
	w.dirs[w.rootWd] = root
	if req.Recursive {
		if err := w.addTree(root, false, true); err != nil {
			if errors.Is(err, errTooManyDirs) {
				sendError(c, CodeTooMany, fmt.Sprintf("more than %d directories to watch: watch a narrower directory", maxWatchDirs))
				return nil
			}
			sendWatchError(c, err, root)
			return nil
		}
	}
	armed = true
	return w
}

// run streams the events of an armed watch.
func (w *watcher) run() {
	c, f := w.c, w.f
	// The client closing the connection ends the watch: a read deadline in
	// the past wakes the loop below. mu orders it with the loop's own
	// deadline changes, so a wake-up is never overwritten.
	var mu sync.Mutex
	gone := false
	var syncN uint64 // the latest sync asked for (mu); answering it answers the earlier ones
	syncing := false
	go func() {
		// The client sends sync frames (A, 8 bytes); any other frame, EOF
		// or error ends the watch.
		var hdr [headerSize]byte
		var b [8]byte
		for {
			typ, n, err := readHeader(c, &hdr)
			if err == nil && typ == FrameAck && n == len(b) {
				if _, err := io.ReadFull(c, b[:]); err == nil {
					mu.Lock()
					syncN, syncing = binary.BigEndian.Uint64(b[:]), true
					f.SetReadDeadline(time.Unix(1, 0))
					mu.Unlock()
					continue
				}
			}
			mu.Lock()
			gone = true
			f.SetReadDeadline(time.Unix(1, 0))
			mu.Unlock()
			return
		}
	}()

	bp := bufPool.Get().(*[]byte)
	defer bufPool.Put(bp)
	buf := *bp
	for {
		mu.Lock()
		if gone {
			mu.Unlock()
			return
		}
		sn, doSync := syncN, syncing
		syncing = false
		if !doSync {
			f.SetReadDeadline(w.deadline())
		}
		mu.Unlock()
		if doSync {
			if err := w.sync(buf, sn); err != nil {
				return
			}
			if w.ended {
				writeFrame(c, FrameEOF, nil)
				return
			}
			continue
		}
		n, err := f.Read(buf)
		now := time.Now()
		switch {
		case err == nil:
			w.parse(buf[:n])
		case errors.Is(err, os.ErrDeadlineExceeded):
		default:
			w.flush()
			sendError(c, CodeIO, "read inotify: "+err.Error())
			return
		}
		w.timers(now)
		if w.flush() != nil {
			return
		}
		if w.ended {
			writeFrame(c, FrameEOF, nil)
			return
		}
	}
}

var errTooManyDirs = errors.New("too many directories")

func sendWatchError(c net.Conn, err error, path string) {
	if errors.Is(err, unix.ENOSPC) {
		sendError(c, CodeTooMany, "inotify watch limit reached: fs.inotify.max_user_watches of the sandbox's user")
		return
	}
	sendOSError(c, &os.PathError{Op: "inotify_add_watch", Path: path, Err: err}, path)
}

// addTree watches the subdirectories of dir, recursively. With synth, the
// entries found are reported as created (dir is new: they may have been
// created before its watch was in place). With initial, failures are
// returned; later, a directory that cannot be watched is reported as an
// overflow and the rest goes on.
func (w *watcher) addTree(dir string, synth, initial bool) error {
	f, err := os.Open(dir)
	if err != nil {
		if initial && dir == w.root {
			return err
		}
		return nil // gone or unreadable meanwhile
	}
	var subdirs []string
	for {
		ents, rerr := f.ReadDir(256)
		for _, e := range ents {
			p := joinPath(dir, e.Name())
			isDir := e.IsDir() // from d_type: a symlink to a directory is not one
			if synth {
				w.emit(WatchCreate, p, "", isDir)
			}
			if isDir && !skipDescend(p) {
				subdirs = append(subdirs, p)
			}
		}
		if rerr != nil || len(ents) == 0 {
			break
		}
	}
	f.Close()
	for _, p := range subdirs {
		if len(w.dirs) >= maxWatchDirs {
			if initial {
				return errTooManyDirs
			}
			w.emit(WatchOverflow, p, "", true)
			continue
		}
		wd, err := unix.InotifyAddWatch(w.fd, p, watchMask|unix.IN_ONLYDIR|unix.IN_DONT_FOLLOW)
		if err != nil {
			if err == unix.ENOENT || err == unix.ENOTDIR {
				continue // removed or replaced meanwhile
			}
			if initial {
				return &os.PathError{Op: "inotify_add_watch", Path: p, Err: err}
			}
			w.emit(WatchOverflow, p, "", true)
			continue
		}
		w.dirs[int32(wd)] = p
		if err := w.addTree(p, synth, initial); err != nil {
			return err
		}
	}
	return nil
}

// parse handles one buffer of inotify events.
func (w *watcher) parse(b []byte) {
	for len(b) >= unix.SizeofInotifyEvent {
		wd := int32(binary.NativeEndian.Uint32(b[0:]))
		mask := binary.NativeEndian.Uint32(b[4:])
		cookie := binary.NativeEndian.Uint32(b[8:])
		n := int(binary.NativeEndian.Uint32(b[12:]))
		if unix.SizeofInotifyEvent+n > len(b) {
			return // cannot happen: the kernel returns whole events
		}
		name := b[unix.SizeofInotifyEvent : unix.SizeofInotifyEvent+n]
		for len(name) > 0 && name[len(name)-1] == 0 {
			name = name[:len(name)-1]
		}
		b = b[unix.SizeofInotifyEvent+n:]
		w.handle(wd, mask, cookie, string(name))
	}
}

func (w *watcher) handle(wd int32, mask, cookie uint32, name string) {
	if mask&unix.IN_Q_OVERFLOW != 0 {
		w.flushFrom()
		w.emit(WatchOverflow, w.root, "", true)
		return
	}
	dir, ok := w.dirs[wd]
	if !ok {
		return // a watch already forgotten
	}
	if mask&unix.IN_IGNORED != 0 {
		delete(w.dirs, wd)
		if wd == w.rootWd {
			w.flushFrom()
			w.ended = true
		}
		return
	}
	if name == "" && wd != w.rootWd {
		// About a watched subdirectory itself: its parent's watch reports
		// the same change by name.
		return
	}
	p := joinPath(dir, name)
	isDir := mask&unix.IN_ISDIR != 0
	if name == "" {
		isDir = w.rootIsDir
	}
	if w.from != nil && (mask&unix.IN_MOVED_TO == 0 || cookie != w.from.cookie) {
		w.flushFrom()
	}
	switch {
	case mask&unix.IN_CREATE != 0:
		w.emit(WatchCreate, p, "", isDir)
		if isDir && w.recursive {
			w.watchNew(p, true)
		}
	case mask&unix.IN_MOVED_FROM != 0:
		w.from = &movedFrom{cookie: cookie, path: p, dir: isDir, at: time.Now()}
		delete(w.writes, p)
	case mask&unix.IN_MOVED_TO != 0:
		if w.from != nil {
			old := w.from.path
			w.from = nil
			w.emit(WatchRename, p, old, isDir)
			if isDir && w.recursive {
				w.renameTree(old, p)
			}
			return
		}
		w.emit(WatchCreate, p, "", isDir)
		if isDir && w.recursive {
			w.watchNew(p, false)
		}
	case mask&unix.IN_DELETE != 0:
		delete(w.writes, p)
		w.emit(WatchRemove, p, "", isDir)
	case mask&(unix.IN_MODIFY|unix.IN_CLOSE_WRITE) != 0:
		w.write(p, mask&unix.IN_CLOSE_WRITE != 0)
	case mask&unix.IN_ATTRIB != 0:
		w.emit(WatchChmod, p, "", isDir)
	case mask&(unix.IN_DELETE_SELF|unix.IN_MOVE_SELF) != 0:
		// The watched path itself is gone (removed, or moved away: its
		// new name is unknown); the stream ends.
		w.emit(WatchRemove, p, "", isDir)
		w.ended = true
	}
}

// watchNew starts watching a directory that appeared under a recursive
// watch, and its subdirectories.
func (w *watcher) watchNew(p string, synth bool) {
	if skipDescend(p) {
		return
	}
	if len(w.dirs) >= maxWatchDirs {
		w.emit(WatchOverflow, p, "", true)
		return
	}
	wd, err := unix.InotifyAddWatch(w.fd, p, watchMask|unix.IN_ONLYDIR|unix.IN_DONT_FOLLOW)
	if err != nil {
		if err != unix.ENOENT && err != unix.ENOTDIR {
			w.emit(WatchOverflow, p, "", true)
		}
		return
	}
	w.dirs[int32(wd)] = p
	w.addTree(p, synth, false)
}

// renameTree updates the paths of the watches under a directory moved
// within the tree (the kernel's watches follow the inodes).
func (w *watcher) renameTree(old, p string) {
	for wd, d := range w.dirs {
		if d == old {
			w.dirs[wd] = p
		} else if len(d) > len(old) && d[len(old)] == '/' && d[:len(old)] == old {
			w.dirs[wd] = p + d[len(old):]
		}
	}
}

// unwatchTree drops the watches under a directory moved out of the tree.
func (w *watcher) unwatchTree(old string) {
	for wd, d := range w.dirs {
		if wd != w.rootWd && (d == old || (len(d) > len(old) && d[len(old)] == '/' && d[:len(old)] == old)) {
			unix.InotifyRmWatch(w.fd, uint32(wd))
			delete(w.dirs, wd)
		}
	}
}

// flushFrom reports a pending IN_MOVED_FROM without its IN_MOVED_TO: the
// path was moved out of the watched tree.
func (w *watcher) flushFrom() {
	if w.from == nil {
		return
	}
	m := w.from
	w.from = nil
	if m.dir && w.recursive {
		w.unwatchTree(m.path)
	}
	w.emit(WatchRemove, m.path, "", m.dir)
}

func (w *watcher) write(p string, closing bool) {
	st := w.writes[p]
	now := time.Now()
	switch {
	case st == nil:
		w.emit(WatchWrite, p, "", false)
		if !closing {
			if len(w.writes) >= maxWriteStates {
				clear(w.writes)
			}
			w.writes[p] = &writeState{emitted: now}
		}
	case closing:
		if st.dirty {
			w.emit(WatchWrite, p, "", false)
		}
		delete(w.writes, p)
	case now.Sub(st.emitted) >= writeWindow:
		w.emit(WatchWrite, p, "", false)
		st.emitted, st.dirty = now, false
	default:
		st.dirty = true
	}
}

// timers reports what is due: moves whose pair did not come, and coalesced
// writes at the end of their window.
func (w *watcher) timers(now time.Time) {
	if w.from != nil && now.Sub(w.from.at) >= renameWait {
		w.flushFrom()
	}
	for p, st := range w.writes {
		if st.dirty && now.Sub(st.emitted) >= writeWindow {
			w.emit(WatchWrite, p, "", false)
			st.emitted, st.dirty = now, false
		}
	}
}

// sync answers a client's sync n: it reads what the kernel has queued
// (without waiting: the fd is non-blocking), reports it and what is held
// back, then R({"sync":n}).
func (w *watcher) sync(buf []byte, n uint64) error {
	for i := 0; i < maxSyncReads; i++ {
		m, err := unix.Read(w.fd, buf)
		if err == unix.EINTR {
			continue
		}
		if err == unix.EAGAIN {
			break
		}
		if err != nil {
			w.flush()
			sendError(w.c, CodeIO, "read inotify: "+err.Error())
			return err
		}
		if m <= 0 {
			break
		}
		w.parse(buf[:m])
	}
	// Both halves of a move are queued by the same system call: an
	// IN_MOVED_FROM still alone was a move out of the tree.
	w.flushFrom()
	now := time.Now()
	for p, st := range w.writes {
		if st.dirty {
			w.emit(WatchWrite, p, "", false)
			st.emitted, st.dirty = now, false
		}
	}
	if err := w.flush(); err != nil {
		return err
	}
	return writeJSONFrame(w.c, FrameReply, wireWatchSync{Sync: n})
}

// deadline is when timers next has something to do; zero if nothing.
func (w *watcher) deadline() time.Time {
	var d time.Time
	if w.from != nil {
		d = w.from.at.Add(renameWait)
	}
	for _, st := range w.writes {
		if st.dirty {
			if t := st.emitted.Add(writeWindow); d.IsZero() || t.Before(d) {
				d = t
			}
		}
	}
	return d
}

func (w *watcher) emit(op, path, old string, dir bool) {
	w.out = append(w.out, wireWatchEvent{Op: op, Path: path, Old: old, Dir: dir})
	if len(w.out) >= watchBatch {
		w.flush()
	}
}

// flush sends the pending events as one frame.
func (w *watcher) flush() error {
	if w.werr != nil || len(w.out) == 0 {
		w.out = w.out[:0]
		return w.werr
	}
	w.werr = writeJSONFrame(w.c, FrameData, w.out)
	w.out = w.out[:0]
	if cap(w.out) > watchBatch {
		w.out = nil
	}
	return w.werr
}

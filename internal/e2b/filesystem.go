package e2b

// envd's filesystem service (api/e2b/filesystem/filesystem.proto) on the
// guest agent's file operations and its inotify watches.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"path"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	fsp "github.com/shoal-sandbox/shoal/api/e2b/filesystem"
	"github.com/shoal-sandbox/shoal/api/e2b/filesystem/filesystemconnect"
	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/node"
)

type filesystemService struct {
	filesystemconnect.UnimplementedFilesystemHandler
	s *Server
}

var _ filesystemconnect.FilesystemHandler = (*filesystemService)(nil)

// entryInfo is envd's EntryInfo for the file at p: owner and group by name
// (from the sandbox's /etc/passwd and /etc/group, else the number).
func entryInfo(p string, fi agent.FileInfo) *fsp.EntryInfo {
	e := &fsp.EntryInfo{
		Name: path.Base(p), Path: p, Size: fi.Size, Mode: uint32(fi.Mode.Perm()),
		Permissions: fi.Mode.String(), ModifiedTime: timestamppb.New(fi.ModTime),
		Owner: fi.Owner, Group: fi.Group, Metadata: metadataOf(fi.Xattrs),
	}
	switch {
	case fi.Mode&fs.ModeSymlink != 0 && fi.Target != "":
		// As envd: a symlink has its target's type and permission bits
		// (unspecified when it points nowhere, or to neither a file nor
		// a directory), its absolute resolved target in symlinkTarget,
		// and its own size, mtime and permissions string.
		target := fi.Target
		e.SymlinkTarget = &target
		e.Type, e.Mode = fsp.FileType_FILE_TYPE_UNSPECIFIED, 0
		if fi.TargetOK {
			e.Mode = uint32(fi.TargetMode.Perm())
			switch {
			case fi.TargetMode.IsDir():
				e.Type = fsp.FileType_FILE_TYPE_DIRECTORY
			case fi.TargetMode.IsRegular():
				e.Type = fsp.FileType_FILE_TYPE_FILE
			}
		}
	case fi.Mode&fs.ModeSymlink != 0 || fi.Symlink != "":
		// An agent that does not resolve links: the link itself.
		e.Type = fsp.FileType_FILE_TYPE_SYMLINK
		target := fi.Symlink
		if target != "" && !strings.HasPrefix(target, "/") {
			target = path.Join(path.Dir(p), target)
		}
		e.SymlinkTarget = &target
	case fi.IsDir:
		e.Type = fsp.FileType_FILE_TYPE_DIRECTORY
	case fi.Mode.IsRegular():
		e.Type = fsp.FileType_FILE_TYPE_FILE
	}
	return e
}

// fsTarget resolves a request's path in the request's sandbox.
func (f *filesystemService) fsTarget(ctx context.Context, p string) (string, *agent.Client, error) {
	id, ag, err := f.s.agentFor(ctx)
	if err != nil {
		return "", nil, err
	}
	uag, _, home, err := f.s.actAs(ctx, id, ag)
	if err != nil {
		return "", nil, err
	}
	abs, err := resolvePath(p, home)
	if err != nil {
		return "", nil, err
	}
	return abs, uag, nil
}

func (f *filesystemService) Stat(ctx context.Context, req *connect.Request[fsp.StatRequest]) (*connect.Response[fsp.StatResponse], error) {
	p, ag, err := f.fsTarget(ctx, req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	fi, err := ag.Stat(ctx, p)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&fsp.StatResponse{Entry: entryInfo(p, fi)}), nil
}

func (f *filesystemService) ListDir(ctx context.Context, req *connect.Request[fsp.ListDirRequest]) (*connect.Response[fsp.ListDirResponse], error) {
	p, ag, err := f.fsTarget(ctx, req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	out := &fsp.ListDirResponse{}
	depth := int(req.Msg.GetDepth())
	if depth <= 1 {
		ents, err := ag.ListDir(ctx, p)
		if err != nil {
			return nil, toConnect(err)
		}
		for _, fi := range ents {
			out.Entries = append(out.Entries, entryInfo(path.Join(p, fi.Name), fi))
		}
		return connect.NewResponse(out), nil
	}
	ents, err := ag.ListTree(ctx, p, depth)
	if err != nil {
		return nil, toConnect(err)
	}
	for _, e := range ents {
		out.Entries = append(out.Entries, entryInfo(e.Path, e.FileInfo))
	}
	return connect.NewResponse(out), nil
}

func (f *filesystemService) MakeDir(ctx context.Context, req *connect.Request[fsp.MakeDirRequest]) (*connect.Response[fsp.MakeDirResponse], error) {
	p, ag, err := f.fsTarget(ctx, req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	fi, err := ag.Stat(ctx, p)
	switch {
	case err == nil && fi.IsDir:
		return nil, connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("directory %s already exists", p))
	case err == nil:
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("path %s already exists and is not a directory", p))
	case codeOf(err) != connect.CodeNotFound:
		return nil, toConnect(err)
	}
	if err := ag.MakeDir(ctx, p, 0o755); err != nil {
		return nil, toConnect(err)
	}
	if fi, err = ag.Stat(ctx, p); err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&fsp.MakeDirResponse{Entry: entryInfo(p, fi)}), nil
}

// renamer is the agent's rename operation, used once the agent has one.
type renamer interface {
	Rename(ctx context.Context, oldPath, newPath string) error
}

func (f *filesystemService) Move(ctx context.Context, req *connect.Request[fsp.MoveRequest]) (*connect.Response[fsp.MoveResponse], error) {
	src, ag, err := f.fsTarget(ctx, req.Msg.GetSource())
	if err != nil {
		return nil, err
	}
	dst, _, err := f.fsTarget(ctx, req.Msg.GetDestination())
	if err != nil {
		return nil, err
	}
	if src == "/" || dst == "/" {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("cannot move / or onto /"))
	}
	if _, err := ag.Stat(ctx, src); err != nil {
		return nil, toConnect(err)
	}
	// Like envd: the destination's parent directories are created.
	if err := ag.MakeDir(ctx, path.Dir(dst), 0o755); err != nil {
		return nil, toConnect(err)
	}
	if err := rename(ctx, ag, src, dst); err != nil {
		return nil, toConnect(err)
	}
	fi, err := ag.Stat(ctx, dst)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&fsp.MoveResponse{Entry: entryInfo(dst, fi)}), nil
}

// rename renames src to dst with rename(2) semantics. Until the guest
// agent has a rename operation, it runs `mv -f -T` in the sandbox (GNU
// coreutils and busybox both have it).
func rename(ctx context.Context, ag *agent.Client, src, dst string) error {
	if r, ok := any(ag).(renamer); ok {
		return r.Rename(ctx, src, dst)
	}
	pr, err := ag.Exec(ctx, agent.ExecRequest{Args: []string{"mv", "-f", "-T", "--", src, dst}, Cwd: "/", Timeout: time.Minute})
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("move %s to %s: the sandbox has no mv command (Shoal's agent has no rename operation yet): %w", src, dst, errors.ErrUnsupported)
		}
		return fmt.Errorf("move %s to %s: %w", src, dst, err)
	}
	defer pr.Close()
	var stderr strings.Builder
	for {
		ev, err := pr.Recv()
		if err != nil {
			if err == io.EOF {
				return fmt.Errorf("move %s to %s: mv ended without a status", src, dst)
			}
			return fmt.Errorf("move %s to %s: %w", src, dst, err)
		}
		switch ev.Kind {
		case agent.EventStderr:
			if stderr.Len() < 4096 {
				stderr.Write(ev.Data)
			}
		case agent.EventExit:
			if ev.Exit.Code == 0 {
				return nil
			}
			msg := strings.TrimSpace(stderr.String())
			if msg == "" {
				msg = fmt.Sprintf("mv exited with %d", ev.Exit.Code)
			}
			return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("move %s to %s: %s", src, dst, msg))
		}
	}
}

func (f *filesystemService) Remove(ctx context.Context, req *connect.Request[fsp.RemoveRequest]) (*connect.Response[fsp.RemoveResponse], error) {
	p, ag, err := f.fsTarget(ctx, req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	if p == "/" {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("refusing to remove /"))
	}
	// envd removes like os.RemoveAll: a whole tree, and a missing path is
	// no error.
	if err := ag.Remove(ctx, p, true); err != nil && codeOf(err) != connect.CodeNotFound {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&fsp.RemoveResponse{}), nil
}

// --- watches ---

// startWatch checks that dir is a directory and starts an agent watch on
// it, bounded by ctx.
func (f *filesystemService) startWatch(ctx context.Context, p string, recursive bool) (string, *agent.Client, *agent.Watcher, error) {
	dir, ag, err := f.fsTarget(ctx, p)
	if err != nil {
		return "", nil, nil, err
	}
	fi, err := ag.Stat(ctx, dir)
	if err != nil {
		return "", nil, nil, toConnect(err)
	}
	if !fi.IsDir && !(fi.TargetOK && fi.TargetMode.IsDir()) { // a link to a directory is watched as envd does
		return "", nil, nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("path %s is not a directory", dir))
	}
	w, err := ag.Watch(ctx, dir, recursive)
	if err != nil {
		return "", nil, nil, toConnect(err)
	}
	return dir, ag, w, nil
}

// fsEvents turns an agent watch event into envd's events: a rename inside
// the watched tree is a rename of the old name and a create of the new one
// (as envd's fsnotify reports it). Names are relative to the watched
// directory.
func fsEvents(ctx context.Context, ag *agent.Client, dir string, ev agent.WatchEvent, withEntry bool) []*fsp.FilesystemEvent {
	rel := func(p string) string {
		r := strings.TrimPrefix(strings.TrimPrefix(p, dir), "/")
		if dir == "/" {
			r = strings.TrimPrefix(p, "/")
		}
		return r
	}
	mk := func(t fsp.EventType, p string) *fsp.FilesystemEvent {
		e := &fsp.FilesystemEvent{Name: rel(p), Type: t}
		if withEntry && t != fsp.EventType_EVENT_TYPE_REMOVE && t != fsp.EventType_EVENT_TYPE_RENAME {
			sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			if fi, err := ag.Stat(sctx, p); err == nil {
				e.Entry = entryInfo(p, fi)
			}
			cancel()
		}
		return e
	}
	if isAgentTemp(ev.Path) {
		if ev.Op == agent.WatchRename && !isAgentTemp(ev.OldPath) {
			return []*fsp.FilesystemEvent{mk(fsp.EventType_EVENT_TYPE_REMOVE, ev.OldPath)}
		}
		return nil
	}
	if ev.Op == agent.WatchRename && isAgentTemp(ev.OldPath) {
		// The agent's atomic write (files.write) landing. envd's upload
		// creates the file, gives it to the request's user, then writes
		// it, in place: its watchers see a create, a chmod (the chown)
		// and a write.
		return []*fsp.FilesystemEvent{mk(fsp.EventType_EVENT_TYPE_CREATE, ev.Path), mk(fsp.EventType_EVENT_TYPE_CHMOD, ev.Path), mk(fsp.EventType_EVENT_TYPE_WRITE, ev.Path)}
	}
	switch ev.Op {
	case agent.WatchCreate:
		return []*fsp.FilesystemEvent{mk(fsp.EventType_EVENT_TYPE_CREATE, ev.Path)}
	case agent.WatchWrite:
		return []*fsp.FilesystemEvent{mk(fsp.EventType_EVENT_TYPE_WRITE, ev.Path)}
	case agent.WatchRemove:
		return []*fsp.FilesystemEvent{mk(fsp.EventType_EVENT_TYPE_REMOVE, ev.Path)}
	case agent.WatchChmod:
		return []*fsp.FilesystemEvent{mk(fsp.EventType_EVENT_TYPE_CHMOD, ev.Path)}
	case agent.WatchRename:
		return []*fsp.FilesystemEvent{mk(fsp.EventType_EVENT_TYPE_RENAME, ev.OldPath), mk(fsp.EventType_EVENT_TYPE_CREATE, ev.Path)}
	}
	return nil // overflow (envd has no such event), synced
}

// isAgentTemp reports whether p is a temp file of the agent's atomic write
// (".NAME.shoal-tmp-NNN" beside NAME): watchers do not see those.
func isAgentTemp(p string) bool {
	base := path.Base(p)
	return strings.HasPrefix(base, ".") && strings.Contains(base, ".shoal-tmp-")
}

// pumpWatch reads w until it ends (or ctx does) and sends each event on
// out; it closes out at the end, after setting *errp (nil when the watched
// directory went away).
func pumpWatch(ctx context.Context, w *agent.Watcher, out chan<- agent.WatchEvent, errp *error) {
	defer close(out)
	for {
		ev, err := w.Next()
		if err != nil {
			if !errors.Is(err, io.EOF) {
				*errp = err
			}
			return
		}
		select {
		case out <- ev:
		case <-ctx.Done():
			return
		}
	}
}

func (f *filesystemService) WatchDir(ctx context.Context, req *connect.Request[fsp.WatchDirRequest], stream *connect.ServerStream[fsp.WatchDirResponse]) error {
	release, err := f.s.holdStream(ctx, sandboxID(ctx), "a watch")
	if err != nil {
		return err
	}
	defer release()
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	dir, ag, w, err := f.startWatch(wctx, req.Msg.GetPath(), req.Msg.GetRecursive())
	if err != nil {
		return err
	}
	defer w.Close()
	if err := stream.Send(&fsp.WatchDirResponse{Event: &fsp.WatchDirResponse_Start{Start: &fsp.WatchDirResponse_StartEvent{}}}); err != nil {
		return err
	}
	evs := make(chan agent.WatchEvent, 64)
	var werr error
	go pumpWatch(wctx, w, evs, &werr)
	ka := time.NewTicker(keepAliveOf(req.Header()))
	defer ka.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-ka.C:
			if err := stream.Send(&fsp.WatchDirResponse{Event: &fsp.WatchDirResponse_Keepalive{Keepalive: &fsp.WatchDirResponse_KeepAlive{}}}); err != nil {
				return err
			}
		case ev, ok := <-evs:
			if !ok {
				if werr != nil && ctx.Err() == nil {
					if f.s.sandboxGone(sandboxID(ctx)) {
						// envd dies with its sandbox: cut as a process
						// stream is (processService.stream).
						panic(http.ErrAbortHandler)
					}
					return toConnect(werr)
				}
				return nil // the watched directory is gone
			}
			for _, e := range fsEvents(ctx, ag, dir, ev, req.Msg.GetIncludeEntry()) {
				if err := stream.Send(&fsp.WatchDirResponse{Event: &fsp.WatchDirResponse_Filesystem{Filesystem: e}}); err != nil {
					return err
				}
			}
		}
	}
}

// sandboxGone reports whether sandbox id is deleted or being deleted.
func (s *Server) sandboxGone(id string) bool {
	rec, err := s.node.Get(id)
	return errors.Is(err, errdefs.ErrNotFound) || err == nil && rec.State == node.StateDeleting
}

// Non-streaming watchers (CreateWatcher, GetWatcherEvents, RemoveWatcher:
// what the synchronous Python SDK polls) are kept here, each with its
// events since the last poll.

const (
	maxWatcherEvents = 10000            // per watcher, between two polls; older ones are dropped
	watcherIdle      = 10 * time.Minute // a watcher nobody polls that long is removed
)

type pollWatcher struct {
	id, sandbox string
	cancel      context.CancelFunc
	w           *agent.Watcher

	mu       sync.Mutex // guards the fields below
	events   []*fsp.FilesystemEvent
	dropped  int
	ended    bool
	err      error
	lastPoll time.Time
	syncs    uint64        // the last sync asked of the agent's watch
	synced   uint64        // the last one answered, with every event before it in events
	changed  chan struct{} // closed (and replaced) when synced or ended changes
}

// maxSyncWait bounds how long a poll waits for the events already caused
// (the agent's answer to a sync); past it, the poll returns what is there.
const maxSyncWait = 10 * time.Second

// caughtUp makes sure that the events of every change made before it are
// in w.events: it asks the agent's watch for a sync and waits for its
// answer, which comes after them (agent.Watcher.Sync). A poll right after
// a write then sees the write's events, as envd's watcher, which is in the
// same process as the write, does. An agent that predates syncs, a watch
// that ended, or ctx ending or maxSyncWait passing, make it return early.
func (w *pollWatcher) caughtUp(ctx context.Context) {
	w.mu.Lock()
	if w.ended {
		w.mu.Unlock()
		return
	}
	w.syncs++
	n := w.syncs
	w.mu.Unlock()
	if err := w.w.Sync(n); err != nil {
		return
	}
	t := time.NewTimer(maxSyncWait)
	defer t.Stop()
	for {
		w.mu.Lock()
		done, ch := w.synced >= n || w.ended, w.changed
		w.mu.Unlock()
		if done {
			return
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return
		case <-t.C:
			return
		}
	}
}

// notify wakes caughtUp's waiters; w.mu is held.
func (w *pollWatcher) notify() {
	close(w.changed)
	w.changed = make(chan struct{})
}

type watcherRegistry struct {
	s    *Server
	stop chan struct{}

	mu   sync.Mutex // guards byID
	byID map[string]*pollWatcher
}

func newWatcherRegistry(s *Server) *watcherRegistry {
	r := &watcherRegistry{s: s, stop: make(chan struct{}), byID: map[string]*pollWatcher{}}
	go r.reap()
	return r
}

func (r *watcherRegistry) reap() {
	t := time.NewTicker(time.Minute)
	defer t.Stop()
	for {
		select {
		case <-r.stop:
			return
		case now := <-t.C:
			r.remove(func(w *pollWatcher) bool {
				w.mu.Lock()
				defer w.mu.Unlock()
				return now.Sub(w.lastPoll) > watcherIdle
			})
		}
	}
}

func (r *watcherRegistry) remove(match func(*pollWatcher) bool) {
	r.mu.Lock()
	var gone []*pollWatcher
	for id, w := range r.byID {
		if match(w) {
			gone = append(gone, w)
			delete(r.byID, id)
		}
	}
	r.mu.Unlock()
	for _, w := range gone {
		w.cancel()
	}
}

func (r *watcherRegistry) dropSandbox(id string) {
	r.remove(func(w *pollWatcher) bool { return w.sandbox == id })
}

func (r *watcherRegistry) close() {
	select {
	case <-r.stop:
	default:
		close(r.stop)
	}
	r.remove(func(*pollWatcher) bool { return true })
}

func (r *watcherRegistry) get(sandbox, id string) (*pollWatcher, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	w, ok := r.byID[id]
	if !ok || w.sandbox != sandbox {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("watcher %q not found", id))
	}
	return w, nil
}

func (f *filesystemService) CreateWatcher(ctx context.Context, req *connect.Request[fsp.CreateWatcherRequest]) (*connect.Response[fsp.CreateWatcherResponse], error) {
	sandbox := sandboxID(ctx)
	// It holds an agent watch until it ends: it counts against the
	// sandbox's and the key's stream caps as a streamed watch does.
	release, err := f.s.holdStream(ctx, sandbox, "a directory watcher")
	if err != nil {
		return nil, err
	}
	// The watch outlives this request (it ends with RemoveWatcher, the
	// sandbox, or nobody polling it); the request bounds only its start.
	wctx, cancel := context.WithCancel(withUser(context.WithValue(context.Background(), sandboxKey{}, sandbox), userOf(ctx)))
	stop := context.AfterFunc(ctx, cancel)
	dir, ag, w, err := f.startWatch(wctx, req.Msg.GetPath(), req.Msg.GetRecursive())
	if !stop() {
		err = toConnect(context.Cause(ctx))
	}
	if err != nil {
		if w != nil {
			w.Close()
		}
		cancel()
		release()
		return nil, err
	}
	var b [12]byte
	rand.Read(b[:])
	pw := &pollWatcher{id: hex.EncodeToString(b[:]), sandbox: sandbox, cancel: cancel, w: w, lastPoll: time.Now(), changed: make(chan struct{})}
	f.s.watchers.mu.Lock()
	f.s.watchers.byID[pw.id] = pw
	f.s.watchers.mu.Unlock()
	include := req.Msg.GetIncludeEntry()
	go func() {
		defer release()
		defer w.Close()
		evs := make(chan agent.WatchEvent, 64)
		var werr error
		go pumpWatch(wctx, w, evs, &werr)
		for ev := range evs {
			if ev.Op == agent.WatchSynced {
				pw.mu.Lock()
				pw.synced = max(pw.synced, ev.Sync)
				pw.notify()
				pw.mu.Unlock()
				continue
			}
			for _, e := range fsEvents(wctx, ag, dir, ev, include) {
				pw.mu.Lock()
				if len(pw.events) >= maxWatcherEvents {
					pw.events = pw.events[1:]
					pw.dropped++
				}
				pw.events = append(pw.events, e)
				pw.mu.Unlock()
			}
		}
		pw.mu.Lock()
		pw.ended, pw.err = true, werr
		pw.notify()
		pw.mu.Unlock()
	}()
	return connect.NewResponse(&fsp.CreateWatcherResponse{WatcherId: pw.id}), nil
}

func (f *filesystemService) GetWatcherEvents(ctx context.Context, req *connect.Request[fsp.GetWatcherEventsRequest]) (*connect.Response[fsp.GetWatcherEventsResponse], error) {
	w, err := f.s.watchers.get(sandboxID(ctx), req.Msg.GetWatcherId())
	if err != nil {
		return nil, err
	}
	w.caughtUp(ctx)
	w.mu.Lock()
	evs, ended, werr, dropped := w.events, w.ended, w.err, w.dropped
	w.events, w.dropped, w.lastPoll = nil, 0, time.Now()
	w.mu.Unlock()
	if dropped > 0 {
		f.s.log.Warn("e2b: watcher dropped events between polls", "sandbox_id", w.sandbox, "watcher", w.id, "dropped", dropped)
	}
	if len(evs) == 0 && ended {
		f.s.watchers.remove(func(x *pollWatcher) bool { return x == w })
		if werr != nil {
			return nil, toConnect(werr)
		}
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("watcher %s ended: the watched directory is gone", w.id))
	}
	return connect.NewResponse(&fsp.GetWatcherEventsResponse{Events: evs}), nil
}

func (f *filesystemService) RemoveWatcher(ctx context.Context, req *connect.Request[fsp.RemoveWatcherRequest]) (*connect.Response[fsp.RemoveWatcherResponse], error) {
	w, err := f.s.watchers.get(sandboxID(ctx), req.Msg.GetWatcherId())
	if err != nil {
		return nil, err
	}
	f.s.watchers.remove(func(x *pollWatcher) bool { return x == w })
	return connect.NewResponse(&fsp.RemoveWatcherResponse{}), nil
}

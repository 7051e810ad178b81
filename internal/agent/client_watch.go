package agent

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"path"
	"slices"
	"sync"
)

// WatchEvent is one change reported by a watch. Op is one of WatchCreate,
// WatchWrite, WatchRemove, WatchRename (OldPath is the path before),
// WatchChmod or WatchOverflow (events were lost; Path is where to re-scan),
// or WatchSynced, the answer to Watcher.Sync(Sync).
type WatchEvent struct {
	Op      string
	Path    string
	OldPath string
	IsDir   bool
	Sync    uint64 // WatchSynced: the number given to Sync
}

// WatchSynced is the event that answers Watcher.Sync: every change made
// before the Sync call was reported before it.
const WatchSynced = "synced"

// Watcher is a running watch; see Client.Watch.
type Watcher struct {
	cc     *clientConn
	syncOK bool // the agent answers Sync
	batch  []wireWatchEvent
	err    error
	wmu    sync.Mutex // serializes Sync's writes
}

// Watch starts watching path (a directory, or a single file when not
// recursive) with inotify in the sandbox; recursive also watches every
// subdirectory, including ones created later. It returns once the watch is
// in place, armed as the client's user (AsUser) if it has one. ctx
// bounds the watch's life; Close ends it.
func (c *Client) Watch(ctx context.Context, path string, recursive bool) (*Watcher, error) {
	cc, err := c.open(ctx, OpWatch, path, wireWatchRequest{Path: path, Recursive: recursive, User: c.user})
	if err != nil {
		return nil, err
	}
	if err := cc.readReply(nil); err != nil {
		cc.close()
		return nil, err
	}
	return &Watcher{cc: cc, syncOK: c.syncOK.Load()}, nil
}

// Sync asks the agent to report every change made before the call (every
// event the kernel has queued for the watch by the time the request
// arrives), then a WatchSynced event carrying n, in order among the
// others: once Next returns it, everything made before Sync was returned.
// It may be called concurrently with Next. An agent that predates it is
// an *Error of Code CodeUnsupported.
func (w *Watcher) Sync(n uint64) error {
	if !w.syncOK {
		return &Error{Op: OpWatch.String(), Path: w.cc.path, Code: CodeUnsupported, Msg: "the sandbox's agent predates watch syncs"}
	}
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], n)
	w.wmu.Lock()
	defer w.wmu.Unlock()
	if err := writeFrame(w.cc, FrameAck, b[:]); err != nil {
		return w.cc.wrapErr(err)
	}
	return nil
}

// Next blocks until the next event. It returns io.EOF when the watched path
// itself was removed or moved away, and an error if the watch failed or
// was closed.
func (w *Watcher) Next() (WatchEvent, error) {
	for len(w.batch) == 0 {
		if w.err != nil {
			return WatchEvent{}, w.err
		}
		typ, payload, err := readFrame(w.cc)
		if err != nil {
			w.err = w.cc.wrapErr(unexpectedEOF(err))
			continue
		}
		switch typ {
		case FrameData:
			if err := json.Unmarshal(payload, &w.batch); err != nil {
				w.err = w.cc.protoErr("bad watch events: " + err.Error())
			}
		case FrameReply:
			var rep wireWatchSync
			if err := json.Unmarshal(payload, &rep); err != nil {
				w.err = w.cc.protoErr("bad watch sync: " + err.Error())
				continue
			}
			return WatchEvent{Op: WatchSynced, Sync: rep.Sync}, nil
		case FrameEOF:
			w.err = io.EOF
			w.cc.close()
		case FrameError:
			w.err = w.cc.agentErr(payload)
		default:
			w.err = w.cc.protoErr(fmt.Sprintf("unexpected frame %q", typ))
		}
	}
	e := w.batch[0]
	w.batch = w.batch[1:]
	return WatchEvent{Op: e.Op, Path: e.Path, OldPath: e.Old, IsDir: e.Dir}, nil
}

// Close ends the watch; it may be called concurrently with Next to abort
// it.
func (w *Watcher) Close() error {
	w.cc.close()
	return nil
}

// TreeEntry is an entry of a recursive list: Path is its full path.
type TreeEntry struct {
	FileInfo
	Path string
}

// ListTree lists dir and depth-1 levels of subdirectories below it (depth
// 1 lists dir's own entries), without following symlinks, sorted by path
// (each directory right before its entries). Past MaxListEntries entries it
// fails with an *Error of Code CodeTooMany.
func (c *Client) ListTree(ctx context.Context, dir string, depth int) ([]TreeEntry, error) {
	cc, err := c.open(ctx, OpListDir, dir, wireListRequest{Path: dir, Depth: depth, User: c.user, WithXattrs: c.xattrs})
	if err != nil {
		return nil, err
	}
	defer cc.close()
	root := path.Clean(dir)
	var out []TreeEntry
	for {
		typ, payload, err := readFrame(cc)
		if err != nil {
			return nil, cc.wrapErr(unexpectedEOF(err))
		}
		switch typ {
		case FrameData:
			var batch []wireFileInfo
			if err := json.Unmarshal(payload, &batch); err != nil {
				return nil, cc.protoErr("bad list batch: " + err.Error())
			}
			if len(out)+len(batch) > MaxListEntries {
				return nil, cc.tooMany()
			}
			for _, w := range batch {
				rel := w.Name
				w.Name = path.Base(rel)
				out = append(out, TreeEntry{FileInfo: fromWire(w), Path: path.Join(root, rel)})
			}
		case FrameEOF:
			slices.SortFunc(out, func(a, b TreeEntry) int { return comparePaths(a.Path, b.Path) })
			return out, nil
		case FrameError:
			return nil, cc.agentErr(payload)
		default:
			return nil, cc.protoErr(fmt.Sprintf("unexpected frame %q", typ))
		}
	}
}

// comparePaths orders paths with '/' before every other byte, so that a
// directory's entries follow it directly: "a", "a/b", "a-b".
func comparePaths(a, b string) int {
	for i := 0; i < len(a) && i < len(b); i++ {
		x, y := a[i], b[i]
		if x == y {
			continue
		}
		if x == '/' {
			return -1
		}
		if y == '/' {
			return 1
		}
		if x < y {
			return -1
		}
		return 1
	}
	return len(a) - len(b)
}

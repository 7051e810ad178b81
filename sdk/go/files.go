package shoal

import (
	"context"
	"errors"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
)

// ListDir lists a directory in a sandbox; depth > 1 also lists depth-1
// levels of subdirectories (at most 10,000 entries: past that the error has
// code ResourceExhausted). Entries carry their full path, sorted by path.
func (c *Client) ListDir(ctx context.Context, sandboxID, path string, depth int) ([]*pb.FileInfo, error) {
	return c.ListDirAs(ctx, sandboxID, path, "", depth)
}

// ListDirAs is ListDir as a sandbox user: its permissions are checked ("" =
// root). Entries carry owner and group (names from the sandbox's
// /etc/passwd and /etc/group).
func (c *Client) ListDirAs(ctx context.Context, sandboxID, path, user string, depth int) ([]*pb.FileInfo, error) {
	res, err := c.Sandboxes.ListDir(ctx, connect.NewRequest(&pb.ListDirRequest{SandboxId: sandboxID, Path: path, Depth: int32(depth), User: user}))
	if err != nil {
		return nil, err
	}
	return res.Msg.Entries, nil
}

// WatchArmedHeader is the response header WatchDir sets when its watch is
// in place.
const WatchArmedHeader = "Shoal-Watch-Armed"

// Watch is a running watch of a directory in a sandbox; see Client.Watch.
type Watch struct {
	stream *connect.ServerStreamForClient[pb.WatchDirEvent]
}

// Watch starts watching path in a sandbox (recursive: every subdirectory
// too, including new ones) and returns once the watch is armed: every
// change made after it returns is reported. Read events with Next; cancel
// ctx or call Close to stop.
func (c *Client) Watch(ctx context.Context, sandboxID, path string, recursive bool) (*Watch, error) {
	return c.WatchAs(ctx, sandboxID, path, "", recursive)
}

// WatchAs is Watch as a sandbox user: the watch is armed with the user's
// permissions ("" = root).
func (c *Client) WatchAs(ctx context.Context, sandboxID, path, user string, recursive bool) (*Watch, error) {
	stream, err := c.Sandboxes.WatchDir(ctx, connect.NewRequest(&pb.WatchDirRequest{SandboxId: sandboxID, Path: path, Recursive: recursive, User: user}))
	if err != nil {
		return nil, err
	}
	// The server sends its headers, marked, once the watch is armed; a
	// failure to arm it ends the stream with the error instead.
	if stream.ResponseHeader().Get(WatchArmedHeader) == "" {
		stream.Receive()
		err := stream.Err()
		stream.Close()
		if err == nil {
			err = errors.New("watch stream ended before the watch was armed")
		}
		return nil, err
	}
	return &Watch{stream: stream}, nil
}

// ErrWatchEnded is returned by Next when the watched path itself was
// removed or moved away.
var ErrWatchEnded = errors.New("watched path is gone")

// Next blocks until the next event. Events of kind OP_OVERFLOW mean events
// were lost (re-scan the event's path).
func (w *Watch) Next() (*pb.WatchDirEvent, error) {
	if w.stream.Receive() {
		return w.stream.Msg(), nil
	}
	if err := w.stream.Err(); err != nil {
		return nil, err
	}
	return nil, ErrWatchEnded
}

// Close stops the watch.
func (w *Watch) Close() error { return w.stream.Close() }

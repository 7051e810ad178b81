package limits

import (
	"sync"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// Streams bounds the requests that hold a resource while they last: a
// command's attached output stream (Exec, ConnectCommand, E2B's process
// Start and Connect, PTYs among them), a directory watch, a port forward
// or a proxied connection to a sandbox's port (E2B's public ones
// included). Each holds a few of serve's descriptors and some memory for
// as long as the client keeps it open, so one client, or anyone at a
// public port, could otherwise take the node's every descriptor.
//
// A stream is counted against its sandbox (PerSandbox), the API key it
// came with (PerKey; none for an unauthenticated public port) and the
// node (Total, from serve's own RLIMIT_NOFILE less a reserve, so that
// health, the API and other tenants keep working when one sandbox is at
// its caps). Past a cap it is refused with errdefs.ErrResourceExhausted
// (429 on the E2B face), the message naming the cap.
//
// A nil *Streams bounds nothing. Safe for concurrent use.
type Streams struct {
	perSandbox, perKey, total int

	mu        sync.Mutex // guards the fields below
	n         int
	bySandbox map[string]int
	byKey     map[string]int
}

// Defaults of serve's --max-streams-per-sandbox and --max-streams-per-key.
const (
	DefaultStreamsPerSandbox = 1024
	DefaultStreamsPerKey     = 4096
	// MaxStreamsCap bounds what the flags may set.
	MaxStreamsCap = 1 << 20
	// streamFDs is how many of serve's descriptors a stream may hold: the
	// client's connection, the agent's, and one spare (a proxied
	// connection's pooled upstream).
	streamFDs = 3
)

// NewStreams returns the bounds; total is the node's cap (0: derived from
// this process's RLIMIT_NOFILE by NodeStreams).
func NewStreams(perSandbox, perKey, total int) (*Streams, error) {
	if perSandbox < 1 || perSandbox > MaxStreamsCap || perKey < 1 || perKey > MaxStreamsCap {
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "stream caps %d per sandbox and %d per key: want 1 to %d", perSandbox, perKey, MaxStreamsCap)
	}
	if total <= 0 {
		total = NodeStreams()
	}
	return &Streams{perSandbox: perSandbox, perKey: perKey, total: total, bySandbox: map[string]int{}, byKey: map[string]int{}}, nil
}

// NodeStreams is the node's cap on streams: this process's RLIMIT_NOFILE
// (raise it first) less a reserve of a quarter of it, at least 1,024, for
// everything else serve holds (sandboxes' logs and sockets, the store,
// health and API requests), divided by the descriptors a stream holds.
func NodeStreams() int {
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil || rl.Cur == unix.RLIM_INFINITY {
		return MaxStreamsCap
	}
	cur := int64(min(rl.Cur, 1<<40))
	reserve := max(cur/4, 1024)
	return int(max((cur-reserve)/streamFDs, 16))
}

// Caps returns the caps: per sandbox, per key, and the node's.
func (s *Streams) Caps() (perSandbox, perKey, total int) {
	if s == nil {
		return 0, 0, 0
	}
	return s.perSandbox, s.perKey, s.total
}

// Acquire counts a stream (what: "a command stream", "a watch", ...) of
// sandbox sandboxID opened with key ("": none, a public port), or refuses
// it; release, called once when the stream ends, gives it back.
func (s *Streams) Acquire(sandboxID, key, what string) (release func(), err error) {
	if s == nil {
		return func() {}, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.bySandbox[sandboxID] >= s.perSandbox:
		return nil, errdefs.New(errdefs.ErrResourceExhausted,
			"sandbox %s has %d streams open (commands attached, watches, PTYs, port connections), its cap (serve --max-streams-per-sandbox): %s refused until one ends", sandboxID, s.bySandbox[sandboxID], what)
	case key != "" && s.byKey[key] >= s.perKey:
		return nil, errdefs.New(errdefs.ErrResourceExhausted,
			"API key %s has %d streams open, its cap (serve --max-streams-per-key): %s refused until one ends", key, s.byKey[key], what)
	case s.n >= s.total:
		return nil, errdefs.New(errdefs.ErrResourceExhausted,
			"this node has %d streams open, its cap (from its open files limit): %s refused until one ends", s.n, what)
	}
	s.n++
	s.bySandbox[sandboxID]++
	if key != "" {
		s.byKey[key]++
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			s.mu.Lock()
			defer s.mu.Unlock()
			s.n--
			if s.bySandbox[sandboxID]--; s.bySandbox[sandboxID] <= 0 {
				delete(s.bySandbox, sandboxID)
			}
			if key != "" {
				if s.byKey[key]--; s.byKey[key] <= 0 {
					delete(s.byKey, key)
				}
			}
		})
	}, nil
}

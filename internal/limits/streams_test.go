package limits

import (
	"errors"
	"strings"
	"testing"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"golang.org/x/sys/unix"
)

func TestStreams(t *testing.T) {
	s, err := NewStreams(64, 100, 150)
	if err != nil {
		t.Fatal(err)
	}
	var held []func()
	take := func(sb, key string) error {
		r, err := s.Acquire(sb, key, "a watch")
		if err == nil {
			held = append(held, r)
		}
		return err
	}
	for i := range 64 {
		if err := take("a", "k1"); err != nil {
			t.Fatalf("stream %d: %v", i, err)
		}
	}
	err = take("a", "k2")
	if !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "--max-streams-per-sandbox") {
		t.Fatalf("65th of a sandbox: %v", err)
	}
	for range 36 {
		if err := take("b", "k1"); err != nil {
			t.Fatal(err)
		}
	}
	if err := take("c", "k1"); !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "--max-streams-per-key") {
		t.Fatalf("101st of a key: %v", err)
	}
	// Without a key (a public port): the sandbox's and the node's caps.
	for range 50 {
		if err := take("c", ""); err != nil {
			t.Fatal(err)
		}
	}
	if err := take("d", ""); !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "this node has 150") {
		t.Fatalf("past the node's cap: %v", err)
	}
	// Releasing (twice is once) gives the place back.
	held[0]()
	held[0]()
	if err := take("a", "k2"); err != nil {
		t.Fatalf("after a release: %v", err)
	}
	if err := take("a", "k2"); err == nil {
		t.Fatal("a double release counted twice")
	}
	for _, r := range held {
		r()
	}
	if s.n != 0 || len(s.bySandbox) != 0 || len(s.byKey) != 0 {
		t.Fatalf("left: %d %v %v", s.n, s.bySandbox, s.byKey)
	}
	// nil bounds nothing; bad caps are refused.
	var none *Streams
	if r, err := none.Acquire("a", "k", "x"); err != nil {
		t.Fatal(err)
	} else {
		r()
	}
	if _, err := NewStreams(0, 1, 0); err == nil {
		t.Fatal("a zero cap was taken")
	}
}

// The node's cap leaves a reserve of the open files limit.
func TestNodeStreams(t *testing.T) {
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
		t.Fatal(err)
	}
	n := NodeStreams()
	if rl.Cur != unix.RLIM_INFINITY && (int64(n)*streamFDs > int64(rl.Cur)*3/4 && n > 16) {
		t.Fatalf("NodeStreams %d leaves no reserve of %d open files", n, rl.Cur)
	}
}

package node

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// TestResetUnimplemented: a backend that cannot reset a sandbox, or end
// its processes for a file-system-only pause, answers unimplemented,
// naming the alternative, and leaves the sandbox running.
func TestResetUnimplemented(t *testing.T) {
	be := newPauseBackend() // a Pauser, neither a Resetter nor a ProcessEnder
	m, _, ids := newTestManagerWith(t, be, Config{}, "/nonexistent/a")
	recoverManager(t, m)
	id := ids[0]
	ctx := context.Background()
	_, _, err := m.Reset(ctx, id)
	if !errors.Is(err, errdefs.ErrUnimplemented) || !strings.Contains(err.Error(), "create another") {
		t.Fatalf("reset on a backend that cannot: %v, want unimplemented naming the alternative", err)
	}
	_, _, err = m.PauseFSOnly(ctx, id)
	if !errors.Is(err, errdefs.ErrUnimplemented) || !strings.Contains(err.Error(), "pause it with its memory") {
		t.Fatalf("file-system-only pause on a backend that cannot: %v, want unimplemented naming the alternative", err)
	}
	if stopped, pauses, _ := be.state(id); stopped || pauses != 0 {
		t.Fatalf("the backend was paused (%v, %d)", stopped, pauses)
	}
	rec, err := m.Get(id)
	if err != nil || rec.State != StateRunning {
		t.Fatalf("after the refusals: %v %s", err, rec.State)
	}
}

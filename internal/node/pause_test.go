package node

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"go.etcd.io/bbolt"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// pauseBackend is the fake backend plus a Pauser and a Freezer that count
// their calls and track whether the sandbox is stopped. A resume waits for
// gate when it is set.
type pauseBackend struct {
	fakeBackend
	mu              sync.Mutex
	stopped         map[string]bool
	pauses, resumes int
	freezes, thaws  int
	gate            chan struct{}
}

func newPauseBackend() *pauseBackend { return &pauseBackend{stopped: map[string]bool{}} }

func (b *pauseBackend) Pause(ctx context.Context, h sandbox.Handle) (sandbox.PauseStats, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.pauses++
	b.stopped[h.ID] = true
	return sandbox.PauseStats{MemoryBefore: 100 << 20, MemoryAfter: 1 << 20, Method: "fake"}, nil
}

func (b *pauseBackend) Resume(ctx context.Context, h sandbox.Handle) (sandbox.Handle, error) {
	b.mu.Lock()
	gate := b.gate
	b.mu.Unlock()
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
			return h, ctx.Err()
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.resumes++
	b.stopped[h.ID] = false
	h.Data = map[string]string{"resumed": "yes"}
	return h, nil
}

func (b *pauseBackend) Freeze(ctx context.Context, h sandbox.Handle) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.freezes++
	b.stopped[h.ID] = true
	return nil
}

func (b *pauseBackend) Thaw(ctx context.Context, h sandbox.Handle) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.thaws++
	b.stopped[h.ID] = false
	return nil
}

func (b *pauseBackend) state(id string) (stopped bool, pauses, resumes int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.stopped[id], b.pauses, b.resumes
}

func recoverManager(t *testing.T, m *Manager) {
	t.Helper()
	if err := m.Recover(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// TestPauseResume: pause stops the sandbox in its backend and persists
// paused; a second pause changes nothing; resume runs it again and keeps
// the handle the backend returned; a backend without Pauser refuses.
func TestPauseResume(t *testing.T) {
	be := newPauseBackend()
	m, db, ids := newTestManagerWith(t, be, Config{}, "/nonexistent/a")
	recoverManager(t, m)
	id := ids[0]
	ctx := context.Background()

	rec, paused, err := m.Pause(ctx, id)
	if err != nil || !paused || rec.State != StatePaused {
		t.Fatalf("pause: %v paused=%v state=%s", err, paused, rec.State)
	}
	if rec.Pause == nil || rec.Pause.Stats.MemoryAfter != 1<<20 {
		t.Fatalf("pause info not recorded: %+v", rec.Pause)
	}
	if stopped, _, _ := be.state(id); !stopped {
		t.Fatal("backend was not paused")
	}
	stored, _ := loadRecords(db)
	if stored[0].State != StatePaused {
		t.Fatalf("persisted state %s, want paused", stored[0].State)
	}
	if _, paused, err := m.Pause(ctx, id); err != nil || paused {
		t.Fatalf("second pause: %v paused=%v, want a no-op", err, paused)
	}
	if _, pauses, _ := be.state(id); pauses != 1 {
		t.Fatalf("backend paused %d times", pauses)
	}
	if !m.Paused(id) {
		t.Fatal("Paused is false for a paused sandbox")
	}
	if _, err := m.Client(id); err != nil {
		t.Fatalf("Client of a paused sandbox: %v", err)
	}
	if stopped, _, resumes := be.state(id); !stopped || resumes != 0 {
		t.Fatal("Client resumed the sandbox")
	}

	rec, resumed, err := m.Resume(ctx, id)
	if err != nil || !resumed || rec.State != StateRunning {
		t.Fatalf("resume: %v resumed=%v state=%s", err, resumed, rec.State)
	}
	if rec.Handle.Data["resumed"] != "yes" {
		t.Fatalf("handle after resume: %+v", rec.Handle.Data)
	}
	if rec.Pause.ResumedAt.IsZero() {
		t.Fatal("resume time not recorded")
	}
	stored, _ = loadRecords(db)
	if stored[0].State != StateRunning || stored[0].Handle.Data["resumed"] != "yes" {
		t.Fatalf("persisted after resume: %s %v", stored[0].State, stored[0].Handle.Data)
	}
	if _, resumed, err := m.Resume(ctx, id); err != nil || resumed {
		t.Fatalf("resume of a running sandbox: %v resumed=%v", err, resumed)
	}

	// The fake backend (no Pauser) refuses.
	m2, _, ids2 := newTestManager(t, "/nonexistent/b")
	recoverManager(t, m2)
	if _, _, err := m2.Pause(ctx, ids2[0]); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("pause on a backend without Pauser: %v, want failed precondition", err)
	}
}

// TestAgentResumesOnce: every caller of Agent on a paused sandbox gets the
// agent after one shared resume, and none gets it before the resume ended.
func TestAgentResumesOnce(t *testing.T) {
	be := newPauseBackend()
	m, _, ids := newTestManagerWith(t, be, Config{}, "/nonexistent/a")
	recoverManager(t, m)
	id := ids[0]
	if _, _, err := m.Pause(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	gate := make(chan struct{})
	be.mu.Lock()
	be.gate = gate
	be.mu.Unlock()
	const n = 16
	errs := make(chan error, n)
	for range n {
		go func() {
			_, err := m.Agent(id)
			if err == nil {
				if stopped, _, _ := be.state(id); stopped {
					err = errors.New("Agent returned while the sandbox was still paused")
				}
			}
			errs <- err
		}()
	}
	// Nobody gets through before the resume ends.
	select {
	case err := <-errs:
		t.Fatalf("Agent returned (%v) before the resume finished", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(gate)
	for range n {
		select {
		case err := <-errs:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("Agent callers still waiting 10 s after the resume")
		}
	}
	if _, _, resumes := be.state(id); resumes != 1 {
		t.Fatalf("%d concurrent callers made %d resumes, want 1", n, resumes)
	}
	if rec, _ := m.Get(id); rec.State != StateRunning {
		t.Fatalf("state %s after a transparent resume", rec.State)
	}
}

// TestRestartKeepsPaused: a node restarted with a paused sandbox keeps it
// paused (re-freezing it in case a resume was cut short), does not resume
// it for recovery, and resumes it on the first request.
func TestRestartKeepsPaused(t *testing.T) {
	be := newPauseBackend()
	m, db, ids := newTestManagerWith(t, be, Config{}, "/nonexistent/a")
	recoverManager(t, m)
	id := ids[0]
	if _, _, err := m.Pause(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	// A resume cut short by the crash: the backend thawed it.
	be.Thaw(context.Background(), sandbox.Handle{ID: id})

	m2, err := New(m.cfg, db, m.layers, []sandbox.Backend{be}, m.log)
	if err != nil {
		t.Fatal(err)
	}
	recoverManager(t, m2)
	rec, err := m2.Get(id)
	if err != nil || rec.State != StatePaused {
		t.Fatalf("after restart: %v state=%s, want paused", err, rec.State)
	}
	if stopped, _, resumes := be.state(id); !stopped || resumes != 0 {
		t.Fatalf("after restart stopped=%v resumes=%d, want stopped and not resumed", stopped, resumes)
	}
	if _, err := m2.Agent(id); err != nil {
		t.Fatal(err)
	}
	if rec, _ := m2.Get(id); rec.State != StateRunning {
		t.Fatalf("state %s after a request", rec.State)
	}
}

// pausedBackend is a pauseBackend whose Recover tells a paused sandbox
// from a running one (as the microvm backend does).
type pausedBackend struct{ *pauseBackend }

func (b pausedBackend) Recover(ctx context.Context, h sandbox.Handle) (sandbox.Status, error) {
	if stopped, _, _ := b.state(h.ID); stopped {
		return sandbox.StatusPaused, nil
	}
	return sandbox.StatusRunning, nil
}

// TestRestartFindsPaused: a node that died after its backend paused a
// sandbox and before it recorded the pause finds it paused at the restart
// (StatusPaused), records that, and resumes it on the next request.
func TestRestartFindsPaused(t *testing.T) {
	be := pausedBackend{newPauseBackend()}
	m, db, ids := newTestManagerWith(t, be, Config{}, "/nonexistent/a")
	recoverManager(t, m)
	id := ids[0]
	rec, _ := m.Get(id)
	if _, err := be.Pause(context.Background(), rec.Handle); err != nil { // not through the node
		t.Fatal(err)
	}
	m2, err := New(m.cfg, db, m.layers, []sandbox.Backend{be}, m.log)
	if err != nil {
		t.Fatal(err)
	}
	recoverManager(t, m2)
	if rec, err := m2.Get(id); err != nil || rec.State != StatePaused || rec.Pause == nil {
		t.Fatalf("after restart: %v state=%s pause=%v, want paused", err, rec.State, rec.Pause)
	}
	// Persisted: a third node sees it paused too.
	m3, err := New(m.cfg, db, m.layers, []sandbox.Backend{be}, m.log)
	if err != nil {
		t.Fatal(err)
	}
	recoverManager(t, m3)
	if rec, _ := m3.Get(id); rec.State != StatePaused {
		t.Fatalf("after a second restart: state=%s, want paused", rec.State)
	}
	if _, err := m3.Agent(id); err != nil {
		t.Fatal(err)
	}
	if stopped, _, resumes := be.state(id); stopped || resumes != 1 {
		t.Fatalf("after a request stopped=%v resumes=%d, want resumed once", stopped, resumes)
	}
	if rec, _ := m3.Get(id); rec.State != StateRunning {
		t.Fatalf("state %s after a request", rec.State)
	}
}

// TestAutoPause: Run pauses a sandbox idle for its auto-pause time, not
// one that runs a command, and a paused sandbox's idle timeout does not
// delete it.
func TestAutoPause(t *testing.T) {
	be := newPauseBackend()
	m, db, ids := newTestManagerWith(t, be, Config{}, "/nonexistent/a", "/nonexistent/b")
	// Both sandboxes: auto-pause 1 s; an idle timeout far enough that
	// a slow recovery does not see them expired.
	for _, id := range ids {
		recs, _ := loadRecords(db)
		for _, r := range recs {
			if r.ID == id {
				r.AutoPause, r.Timeout, r.Expires = time.Second, time.Minute, time.Now().Add(time.Minute)
				db.Update(func(tx *bbolt.Tx) error { return putRecord(tx, r) })
			}
		}
	}
	recoverManager(t, m)
	m.mu.Lock()
	for _, e := range m.sandboxes {
		e.recovered = false // no agent to ping behind the fake sockets
	}
	m.mu.Unlock()
	release, err := m.Hold(ids[1]) // a command runs in the second
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	// The first's idle timeout: 5 s from now, to be passed while paused.
	rec, err := m.SetTimeout(ids[0], 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go m.Run(ctx)
	waitState(t, m, ids[0], StatePaused, 20*time.Second)
	if rec, _ := m.Get(ids[0]); !rec.Pause.Auto {
		t.Fatal("pause not marked auto")
	}
	// Past its idle timeout, paused, it is still there.
	for time.Now().Before(rec.Expires.Add(2 * time.Second)) {
		if _, err := m.Get(ids[0]); err != nil {
			t.Fatalf("paused sandbox deleted by its idle timeout: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if rec, _ := m.Get(ids[1]); rec.State != StateRunning {
		t.Fatalf("sandbox with a running command is %s, want running", rec.State)
	}
}

// inPlaceBackend is a pauseBackend whose Resume keeps the handle (a
// container thawed, a VM continued in place).
type inPlaceBackend struct{ *pauseBackend }

func (b inPlaceBackend) Resume(ctx context.Context, h sandbox.Handle) (sandbox.Handle, error) {
	if _, err := b.pauseBackend.Resume(ctx, h); err != nil {
		return h, err
	}
	return h, nil
}

// TestResumeInPlacePersistedByFlush: a resume that keeps the handle is not
// persisted on the request's way (one store commit less before the first
// command) but by the next flush; a node that dies before that finds the
// sandbox paused in its store and pauses it again where it is, and the
// next request resumes it. A resume with a new handle is persisted at once
// (TestPauseResume).
func TestResumeInPlacePersistedByFlush(t *testing.T) {
	be := inPlaceBackend{newPauseBackend()}
	m, db, ids := newTestManagerWith(t, be, Config{}, "/nonexistent/a", "/nonexistent/b")
	recoverManager(t, m)
	ctx := context.Background()
	for _, id := range ids {
		if _, _, err := m.Pause(ctx, id); err != nil {
			t.Fatal(err)
		}
		if _, resumed, err := m.Resume(ctx, id); err != nil || !resumed {
			t.Fatalf("resume: %v %v", err, resumed)
		}
	}
	state := func(id string) State {
		t.Helper()
		r, ok := stored(t, db, id) // reap_test.go
		if !ok {
			t.Fatalf("no record of %s", id)
		}
		return r.State
	}
	for _, id := range ids {
		if got := state(id); got != StatePaused {
			t.Fatalf("stored %s right after the resume, want paused (not yet flushed)", got)
		}
	}
	// The first sandbox's resume is flushed; the node dies before the
	// second one's is.
	m.mu.Lock()
	m.sandboxes[ids[1]].dirty = false
	m.mu.Unlock()
	m.flush()
	if got := state(ids[0]); got != StateRunning {
		t.Fatalf("stored %s after a flush, want running", got)
	}
	m2, err := New(m.cfg, db, m.layers, []sandbox.Backend{be}, m.log)
	if err != nil {
		t.Fatal(err)
	}
	recoverManager(t, m2)
	if rec, _ := m2.Get(ids[0]); rec.State != StateRunning {
		t.Fatalf("flushed sandbox after restart: %s, want running", rec.State)
	}
	rec, _ := m2.Get(ids[1])
	if stopped, _, _ := be.state(ids[1]); rec.State != StatePaused || !stopped {
		t.Fatalf("unflushed sandbox after restart: %s stopped=%v, want paused and stopped again", rec.State, stopped)
	}
	if _, err := m2.Agent(ids[1]); err != nil {
		t.Fatal(err)
	}
	if stopped, _, _ := be.state(ids[1]); stopped {
		t.Fatal("not resumed by a request after the restart")
	}
}

package node

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"go.etcd.io/bbolt"

	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// freezingBackend is fakeBackend that can freeze, and whose Delete records
// what it tore down, waits for the gate of its ID if there is one, and
// fails while fail is set.
type freezingBackend struct {
	fakeBackend
	mu      sync.Mutex
	frozen  map[string]bool
	deleted []string
	gate    map[string]chan struct{} // a Delete of that ID waits for the channel
	fail    error
}

func newFreezingBackend() *freezingBackend {
	return &freezingBackend{frozen: map[string]bool{}, gate: map[string]chan struct{}{}}
}

func (b *freezingBackend) Freeze(_ context.Context, h sandbox.Handle) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.frozen[h.ID] = true
	return nil
}

func (b *freezingBackend) Thaw(_ context.Context, h sandbox.Handle) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.frozen, h.ID)
	return nil
}

func (b *freezingBackend) Delete(ctx context.Context, h sandbox.Handle) error {
	b.mu.Lock()
	g, fail := b.gate[h.ID], b.fail
	b.mu.Unlock()
	if g != nil {
		select {
		case <-g:
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Second): // a broken test fails, not hangs
			return errors.New("test gate never opened")
		}
	}
	if fail != nil {
		return fail
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.deleted = append(b.deleted, h.ID)
	return nil
}

func (b *freezingBackend) isDeleted(id string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, d := range b.deleted {
		if d == id {
			return true
		}
	}
	return false
}

func (b *freezingBackend) isFrozen(id string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.frozen[id]
}

// runManager recovers m and runs it until the test ends (or stop).
func runManager(t *testing.T, m *Manager) (stop func()) {
	t.Helper()
	recoverManager(t, m)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { m.Run(ctx); close(done) }()
	// Deletes park their sandboxes once Run has started the reaper (before,
	// they tear down first).
	if m.cfg.DeleteBacklog > 0 {
		waitUntil(t, "the reaper on", 10*time.Second, func() bool {
			m.reap.mu.Lock()
			defer m.reap.mu.Unlock()
			return m.reap.on
		})
	}
	stop = func() { cancel(); <-done }
	t.Cleanup(stop)
	return stop
}

func stored(t *testing.T, db *bbolt.DB, id string) (Record, bool) {
	t.Helper()
	recs, err := loadRecords(db)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range recs {
		if r.ID == id {
			return *r, true
		}
	}
	return Record{}, false
}

func waitUntil(t *testing.T, what string, within time.Duration, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("not %s after %s", what, within)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestDeleteDefersTeardown: a delete answers with the sandbox frozen,
// recorded as deleting and gone from the listings, before its teardown;
// the reaper tears it down once no create is in flight, and forgets it.
func TestDeleteDefersTeardown(t *testing.T) {
	be := newFreezingBackend()
	m, db, ids := newTestManagerWith(t, be, Config{}, "a", "b")
	id := ids[0]
	gate := make(chan struct{})
	be.gate[id] = gate
	runManager(t, m)

	done := make(chan error, 1)
	go func() { done <- m.Delete(context.Background(), id) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the delete waited for the teardown")
	}
	if !be.isFrozen(id) {
		t.Fatal("the delete answered before the sandbox was frozen")
	}
	if _, err := m.Get(id); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get after delete: %v, want not found", err)
	}
	for _, r := range m.List() {
		if r.ID == id {
			t.Fatal("a deleted sandbox is listed")
		}
	}
	if rec, ok := stored(t, db, id); !ok || rec.State != StateDeleting {
		t.Fatalf("stored %v %v, want deleting until the teardown", rec.State, ok)
	}
	if n := m.StateCounts()[[2]string{"fake", string(StateDeleting)}]; n != 1 {
		t.Fatalf("%d sandboxes counted as deleting, want 1", n)
	}
	close(gate)
	// The reaper takes it off its queue once the teardown returned.
	waitUntil(t, "torn down and no longer counted as deleting", 10*time.Second, func() bool {
		_, ok := stored(t, db, id)
		return be.isDeleted(id) && !ok && m.StateCounts()[[2]string{"fake", string(StateDeleting)}] == 0
	})
	if _, err := m.Get(ids[1]); err != nil {
		t.Fatal(err)
	}
}

// TestReaperYieldsToCreates: while a create is in flight, or one began
// less than reapYield ago, the backlog waits (unless half full).
func TestReaperYieldsToCreates(t *testing.T) {
	old := reapYield
	reapYield = 300 * time.Millisecond
	t.Cleanup(func() { reapYield = old })
	be := newFreezingBackend()
	m, _, ids := newTestManagerWith(t, be, Config{}, "a")
	runManager(t, m)
	m.mu.Lock()
	m.admitting["creating"] = admission{}
	m.mu.Unlock()
	if err := m.Delete(context.Background(), ids[0]); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * reapYield)
	if be.isDeleted(ids[0]) {
		t.Fatal("torn down while a create was in flight")
	}
	m.lastCreate.Store(time.Now().UnixNano())
	m.mu.Lock()
	delete(m.admitting, "creating")
	m.mu.Unlock()
	waitUntil(t, "torn down after the creates", 10*time.Second, func() bool { return be.isDeleted(ids[0]) })
}

// TestDeleteBacklogBound: past Config.DeleteBacklog parked sandboxes (or
// half of it once creates keep coming), a delete tears down before it
// answers.
func TestDeleteBacklogBound(t *testing.T) {
	be := newFreezingBackend()
	m, _, ids := newTestManagerWith(t, be, Config{DeleteBacklog: 1}, "a", "b")
	gate := make(chan struct{})
	be.gate[ids[0]] = gate
	runManager(t, m)
	if err := m.Delete(context.Background(), ids[0]); err != nil {
		t.Fatal(err)
	}
	// The first waits in its teardown (gate): the backlog is full.
	if err := m.Delete(context.Background(), ids[1]); err != nil {
		t.Fatal(err)
	}
	if !be.isDeleted(ids[1]) || be.isFrozen(ids[1]) {
		t.Fatal("a delete past the backlog answered before its teardown")
	}
	close(gate)
	waitUntil(t, "the first torn down", 10*time.Second, func() bool { return be.isDeleted(ids[0]) })
}

// TestDeleteWithoutBacklog: DeleteBacklog < 0, a backend that cannot
// freeze, or no Run: the teardown is done before the delete answers.
func TestDeleteWithoutBacklog(t *testing.T) {
	t.Run("off", func(t *testing.T) {
		be := newFreezingBackend()
		m, _, ids := newTestManagerWith(t, be, Config{DeleteBacklog: -1}, "a")
		runManager(t, m)
		if err := m.Delete(context.Background(), ids[0]); err != nil {
			t.Fatal(err)
		}
		if !be.isDeleted(ids[0]) {
			t.Fatal("not torn down")
		}
	})
	t.Run("no freezer", func(t *testing.T) {
		m, db, ids := newTestManagerWith(t, fakeBackend{}, Config{}, "a")
		runManager(t, m)
		if err := m.Delete(context.Background(), ids[0]); err != nil {
			t.Fatal(err)
		}
		if _, ok := stored(t, db, ids[0]); ok {
			t.Fatal("still stored after the delete answered")
		}
	})
	t.Run("no run", func(t *testing.T) {
		be := newFreezingBackend()
		m, _, ids := newTestManagerWith(t, be, Config{}, "a")
		recoverManager(t, m)
		if err := m.Delete(context.Background(), ids[0]); err != nil {
			t.Fatal(err)
		}
		if !be.isDeleted(ids[0]) {
			t.Fatal("not torn down")
		}
	})
}

// TestReapFailureListedAgain: a teardown that keeps failing puts the
// sandbox back, in error, saying why; a later delete tears it down.
func TestReapFailureListedAgain(t *testing.T) {
	oldA, oldR := reapAttempts, reapRetry
	reapAttempts, reapRetry = 2, 10*time.Millisecond
	t.Cleanup(func() { reapAttempts, reapRetry = oldA, oldR })
	be := newFreezingBackend()
	be.fail = errors.New("umount: device busy")
	m, db, ids := newTestManagerWith(t, be, Config{}, "a")
	runManager(t, m)
	if err := m.Delete(context.Background(), ids[0]); err != nil {
		t.Fatal(err)
	}
	var rec Record
	waitUntil(t, "listed again", 10*time.Second, func() bool {
		var err error
		rec, err = m.Get(ids[0])
		return err == nil
	})
	if rec.State != StateError || !strings.Contains(rec.Error, "device busy") {
		t.Fatalf("listed again as %s (%q), want error saying why", rec.State, rec.Error)
	}
	if st, _ := stored(t, db, ids[0]); st.State != StateError {
		t.Fatalf("stored as %s, want error", st.State)
	}
	be.mu.Lock()
	be.fail = nil
	be.mu.Unlock()
	if err := m.Delete(context.Background(), ids[0]); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "torn down", 10*time.Second, func() bool { return be.isDeleted(ids[0]) })
}

// TestBacklogTornDownAfterRestart: a node that stops with parked sandboxes
// tears them down at its next start (the store says deleting).
func TestBacklogTornDownAfterRestart(t *testing.T) {
	be := newFreezingBackend()
	m, db, ids := newTestManagerWith(t, be, Config{}, "a")
	gate := make(chan struct{})
	be.gate[ids[0]] = gate
	stop := runManager(t, m)
	if err := m.Delete(context.Background(), ids[0]); err != nil {
		t.Fatal(err)
	}
	stop() // the teardown in flight ends with the node (its ctx)
	close(gate)
	if rec, ok := stored(t, db, ids[0]); ok && rec.State != StateDeleting {
		t.Fatalf("stored as %s, want deleting", rec.State)
	}
	m2, err := New(m.cfg, db, m.layers, []sandbox.Backend{be}, m.log)
	if err != nil {
		t.Fatal(err)
	}
	if err := m2.Recover(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, ok := stored(t, db, ids[0]); ok || !be.isDeleted(ids[0]) {
		t.Fatal("the backlog was not torn down at the next start")
	}
	if _, err := m2.Get(ids[0]); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get: %v, want not found", err)
	}
}

// TestFlushDeletes: a layer rm or gc first tears the backlog down (and
// waits for the teardown in flight), so that the layers a deleted
// sandbox held are free for it.
func TestFlushDeletes(t *testing.T) {
	old := reapYield
	reapYield = time.Hour
	t.Cleanup(func() { reapYield = old })
	be := newFreezingBackend()
	m, db, ids := newTestManagerWith(t, be, Config{}, "a", "b")
	runManager(t, m)
	m.lastCreate.Store(time.Now().UnixNano()) // the reaper waits an hour
	for _, id := range ids {
		if err := m.Delete(context.Background(), id); err != nil {
			t.Fatal(err)
		}
	}
	if be.isDeleted(ids[0]) || be.isDeleted(ids[1]) {
		t.Fatal("torn down while the reaper waits")
	}
	if _, err := m.GCLayers(true); err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		if _, ok := stored(t, db, id); ok || !be.isDeleted(id) {
			t.Fatalf("%s not torn down by a layer gc", id)
		}
	}
	if n := len(m.reapBacklog()); n != 0 {
		t.Fatalf("backlog of %d after a flush", n)
	}
}

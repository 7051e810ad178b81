package node

import (
	"context"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// TestMemoryPressure: with the host's available memory below the
// threshold, the node pauses idle sandboxes longest idle first and stops
// once memory is back above the threshold plus a quarter; it leaves alone
// sandboxes idle less than MinIdle or running a command, and does nothing
// while memory is above the threshold or the threshold is 0.
func TestMemoryPressure(t *testing.T) {
	be := newPauseBackend()
	var pauses atomic.Int64
	// Each pause gives back 200 of the 1000 below which the node reclaims
	// (it stops at 1250): 900 → 1100 → 1300, so two pauses.
	avail := func() (int64, error) { return 900 + 200*pauses.Load(), nil }
	m, _, ids := newTestManagerWith(t, be, Config{Pressure: Pressure{Below: 1000, MinIdle: time.Minute, Available: avail}},
		"/nonexistent/a", "/nonexistent/b", "/nonexistent/c", "/nonexistent/d", "/nonexistent/e")
	recoverManager(t, m)
	now := time.Now()
	idle := map[string]time.Duration{ids[0]: 10 * time.Minute, ids[1]: 30 * time.Minute, ids[2]: 20 * time.Minute,
		ids[3]: 10 * time.Second /* not idle long enough */, ids[4]: time.Hour /* runs a command */}
	m.mu.Lock()
	for id, d := range idle {
		m.sandboxes[id].lastActive = now.Add(-d)
	}
	m.sandboxes[ids[4]].running = 1
	m.mu.Unlock()
	if got := m.longestIdle(now, time.Minute); len(got) != 3 || got[0] != ids[1] || got[1] != ids[2] || got[2] != ids[0] {
		t.Fatalf("candidates %v, want %v", got, []string{ids[1], ids[2], ids[0]})
	}
	// Count the backend's pauses as memory given back.
	m.cfg.Pressure.Available = func() (int64, error) {
		_, n, _ := be.state("")
		pauses.Store(int64(n))
		return avail()
	}
	if n := m.relievePressure(context.Background()); n != 2 {
		t.Fatalf("paused %d sandboxes, want 2", n)
	}
	for i, want := range []bool{false, true, true, false, false} {
		if stopped, _, _ := be.state(ids[i]); stopped != want {
			t.Errorf("sandbox %d (idle %s): paused %v, want %v", i, idle[ids[i]], stopped, want)
		}
	}
	for _, i := range []int{1, 2} {
		if rec, _ := m.Get(ids[i]); rec.State != StatePaused || rec.Pause == nil || !rec.Pause.Auto {
			t.Errorf("sandbox %d: %s %+v, want paused automatically", i, rec.State, rec.Pause)
		}
	}
	// Memory back above the threshold: checkPressure starts nothing.
	m.checkPressure()
	if m.reclaiming.Load() {
		t.Fatal("a reclaim round started with memory above the threshold")
	}
	// Off: nothing, however low memory is.
	pauses.Store(-100)
	m.cfg.Pressure.Available = avail
	m.cfg.Pressure.Below = 0
	m.checkPressure()
	if _, n, _ := be.state(""); n != 2 || m.reclaiming.Load() {
		t.Fatalf("pressure reclaim off: %d pauses, round running %v", n, m.reclaiming.Load())
	}
	// On again, from Run's tick: the last idle candidate is paused.
	m.cfg.Pressure.Below = 1000
	m.checkPressure()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if stopped, _, _ := be.state(ids[0]); stopped && !m.reclaiming.Load() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("checkPressure did not pause the last idle sandbox within 10 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if stopped, _, _ := be.state(ids[3]); stopped {
		t.Fatal("a sandbox idle less than MinIdle was paused")
	}
}

// TestMemoryStall: with MemAvailable fine but tasks stalling on memory
// (PSI "some avg10" at or above Pressure.PSI), a round pauses at most
// psiBatch idle sandboxes, the longest idle first, and the next round
// waits psiCooldown; below the threshold, or with PSI 0, nothing.
func TestMemoryStall(t *testing.T) {
	be := newPauseBackend()
	var stall atomic.Int64 // percent
	plenty := func() (int64, error) { return 1 << 40, nil }
	paths := make([]string, psiBatch+2)
	for i := range paths {
		paths[i] = "/nonexistent/" + string(rune('a'+i))
	}
	m, _, ids := newTestManagerWith(t, be, Config{Pressure: Pressure{Below: 1000, PSI: 20, MinIdle: time.Minute, Available: plenty,
		Stall: func() (float64, error) { return float64(stall.Load()), nil }}}, paths...)
	recoverManager(t, m)
	now := time.Now()
	m.mu.Lock()
	for i, id := range ids {
		m.sandboxes[id].lastActive = now.Add(-time.Duration(i+1) * time.Hour) // the last the longest idle
	}
	m.mu.Unlock()
	wait := func() {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for m.reclaiming.Load() {
			if time.Now().After(deadline) {
				t.Fatal("a reclaim round did not end within 10 s")
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	stall.Store(5) // below the threshold
	m.checkPressure()
	wait()
	if _, n, _ := be.state(""); n != 0 {
		t.Fatalf("%d pauses with memory stalls below the threshold", n)
	}
	stall.Store(35)
	m.checkPressure()
	wait()
	if _, n, _ := be.state(""); n != psiBatch {
		t.Fatalf("%d pauses in a stall round, want %d", n, psiBatch)
	}
	for i, id := range ids {
		want := i >= len(ids)-psiBatch // the longest idle
		if stopped, _, _ := be.state(id); stopped != want {
			t.Errorf("sandbox %d: paused %v, want %v", i, stopped, want)
		}
	}
	// Within the cooldown: no new round, however high the stall.
	m.checkPressure()
	wait()
	if _, n, _ := be.state(""); n != psiBatch {
		t.Fatalf("%d pauses: a second round within the cooldown", n)
	}
	// After it: the next round.
	m.lastStallRound.Store(time.Now().Add(-psiCooldown).UnixNano())
	m.checkPressure()
	wait()
	if _, n, _ := be.state(""); n != len(ids) {
		t.Fatalf("%d pauses after the cooldown, want %d", n, len(ids))
	}
}

// The stall share is "some avg10" of /proc/pressure/memory, where the
// kernel has PSI.
func TestMemoryStallReads(t *testing.T) {
	if _, err := os.Stat("/proc/pressure/memory"); err != nil {
		t.Skip("no PSI on this kernel")
	}
	v, err := memoryStall()
	if err != nil || v < 0 || v > 100 {
		t.Fatalf("memory stall %v %v", v, err)
	}
}

// evictBackend is a pauseBackend that can evict a paused sandbox's
// memory (as the microvm backend does for a VM paused in place).
type evictBackend struct {
	*pauseBackend
	evicts atomic.Int64
}

func (b *evictBackend) Evict(ctx context.Context, h sandbox.Handle) (sandbox.PauseStats, bool, error) {
	b.evicts.Add(1)
	return sandbox.PauseStats{MemoryBefore: 50 << 20, MemoryAfter: 0, Method: "fake snapshot"}, true, nil
}

// TestMemoryPressureEvicts: still short of memory once no idle sandbox is
// left to pause, the node evicts paused sandboxes whose backend can, the
// longest paused first, each once, and stops once memory is back; an
// evicted sandbox stays paused and resumes on its next request.
func TestMemoryPressureEvicts(t *testing.T) {
	be := &evictBackend{pauseBackend: newPauseBackend()}
	m, _, ids := newTestManagerWith(t, be, Config{Pressure: Pressure{Below: 1000, MinIdle: time.Minute}},
		"/nonexistent/a", "/nonexistent/b", "/nonexistent/c")
	recoverManager(t, m)
	for _, id := range []string{ids[1], ids[0], ids[2]} { // paused in this order
		if _, _, err := m.Pause(context.Background(), id); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Millisecond)
	}
	if got := m.longestPaused(); len(got) != 3 || got[0] != ids[1] || got[1] != ids[0] || got[2] != ids[2] {
		t.Fatalf("eviction candidates %v, want %v", got, []string{ids[1], ids[0], ids[2]})
	}
	// Each eviction gives back 200 of 1000: 900 → 1100 → 1300, two.
	m.cfg.Pressure.Available = func() (int64, error) { return 900 + 200*be.evicts.Load(), nil }
	if n := m.relievePressure(context.Background()); n != 2 {
		t.Fatalf("relieved by %d sandboxes, want 2 evicted", n)
	}
	for i, want := range []bool{true, true, false} {
		rec, _ := m.Get(ids[i])
		if rec.State != StatePaused || rec.Pause == nil || rec.Pause.Evicted != want || (want && rec.Pause.Evict == nil) {
			t.Errorf("sandbox %d: %s %+v, want paused, evicted %v", i, rec.State, rec.Pause, want)
		}
	}
	// Short again: only the one left is evicted; none twice.
	m.cfg.Pressure.Available = func() (int64, error) { return 0, nil }
	m.relievePressure(context.Background())
	if n := be.evicts.Load(); n != 3 {
		t.Fatalf("%d evictions after a second round, want 3 (each sandbox once)", n)
	}
	if _, err := m.Agent(ids[1]); err != nil {
		t.Fatal(err)
	}
	if rec, _ := m.Get(ids[1]); rec.State != StateRunning {
		t.Fatalf("an evicted sandbox is %s after a request, want running", rec.State)
	}
}

// A stall round evicts too, up to its batch, the longest paused first.
func TestMemoryStallEvicts(t *testing.T) {
	be := &evictBackend{pauseBackend: newPauseBackend()}
	paths := make([]string, psiBatch+1)
	for i := range paths {
		paths[i] = "/nonexistent/" + string(rune('a'+i))
	}
	m, _, ids := newTestManagerWith(t, be, Config{Pressure: Pressure{PSI: 20, MinIdle: time.Minute}}, paths...)
	recoverManager(t, m)
	for _, id := range ids {
		if _, _, err := m.Pause(context.Background(), id); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Millisecond)
	}
	if n := m.relieveStall(context.Background(), 35); n != psiBatch || be.evicts.Load() != psiBatch {
		t.Fatalf("a stall round relieved %d, evicted %d; want %d", n, be.evicts.Load(), psiBatch)
	}
	if rec, _ := m.Get(ids[len(ids)-1]); rec.Pause == nil || rec.Pause.Evicted {
		t.Errorf("the last paused was evicted first: %+v", rec.Pause)
	}
}

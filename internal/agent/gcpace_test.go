package agent

import (
	"math"
	"os"
	"runtime"
	"runtime/debug"
	"testing"
	"time"
)

// TestPaceGCByGrowth (in a child process: it changes the runtime's
// settings): GOGC is off, the memory limit is set above what the runtime
// holds, and garbage many times that limit is still collected as it
// grows, the limit following the live heap.
func TestPaceGCByGrowth(t *testing.T) {
	if !inChildProcess(t, "SHOAL_TEST_GCPACE") {
		return
	}
	os.Unsetenv("GOGC")
	os.Unsetenv("GOMEMLIMIT")
	PaceGCByGrowth()
	if p := debug.SetGCPercent(-1); p != -1 {
		t.Fatalf("GOGC is %d, want off", p)
	}
	limit := debug.SetMemoryLimit(-1)
	if limit == math.MaxInt64 || limit < minGrowth {
		t.Fatalf("memory limit %d", limit)
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	var keep [][]byte
	var peak uint64
	for i := range 8192 { // 512 MiB of garbage, 64 KiB at a time
		b := make([]byte, 64<<10)
		b[0] = byte(i)
		if i%256 == 0 {
			keep = append(keep, b) // and a live heap that grows to 2 MiB
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			peak = max(peak, ms.HeapAlloc)
		}
	}
	runtime.ReadMemStats(&after)
	gcs := after.NumGC - before.NumGC
	t.Logf("%d collections; heap peak %d KiB; limit %d KiB then %d KiB; live %d chunks",
		gcs, peak>>10, limit>>10, debug.SetMemoryLimit(-1)>>10, len(keep))
	if gcs < 10 {
		t.Errorf("only %d collections over 512 MiB of garbage", gcs)
	}
	// Uncollected, the heap would reach 512 MiB. Collected, it peaks at
	// the limit plus what is allocated while a concurrent collection runs:
	// 5-17 MiB seen, more on a host busy with other tests (the collection
	// and the finalizer that resets the limit wait for a CPU), so the bound
	// leaves room for that and still catches growth with the garbage.
	if peak > 48<<20 {
		t.Errorf("heap grew to %d MiB", peak>>20)
	}
}

// The idle release is skipped when its timer fires long after it was set
// (the agent was frozen: a paused sandbox), and made otherwise.
func TestIdleReleaseSkippedAfterThaw(t *testing.T) {
	s := NewServer(Config{IdleRelease: time.Second})
	s.idleSince.Store(monoNow() - int64(time.Second))
	if s.thawed() {
		t.Fatal("a timer firing on time taken for a thaw")
	}
	s.idleSince.Store(monoNow() - int64(time.Second+thawedLate+time.Second))
	if !s.thawed() {
		t.Fatal("a timer firing long after it was set not taken for a thaw")
	}
}

// The idle release is skipped while the agent allocated little since the
// last one (a resumed sandbox's first command: a release then would read
// its whole swapped-out heap back in to return a few KiB), and made once
// it allocated releaseMinAlloc. In a child process: nothing else allocates
// there meanwhile.
func TestIdleReleaseNeedsAllocation(t *testing.T) {
	if !inChildProcess(t, "SHOAL_TEST_IDLE_RELEASE") {
		return
	}
	s := NewServer(Config{IdleRelease: time.Second})
	allocate := func(n int) {
		for range n / (64 << 10) {
			keep = make([]byte, 64<<10)
		}
	}
	release := func() bool {
		s.idleSince.Store(monoNow() - int64(time.Second)) // on time
		return s.idleRelease()
	}
	allocate(releaseMinAlloc + 64<<10)
	if !release() {
		t.Fatalf("not released after %d bytes allocated", s.allocatedSinceRelease())
	}
	if s.allocatedSinceRelease() >= releaseMinAlloc {
		t.Fatal("the release did not record where it left the heap")
	}
	allocate(64 << 10) // a few commands' worth
	if release() {
		t.Fatal("released after 64 KiB allocated")
	}
	allocate(releaseMinAlloc)
	if !release() {
		t.Fatalf("not released after %d bytes allocated", s.allocatedSinceRelease())
	}
}

var keep []byte

package microvm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/reclaim"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
	"github.com/shoal-sandbox/shoal/internal/zram"
)

// Pause snapshots a VM to a file and ends its QEMU; Resume restores it in
// a new QEMU: its files and its running processes are as they were (a
// counter goes on from where it stopped). A resume from a bad snapshot
// fails, keeps the snapshot and leaves the sandbox paused.
func TestVMPauseResume(t *testing.T) {
	for _, m := range []string{MachineMicroVM, MachineQ35} {
		t.Run(m, func(t *testing.T) {
			t.Parallel()
			testVMPauseResume(t, m)
		})
	}
}

// readCount reads the guest's counter (again while it is empty: the
// counter's shell truncates the file before it writes it).
func readCount(t *testing.T, ctx context.Context, c *agent.Client) int {
	t.Helper()
	for {
		out := strings.TrimSpace(run(t, ctx, c, "cat", "/work/count"))
		if out == "" && ctx.Err() == nil {
			continue
		}
		n, err := strconv.Atoi(out)
		if err != nil {
			t.Fatalf("count %q", out)
		}
		return n
	}
}

// waitCount waits until the guest's counter exceeds n.
func waitCount(t *testing.T, ctx context.Context, c *agent.Client, n int) int {
	t.Helper()
	for {
		if got := readCount(t, ctx, c); got > n {
			return got
		}
		select {
		case <-ctx.Done():
			t.Fatalf("the counter stays at %d", n)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// pausedVM is a VM of a pause test: its latest handle is deleted when the
// test ends.
type pausedVM struct {
	b *Backend
	h sandbox.Handle
}

// bootCountingVM boots a 256 MiB VM of machine (a backend configured by
// opts), writes /work/a.txt in it and starts a counter there
// (/work/count, ten a second); it returns the VM, a client of its agent
// and the counter's value once it counts.
func bootCountingVM(t *testing.T, ctx context.Context, machine, id string, opts ...func(*Config)) (*pausedVM, *agent.Client, int) {
	t.Helper()
	b, img := vmTestEnv(t, machine, opts...)
	sdir, err := os.MkdirTemp("/tmp", "vmp")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(sdir) })
	h, err := b.Create(ctx, sandbox.Spec{ID: id, Dir: sdir,
		Resources: sandbox.Resources{MemoryBytes: 256 << 20, MilliCPU: 1000},
		Layers:    []sandbox.Layer{{Digest: "sha256:x", Kind: "base", ImagePath: img}}})
	if err != nil {
		t.Fatal(err)
	}
	v := &pausedVM{b: b, h: h}
	t.Cleanup(func() { b.Delete(context.Background(), v.h) })
	c := agent.NewClientDialer(h.ID, b.AgentDial(h))
	if _, err := c.WriteFile(ctx, "/work/a.txt", 0o644, strings.NewReader("kept across a pause")); err != nil {
		t.Fatal(err)
	}
	run(t, ctx, c, "sh", "-c", "(i=0; while true; do i=$((i+1)); echo $i > /work/count; sleep 0.1; done) >/dev/null 2>&1 & while [ ! -s /work/count ]; do sleep 0.05; done")
	return v, c, waitCount(t, ctx, c, 2)
}

func testVMPauseResume(t *testing.T, machine string) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	v, c, before := bootCountingVM(t, ctx, machine, "vmpause-"+machine)
	b, h := v.b, v.h
	// SHOAL_VM_PAUSE_ROUNDS=N: N pause/resume rounds, and the median
	// resume→first exec.
	// Two rounds at least: the first pause after the boot finds most of
	// the guest's memory in use; the second, its working set.
	rounds := 2
	if n, err := strconv.Atoi(os.Getenv("SHOAL_VM_PAUSE_ROUNDS")); err == nil && n > 1 && n <= 50 {
		rounds = n
	}
	var firstExec []time.Duration
	old := h
	for round := 1; round <= rounds; round++ {
		old = h
		h = pauseResumeRound(t, ctx, b, h, round == 1, before, &firstExec)
		v.h = h
		c = agent.NewClientDialer(h.ID, b.AgentDial(h))
		before = readCount(t, ctx, c)
	}
	slices.Sort(firstExec)
	t.Logf("resume→first exec over %d rounds: p50 %s, min %s, max %s", rounds, firstExec[len(firstExec)/2], firstExec[0], firstExec[len(firstExec)-1])
	if again, err := b.Resume(ctx, h); err != nil || again.Data["pid"] != h.Data["pid"] {
		t.Errorf("resume of a running VM: %v, %v", again.Data, err)
	}
	// A node that died after a resume, before it persisted the new
	// handle: the old one's QEMU is gone, and so is the snapshot. The VM
	// is still there (Recover), and the next resume adopts its QEMU.
	if s, err := b.Recover(ctx, old); err != nil || s != sandbox.StatusRunning {
		t.Errorf("recover through the handle before the resume: %s, %v", s, err)
	}
	if adopted, err := b.Resume(ctx, old); err != nil || adopted.Data["pid"] != h.Data["pid"] || adopted.Data["pid_start"] != h.Data["pid_start"] {
		t.Errorf("resume through the handle before the resume: %v, %v (want pid %s)", adopted.Data, err, h.Data["pid"])
	}
	// A node that died after a pause's snapshot and before its kill: the
	// guest is stopped and its snapshot is there. Recover continues it.
	if err := qmp(ctx, filepath.Join(h.Data["dir"], "qmp.sock"), "stop", nil, nil); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(h.Data["dir"], stateFile), []byte("snapshot"), 0o600); err != nil {
		t.Fatal(err)
	}
	if s, err := b.Recover(ctx, h); err != nil || s != sandbox.StatusRunning {
		t.Fatalf("recover of a stopped VM with a snapshot: %s, %v", s, err)
	}
	if paused(h) {
		t.Error("recover left the snapshot of a running VM")
	}
	wctx, wcancel := context.WithTimeout(ctx, 30*time.Second) // a stopped guest does not answer
	defer wcancel()
	waitCount(t, wctx, c, readCount(t, wctx, c))
}

// pauseResumeRound pauses h, checks it is paused (and, if bad, that a
// resume from a truncated snapshot fails and keeps it paused, and that the
// guest's clock caught up with the time it was paused), resumes it and
// checks its file and its counter (at least before, and counting);
// it appends the time from the resume's start to the first exec's answer.
func pauseResumeRound(t *testing.T, ctx context.Context, b *Backend, h sandbox.Handle, bad bool, before int, firstExec *[]time.Duration) sandbox.Handle {
	t.Helper()
	sdir := h.Data["dir"]

	stats, err := b.Pause(ctx, h)
	if err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(filepath.Join(sdir, stateFile))
	if err != nil {
		t.Fatalf("no snapshot: %v", err)
	}
	t.Logf("paused: snapshot %d MiB, RSS before %d MiB, stop %s, snapshot+kill %s",
		st.Size()>>20, stats.MemoryBefore>>20, stats.FreezeTook, stats.ReclaimTook)
	if process(h) != 0 {
		t.Fatal("QEMU still runs after pause")
	}
	if ok, _ := b.Alive(h); !ok {
		t.Error("a paused VM is not alive")
	}
	if s, err := b.Recover(ctx, h); err != nil || s != sandbox.StatusPaused {
		t.Errorf("recover of a paused VM: %s, %v (want paused)", s, err)
	}
	if _, err := b.Pause(ctx, h); err != nil {
		t.Errorf("pause of a paused VM: %v", err)
	}

	if bad {
		badSnapshot(t, ctx, b, h)
		// Time passes while it is paused: the guest's clock must catch
		// up after the resume.
		time.Sleep(3 * time.Second)
	}

	start := time.Now()
	nh, err := b.Resume(ctx, h)
	if err != nil {
		t.Fatal(err)
	}
	resumed := time.Since(start)
	if nh.Data["pid"] == h.Data["pid"] || process(nh) == 0 {
		t.Fatalf("resume: handle %v", nh.Data)
	}
	h = nh
	c := agent.NewClientDialer(h.ID, b.AgentDial(h))
	after := readCount(t, ctx, c)
	*firstExec = append(*firstExec, time.Since(start))
	t.Logf("resumed in %s; first exec after %s", resumed, time.Since(start))
	if bad {
		host := time.Now().Unix()
		out := strings.TrimSpace(run(t, ctx, c, "busybox", "date", "+%s"))
		// Whole seconds on both sides, the guest's clock within half a
		// second: at most 2 apart (an unsynced one is 3 s behind or more).
		guest, err := strconv.ParseInt(out, 10, 64)
		if err != nil || guest < host-2 {
			t.Errorf("the guest's clock says %s after the resume, the host's %d", out, host)
		}
		t.Logf("after a pause of 3+ s the guest's clock is %+d s off the host's (whole seconds)", guest-host)
	}
	if after < before {
		t.Errorf("the counter went from %d to %d across the pause", before, after)
	}
	waitCount(t, ctx, c, after)
	if got := readFile(t, ctx, c, "/work/a.txt"); got != "kept across a pause" {
		t.Errorf("file after resume: %q", got)
	}
	if paused(h) {
		t.Error("the snapshot is still there after resume")
	}
	return h
}

// badSnapshot checks that a resume from a truncated snapshot fails and
// keeps the sandbox paused (its snapshot restored afterwards).
func badSnapshot(t *testing.T, ctx context.Context, b *Backend, h sandbox.Handle) {
	t.Helper()
	sdir := h.Data["dir"]
	// A bad snapshot: the resume fails, the snapshot stays.
	good, err := os.ReadFile(filepath.Join(sdir, stateFile))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(sdir, stateFile), good[:len(good)/2], 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Resume(ctx, h); err == nil {
		t.Fatal("resumed from a truncated snapshot")
	} else {
		t.Logf("resume from a truncated snapshot: %v", err)
	}
	if !paused(h) || pidfileProcess(sdir) != 0 {
		t.Fatal("a failed resume did not leave the sandbox paused")
	}
	if err := os.WriteFile(filepath.Join(sdir, stateFile), good, 0o600); err != nil {
		t.Fatal(err)
	}
}

// oldVM is a backend and the handle of a VM in dir created before pause
// existed: it does not say how to start the VM again. This test's
// process stands for its QEMU.
func oldVM(t *testing.T, dir string) (*Backend, sandbox.Handle) {
	t.Helper()
	b := &Backend{cfg: Config{Name: "microvm"}, log: slog.New(slog.DiscardHandler), muxes: map[string]*chanMux{}}
	pid := os.Getpid()
	st, err := startTime(pid)
	if err != nil {
		t.Fatal(err)
	}
	return b, sandbox.Handle{ID: "old", Data: map[string]string{"pid": strconv.Itoa(pid), "pid_start": st, "dir": dir, "accel": "tcg"}}
}

// A VM whose handle does not say how to start it again (created before
// pause existed) is not paused: it could not be resumed.
func TestPauseRefusesAnUnresumableHandle(t *testing.T) {
	b, h := oldVM(t, t.TempDir())
	if _, err := b.Pause(context.Background(), h); !errors.Is(err, sandbox.ErrUnsupported) {
		t.Fatalf("pause of an old VM: %v", err)
	}
	if paused(h) {
		t.Fatal("a snapshot was made")
	}
}

// Paused in place (Config.Pause PauseInPlace), a VM keeps its QEMU,
// stopped, with its memory paged out (to swap, where there is some);
// Resume continues the same QEMU: the guest's files and processes are as
// they were (a counter goes on). Recover says paused while it is (a node
// that died after the pause finds it so), running after; a paused VM can
// be deleted.
func TestVMPauseInPlace(t *testing.T) {
	for _, m := range []string{MachineMicroVM, MachineQ35} {
		t.Run(m, func(t *testing.T) {
			t.Parallel()
			testVMPauseInPlace(t, m)
		})
	}
}

func testVMPauseInPlace(t *testing.T, machine string) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	v, c, before := bootCountingVM(t, ctx, machine, "vmpause-inplace-"+machine, func(c *Config) { c.Pause = PauseInPlace })
	b, h := v.b, v.h
	qmpSock := filepath.Join(h.Data["dir"], "qmp.sock")
	status := func() string {
		var st struct {
			Status string `json:"status"`
		}
		if err := qmp(ctx, qmpSock, "query-status", nil, &st); err != nil {
			t.Fatal(err)
		}
		return st.Status
	}
	// Two rounds at least: the first pause after the boot finds most of
	// the guest's memory in use; the second, its working set.
	rounds := 2
	if n, err := strconv.Atoi(os.Getenv("SHOAL_VM_PAUSE_ROUNDS")); err == nil && n > 1 && n <= 50 {
		rounds = n
	}
	var firstExec []time.Duration
	for round := range rounds {
		zram0 := zram.MemUsed()
		stats, err := b.Pause(ctx, h)
		if err != nil {
			t.Fatal(err)
		}
		ws, _ := workingSet(b, h.ID)
		if round > 0 && swapActive() && ws.Bytes() == 0 {
			t.Errorf("pause in place %d recorded no working set to prefetch", round+1)
		}
		// The translated code the guest ran since its last resume stays
		// in memory; the boot's goes at the first pause.
		if jit := jitRSS(t, process(h)); swapActive() && h.Data["accel"] == "tcg" && (round == 0) != (jit < 1<<20) {
			t.Errorf("pause in place %d: %d KiB of TCG's translation cache in memory", round+1, jit>>10)
		}
		t.Logf("paused in place: %+v; zram's memory +%d MiB", stats, (zram.MemUsed()-zram0)>>20)
		if process(h) == 0 || !stoppedInPlace(h) || status() != "paused" {
			t.Fatalf("after pause: QEMU %d, mark %v, guest %s; want the same QEMU, stopped", process(h), stoppedInPlace(h), status())
		}
		// (The first pause: QEMU's RSS is mostly the guest's memory then;
		// later, its code shared with other QEMUs weighs more.)
		if round == 0 && swapActive() && stats.MemoryAfter > stats.MemoryBefore/2 {
			t.Errorf("paused in place with swap: QEMU's RSS %d MiB -> %d MiB, want it at least halved", stats.MemoryBefore>>20, stats.MemoryAfter>>20)
		}
		if s, err := b.Recover(ctx, h); err != nil || s != sandbox.StatusPaused {
			t.Errorf("recover of a VM paused in place: %s, %v (want paused)", s, err)
		}
		// Stopped, QEMU idles: no CPU while the VM is paused.
		if used := cpuTicks(t, process(h), 2*time.Second); used > 5 {
			t.Errorf("QEMU of a VM paused in place used %d ticks of CPU in 2 s", used)
		}
		if st, err := b.Pause(ctx, h); err != nil || status() != "paused" {
			t.Errorf("pause of a paused VM: %+v, %v", st, err)
		}
		start := time.Now()
		nh, err := b.Resume(ctx, h)
		if err != nil {
			t.Fatal(err)
		}
		if _, kept := workingSet(b, h.ID); kept {
			t.Errorf("the working set of a resumed VM is still kept")
		}
		if nh.Data["pid"] != h.Data["pid"] || stoppedInPlace(nh) || status() != "running" {
			t.Fatalf("after resume: pid %s (was %s), mark %v, guest %s", nh.Data["pid"], h.Data["pid"], stoppedInPlace(nh), status())
		}
		after := readCount(t, ctx, c)
		firstExec = append(firstExec, time.Since(start))
		if after < before {
			t.Errorf("the counter went from %d to %d across the pause", before, after)
		}
		before = waitCount(t, ctx, c, after)
		if s, err := b.Recover(ctx, h); err != nil || s != sandbox.StatusRunning {
			t.Errorf("recover of a resumed VM: %s, %v (want running)", s, err)
		}
	}
	slices.Sort(firstExec)
	t.Logf("resume in place → first exec over %d rounds: p50 %s, min %s, max %s", rounds, firstExec[len(firstExec)/2], firstExec[0], firstExec[len(firstExec)-1])
	if got := readFile(t, ctx, c, "/work/a.txt"); got != "kept across a pause" {
		t.Errorf("file after resume: %q", got)
	}
	// Evicted (memory pressure): a snapshot, QEMU ended; the next
	// resume restores it in a new QEMU.
	if _, err := b.Pause(ctx, h); err != nil {
		t.Fatal(err)
	}
	qemu := process(h)
	stats, evicted, err := b.Evict(ctx, h)
	if err != nil || !evicted {
		t.Fatalf("evict a VM paused in place: %v, evicted %v", err, evicted)
	}
	t.Logf("evicted: %+v", stats)
	if _, kept := workingSet(b, h.ID); kept {
		t.Errorf("the working set of an evicted VM's ended QEMU is still kept")
	}
	if !ended(qemu) || stoppedInPlace(h) || !paused(h) {
		t.Fatalf("after evict: QEMU %d ended %v, mark %v, snapshot %v; want a snapshot and no QEMU", qemu, ended(qemu), stoppedInPlace(h), paused(h))
	}
	if s, err := b.Recover(ctx, h); err != nil || s != sandbox.StatusPaused {
		t.Errorf("recover of an evicted VM: %s, %v (want paused)", s, err)
	}
	if _, again, err := b.Evict(ctx, h); err != nil || again {
		t.Errorf("evict of an evicted VM: %v, evicted %v (want nothing to do)", err, again)
	}
	if h, err = b.Resume(ctx, h); err != nil {
		t.Fatal(err)
	}
	v.h = h
	c = agent.NewClientDialer(h.ID, b.AgentDial(h))
	after := readCount(t, ctx, c)
	if after < before {
		t.Errorf("the counter went from %d to %d across the eviction", before, after)
	}
	waitCount(t, ctx, c, after)
	// Deleted while paused: its QEMU ends.
	if _, err := b.Pause(ctx, h); err != nil {
		t.Fatal(err)
	}
	pid := process(h)
	if err := b.Delete(ctx, h); err != nil {
		t.Fatal(err)
	}
	if !ended(pid) {
		t.Errorf("QEMU %d still runs after the delete of its paused VM", pid)
	}
}

// cpuTicks is the CPU (clock ticks, user and system) process pid uses
// over d.
func cpuTicks(t *testing.T, pid int, d time.Duration) int64 {
	t.Helper()
	read := func() int64 {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			t.Fatal(err)
		}
		f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+2:])) // from the state on
		u, _ := strconv.ParseInt(f[11], 10, 64)
		s, _ := strconv.ParseInt(f[12], 10, 64)
		return u + s
	}
	before := read()
	time.Sleep(d)
	return read() - before
}

// workingSet is the working set b keeps for sandbox id, if any.
func workingSet(b *Backend, id string) (reclaim.WorkingSet, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	ws, ok := b.working[id]
	return ws, ok
}

// jitRSS is the resident memory of pid's anonymous executable mappings
// (QEMU's TCG translation cache).
func jitRSS(t *testing.T, pid int) int64 {
	t.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	jit := false
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		switch {
		case len(f) >= 5 && strings.Contains(f[0], "-") && len(f[1]) == 4:
			jit = len(f) == 5 && f[1][2] == 'x' && f[1][3] == 'p'
		case jit && len(f) == 3 && f[0] == "Rss:":
			kib, _ := strconv.ParseInt(f[1], 10, 64)
			n += kib << 10
		}
	}
	return n
}

// swapActive tells whether the host has swap (a pause in place pages out
// to it; without, only QEMU's clean file pages go).
func swapActive() bool {
	data, err := os.ReadFile("/proc/swaps")
	return err == nil && len(strings.Split(strings.TrimSpace(string(data)), "\n")) > 1
}

// A VM paused in place whose handle does not say how to start it again
// is not evicted: its snapshot could not be resumed.
func TestEvictKeepsAnUnresumableVM(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, stoppedFile), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	b, h := oldVM(t, dir)
	if _, evicted, err := b.Evict(context.Background(), h); err != nil || evicted {
		t.Fatalf("evict of an old VM paused in place: evicted %v, %v", evicted, err)
	}
	if paused(h) || !stoppedInPlace(h) {
		t.Fatal("a snapshot was made, or the mark went")
	}
	// Not paused in place: nothing to evict either.
	os.Remove(filepath.Join(dir, stoppedFile))
	if _, evicted, err := b.Evict(context.Background(), h); err != nil || evicted {
		t.Fatalf("evict of a running VM: evicted %v, %v", evicted, err)
	}
}

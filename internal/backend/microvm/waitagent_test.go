package microvm

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// cpuTime is the CPU time this process has used.
func cpuTime(t *testing.T) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestWaitAgentDoesNotSpin: while QEMU has not opened the agent channel yet
// (a boot's first ~100 ms, a restore's), every dial fails at once; the wait
// retries every 20 ms instead of spinning on a CPU the booting guest needs
// (it did: the check ran after its context was cancelled, and took every
// fast failure for a timeout).
//
// It runs alone in a child process: the CPU it counts is the process's,
// and an earlier test's background work (a template being made) had
// counted in it.
func TestWaitAgentDoesNotSpin(t *testing.T) {
	if os.Getenv("SHOAL_TEST_WAITAGENT_CHILD") != "1" {
		cmd := exec.Command(os.Args[0], "-test.run=^TestWaitAgentDoesNotSpin$", "-test.v")
		cmd.Env = append(os.Environ(), "SHOAL_TEST_WAITAGENT_CHILD=1")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		return
	}
	dir := t.TempDir()
	for _, f := range []string{agentPipe + ".in", agentPipe + ".out"} {
		if err := unix.Mkfifo(filepath.Join(dir, f), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	b := &Backend{muxes: map[string]*chanMux{}}
	h := sandbox.Handle{ID: "vmspin", Data: map[string]string{"dir": dir}}
	const wait = 500 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	cpu0 := cpuTime(t)
	if err := b.waitAgent(ctx, h, nil); err == nil {
		t.Fatal("an agent answered on a channel no QEMU holds")
	}
	// Spinning costs about the whole wait in CPU; 25 dials cost ~1 ms.
	if used := cpuTime(t) - cpu0; used > wait/4 {
		t.Errorf("waiting %s for a channel QEMU has not opened used %s of CPU", wait, used)
	}
}

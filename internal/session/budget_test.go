package session

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// TestLogBudget is the scenario scaled down: a sandbox whose log
// budget is 1 MiB runs 6 trajectory steps (never pruned by the retention
// policy) that print 1.5 MiB each. Its logs on the host stay within the
// budget, its oldest output went first, a read of pruned output answers
// ErrLogPruned naming the first offset kept, from which the read works;
// the newest output is whole; another sandbox's logs are untouched.
func TestLogBudget(t *testing.T) {
	e := newEnv(t)
	m := e.manager(Config{LogBudget: MinLogBudget})
	e.sb.add("sb1")
	e.sb.add("sb2")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	start := func(sandboxID string, step int64, n int) *Command {
		t.Helper()
		c, _, err := m.Start(ctx, sandboxID, StartRequest{
			Args:       []string{"sh", "-c", fmt.Sprintf("head -c %d /dev/zero | tr '\\0' x; echo; echo end-%d", n, step)},
			Trajectory: "rollout", Step: step,
		})
		if err != nil {
			t.Fatal(err)
		}
		if info, err := m.Wait(ctx, c); err != nil || info.Exit == nil || info.Exit.Code != 0 {
			t.Fatalf("step %d: %+v %v", step, info.Exit, err)
		}
		return c
	}
	// Read from offset from to the end: stdout, or the error.
	read := func(c *Command, from int64) (string, error) {
		var out []byte
		err := m.Events(ctx, c, from, 0, func(ev Event) error {
			if ev.Kind == EventStdout {
				out = append(out, ev.Data...)
			}
			return nil
		})
		return string(out), err
	}
	other := start("sb2", 1, 512<<10)
	var cs []*Command
	for i := range 6 {
		cs = append(cs, start("sb1", int64(i+1), 3<<19))
	}

	// The host holds at most the budget of sb1's output (give or take a
	// mark's worth and the file systems' blocks).
	var held int64
	ents, err := os.ReadDir(filepath.Join(e.sb.dir, "sb1", "logs"))
	if err != nil {
		t.Fatal(err)
	}
	for _, ent := range ents {
		fi, err := ent.Info()
		if err != nil {
			t.Fatal(err)
		}
		held += fi.Sys().(*syscall.Stat_t).Blocks * 512
	}
	if held > MinLogBudget+markEvery+64<<10 {
		t.Errorf("sb1's logs take %d bytes on the host, budget %d", held, MinLogBudget)
	}
	m.logMu.Lock()
	used := m.logUsed["sb1"]
	m.logMu.Unlock()
	if used > MinLogBudget {
		t.Errorf("sb1's logs count %d bytes, budget %d", used, MinLogBudget)
	}

	// The oldest step's output is gone, all of it: a read from 0 says so
	// and where to go on; from there, its exit.
	first := cs[0]
	size := first.Info().LogBytes
	_, err = read(first, 0)
	if !errors.Is(err, errdefs.ErrLogPruned) || errdefs.Code(err) != "out_of_range" || !strings.Contains(err.Error(), fmt.Sprintf("re-attach from offset %d", size)) {
		t.Fatalf("read of the first step from 0: %v, want log pruned up to %d", err, size)
	}
	if out, err := read(first, size); err != nil || out != "" {
		t.Fatalf("read of the first step from %d: %q %v", size, out, err)
	}
	// Its record and exit status stay (a replayed step gets them back).
	if info := first.Info(); info.Exit == nil || info.Exit.Code != 0 {
		t.Errorf("first step after pruning: %+v", info)
	}

	// The newest step: its head went (it alone prints more than the
	// budget), its tail is whole from the offset the error names.
	last := cs[len(cs)-1]
	last.mu.Lock()
	kept := last.pruned
	last.mu.Unlock()
	if kept == 0 {
		t.Fatal("the newest step, larger than the budget, was not pruned")
	}
	if _, err := read(last, 0); !errors.Is(err, errdefs.ErrLogPruned) {
		t.Fatalf("read of the newest step from 0: %v, want log pruned", err)
	}
	out, err := read(last, kept)
	if err != nil || !strings.HasSuffix(out, "x\nend-6\n") || int64(len(out)) > MinLogBudget {
		t.Fatalf("read of the newest step from %d: %d bytes ending %q, %v", kept, len(out), out[max(len(out)-16, 0):], err)
	}

	// The other sandbox lost nothing.
	if out, err := read(other, 0); err != nil || len(out) != 512<<10+len("\nend-1\n") {
		t.Fatalf("the other sandbox's command: %d bytes, %v", len(out), err)
	}
}

package container

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/sandbox"
	"github.com/shoal-sandbox/shoal/internal/zram"
)

// swapAvailable makes sure the host has swap, as serve --zram-size auto
// does (once per host), and reports whether it has.
func swapAvailable() bool {
	_, err := zram.EnsureSwap()
	return err == nil
}

// TestPauseReclaim: a paused sandbox is frozen and its memory reclaimed
// (into swap when the host has some: the cgroup's usage drops by most of
// the 48 MiB a shell holds); resumed, the shell's memory is what it was
// (the same checksum) and it runs on.
func TestPauseReclaim(t *testing.T) {
	requireRoot(t)
	b := newBackend(t)
	ctx := context.Background()
	spec := newSpec(t)
	spec.Resources.MemoryBytes = 256 << 20
	h := create(t, b, spec)
	a := dial(t, h.AgentSocket)
	// The shell holds 48 MiB of a known pattern and, each time /tmp/go
	// appears, writes its checksum to /tmp/sum.
	a.ask(t, `exec sh -c 'x=$(yes 0123456789abcdef | head -c 50331648); echo "$x" | md5sum >/tmp/sum0; while :; do if [ -e /tmp/go ]; then rm /tmp/go; echo "$x" | md5sum >/tmp/sum; fi; sleep 0.05; done' >/dev/null 2>&1 & echo started`)
	upper := filepath.Join(spec.Dir, upperDir, "tmp")
	waitFile := func(name string) string {
		t.Helper()
		for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			if b, err := os.ReadFile(filepath.Join(upper, name)); err == nil && len(b) > 32 {
				return strings.TrimSpace(string(b))
			}
		}
		t.Fatalf("no /tmp/%s in the sandbox after 30 s", name)
		return ""
	}
	sum0 := waitFile("sum0")
	id, _ := b.runcID(h)
	mem := b.memoryCgroup(id)

	st, err := b.Pause(ctx, h)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("pause: %+v", st)
	f, _ := b.freezer(id)
	if data, _ := os.ReadFile(filepath.Join(f.dir, "freezer.state")); !f.v2 && strings.TrimSpace(string(data)) != "FROZEN" {
		t.Fatalf("paused sandbox's freezer is %q", data)
	}
	if st.MemoryBefore < 48<<20 {
		t.Fatalf("memory before pause %d, want at least the 48 MiB the shell holds", st.MemoryBefore)
	}
	if swapAvailable() {
		if st.MemoryBefore-st.MemoryAfter < 32<<20 {
			t.Errorf("pause reclaimed %d bytes (%d -> %d), want at least 32 MiB with swap on the host", st.MemoryBefore-st.MemoryAfter, st.MemoryBefore, st.MemoryAfter)
		}
	} else {
		t.Log("no swap on this host: anonymous memory cannot be reclaimed, not checked")
	}
	if _, err := b.Resume(ctx, h); err != nil {
		t.Fatal(err)
	}
	a.ask(t, "exec touch /tmp/go") // through the sandbox: overlayfs would not see a file made in its upper
	if sum := waitFile("sum"); sum != sum0 {
		t.Fatalf("memory changed across pause: checksum %s, was %s", sum, sum0)
	}
	t.Logf("after resume and touch: usage %d", mem.usage())
}

// TestPauseReclaimShared: memory two processes share copy-on-write (a
// shell and the subshell it forked) is reclaimed too. process_madvise's
// PAGEOUT skips pages mapped more than once; a fork caught by the freeze
// made TestPauseReclaim reclaim 3 of 53 MiB on a loaded host.
func TestPauseReclaimShared(t *testing.T) {
	requireRoot(t)
	if !swapAvailable() {
		t.Skip("no swap on this host: anonymous memory cannot be reclaimed")
	}
	b := newBackend(t)
	ctx := context.Background()
	spec := newSpec(t)
	spec.Resources.MemoryBytes = 256 << 20
	h := create(t, b, spec)
	a := dial(t, h.AgentSocket)
	// The shell holds 48 MiB, then forks a subshell that keeps a copy
	// (shared until written) while it waits for its sleep.
	a.ask(t, `exec sh -c 'x=$(yes 0123456789abcdef | head -c 50331648); echo "$x" | md5sum >/tmp/sum0; { sleep 1000; true; } & wait' >/dev/null 2>&1 & echo started`)
	upper := filepath.Join(spec.Dir, upperDir, "tmp", "sum0")
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if b, err := os.ReadFile(upper); err == nil && len(b) > 32 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no /tmp/sum0 in the sandbox after 60 s")
		}
	}
	st, err := b.Pause(ctx, h)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("pause: %+v", st)
	if st.MemoryBefore-st.MemoryAfter < 32<<20 {
		t.Errorf("pause reclaimed %d bytes (%d -> %d), want at least 32 MiB of the 48 MiB shared by two processes", st.MemoryBefore-st.MemoryAfter, st.MemoryBefore, st.MemoryAfter)
	}
	if _, err := b.Resume(ctx, h); err != nil {
		t.Fatal(err)
	}
}

// One reclaim at a time: a pause whose reclaim waits for another's turn is
// frozen meanwhile and reclaims once the slot is free; one whose context
// ends while it waits stays paused (frozen), its stats saying why nothing
// was reclaimed.
func TestReclaimOneAtATime(t *testing.T) {
	requireRoot(t)
	b := newBackend(t)
	h := create(t, b, newSpec(t))
	id, _ := b.runcID(h)
	frozen := func() bool {
		f, _ := b.freezer(id)
		data, _ := os.ReadFile(filepath.Join(f.dir, "freezer.state"))
		return f.v2 || strings.TrimSpace(string(data)) == "FROZEN"
	}

	b.reclaimSlot <- struct{}{} // another sandbox's reclaim
	done := make(chan error, 1)
	var st sandbox.PauseStats
	go func() {
		var err error
		st, err = b.Pause(context.Background(), h)
		done <- err
	}()
	for deadline := time.Now().Add(30 * time.Second); !frozen(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the pause did not freeze the sandbox within 30 s")
		}
	}
	select {
	case err := <-done:
		t.Fatalf("the pause ended (%v, %+v) while another reclaim held the slot", err, st)
	case <-time.After(300 * time.Millisecond):
	}
	<-b.reclaimSlot
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(st.Method, "process_madvise") && st.Method != "memory.reclaim" {
		t.Errorf("pause after its turn: method %q", st.Method)
	}
	if _, err := b.Resume(context.Background(), h); err != nil {
		t.Fatal(err)
	}

	b.reclaimSlot <- struct{}{}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	st, err := b.Pause(ctx, h)
	<-b.reclaimSlot
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(st.Method, "waiting for another sandbox's reclaim") || !frozen() {
		t.Errorf("a pause whose wait ended: method %q, frozen %v", st.Method, frozen())
	}
}

package container

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// TestFreezeThaw: a frozen sandbox makes no progress (a counter loop
// stops, its agent does not answer) and runc calls it paused; thawed, it
// goes on. Thaw is idempotent and a no-op once the sandbox is gone.
func TestFreezeThaw(t *testing.T) {
	requireRoot(t)
	b := newBackend(t)
	ctx := context.Background()
	spec := newSpec(t)
	h := create(t, b, spec)
	a := dial(t, h.AgentSocket)
	a.ask(t, "exec (i=0; while :; do i=$((i+1)); echo $i >/tmp/counter; done) >/dev/null 2>&1 & echo started")
	counterFile := filepath.Join(spec.Dir, upperDir, "tmp", "counter")
	counter := func() string {
		b, _ := os.ReadFile(counterFile)
		return strings.TrimSpace(string(b))
	}
	advances := func() bool {
		c := counter()
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			if n := counter(); n != "" && n != c {
				return true
			}
		}
		return false
	}
	if !advances() {
		t.Fatal("the counter loop does not run")
	}
	f, err := b.freezer(h.ID)
	if err != nil {
		t.Fatal(err)
	}
	state := func() string {
		name := "freezer.state"
		if f.v2 {
			name = "cgroup.freeze"
		}
		b, _ := os.ReadFile(filepath.Join(f.dir, name))
		return strings.TrimSpace(string(b))
	}

	if err := b.Freeze(ctx, h); err != nil {
		t.Fatal(err)
	}
	if st := state(); st != "FROZEN" && st != "1" {
		t.Errorf("after Freeze the cgroup is %q", st)
	}
	before := counter()
	time.Sleep(300 * time.Millisecond)
	if after := counter(); after != before {
		t.Errorf("frozen sandbox made progress: counter %s -> %s", before, after)
	}
	// The agent is frozen too: a request waits.
	c, err := net.Dial("unix", h.AgentSocket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintln(c, "pid")
	rd := bufio.NewReader(c)
	c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if line, err := rd.ReadString('\n'); err == nil {
		t.Errorf("a frozen agent answered %q", line)
	}
	if st, err := b.Recover(ctx, h); err != nil || st != sandbox.StatusRunning {
		t.Errorf("Recover of a frozen sandbox = %v, %v; want running", st, err)
	}

	if err := b.Thaw(ctx, h); err != nil {
		t.Fatal(err)
	}
	if st := state(); st != "THAWED" && st != "0" {
		t.Errorf("after Thaw the cgroup is %q", st)
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := rd.ReadString('\n'); err != nil {
		t.Errorf("the thawed agent does not answer: %v", err)
	}
	if !advances() {
		t.Error("the thawed sandbox makes no progress")
	}
	if err := b.Thaw(ctx, h); err != nil {
		t.Errorf("second Thaw: %v", err)
	}

	// Frozen, then deleted: Delete thaws to kill; afterwards Thaw is a
	// no-op and Freeze says the sandbox is gone.
	if err := b.Freeze(ctx, h); err != nil {
		t.Fatal(err)
	}
	if err := b.Delete(ctx, h); err != nil {
		t.Fatal(err)
	}
	if err := b.Thaw(ctx, h); err != nil {
		t.Errorf("Thaw of a deleted sandbox: %v", err)
	}
	if err := b.Freeze(ctx, h); !errors.Is(err, sandbox.ErrNotFound) {
		t.Errorf("Freeze of a deleted sandbox: %v, want ErrNotFound", err)
	}
}

// The backend holds an empty frozen group beside the sandboxes' parent for
// its life (holdFreezer), and Close thaws and removes it.
func TestHoldFreezer(t *testing.T) {
	v1 := requireFreezerV1(t)
	parent := fmt.Sprintf("shoal-test-hold-%d", os.Getpid())
	b := &Backend{cgroupParent: parent}
	release, err := b.holdFreezer()
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(v1, parent+"-frozen")
	if got := readTrim(t, filepath.Join(dir, "freezer.state")); got != "FROZEN" {
		release()
		t.Fatalf("held group is %s", got)
	}
	release()
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("held group left after release: %v", err)
	}
}

// BenchmarkFreezeThaw times one freeze and one thaw of a group holding a
// sleeping process, alone (the kernel switches its freezer on and off
// each time) and while another group stays frozen (holdFreezer).
//
//	go test -run '^$' -bench FreezeThaw -benchtime 50x ./internal/backend/container/
func BenchmarkFreezeThaw(b *testing.B) {
	v1 := requireFreezerV1(b)
	for _, held := range []bool{false, true} {
		b.Run(map[bool]string{false: "alone", true: "held"}[held], func(b *testing.B) {
			parent := fmt.Sprintf("shoal-bench-freeze-%d", os.Getpid())
			be := &Backend{cgroupParent: parent}
			if held {
				release, err := be.holdFreezer()
				if err != nil {
					b.Fatal(err)
				}
				defer release()
			}
			f := cgroupFreezer{dir: filepath.Join(v1, parent, "g")}
			if err := os.MkdirAll(f.dir, 0o755); err != nil {
				b.Fatal(err)
			}
			defer os.Remove(filepath.Dir(f.dir))
			defer os.Remove(f.dir)
			sleeper := exec.Command("sleep", "1000")
			if err := sleeper.Start(); err != nil {
				b.Fatal(err)
			}
			defer sleeper.Wait()
			defer sleeper.Process.Kill()
			defer f.thaw()
			if err := os.WriteFile(filepath.Join(f.dir, "cgroup.procs"), []byte(strconv.Itoa(sleeper.Process.Pid)), 0o644); err != nil {
				b.Fatal(err)
			}
			var freezes, thaws []time.Duration
			for b.Loop() {
				t := time.Now()
				if err := f.freeze(context.Background()); err != nil {
					b.Fatal(err)
				}
				freezes = append(freezes, time.Since(t))
				t = time.Now()
				if err := f.thaw(); err != nil {
					b.Fatal(err)
				}
				thaws = append(thaws, time.Since(t))
			}
			report(b, "freeze", freezes)
			report(b, "thaw", thaws)
		})
	}
}

// requireFreezerV1 skips unless root and a cgroup v1 freezer hierarchy are
// there, and returns its mount point.
func requireFreezerV1(t testing.TB) string {
	t.Helper()
	requireRoot(t)
	const v1 = "/sys/fs/cgroup/freezer"
	if !exists(filepath.Join(v1, "cgroup.procs")) {
		t.Skip("no cgroup v1 freezer hierarchy at " + v1)
	}
	return v1
}

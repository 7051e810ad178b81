package agent

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/cgroups"
	"github.com/shoal-sandbox/shoal/internal/procfs"
)

func TestCgroupKey(t *testing.T) {
	doc := "populated 1\nfrozen 0\n"
	if cgroupKey(doc, "frozen") != "0" || cgroupKey(doc, "populated") != "1" || cgroupKey(doc, "froze") != "" {
		t.Errorf("cgroupKey of %q", doc)
	}
}

// testV2Group makes a group in the host's cgroup v2 hierarchy (the unified
// one of a hybrid host: no controllers are needed to freeze) and returns
// it open, or skips.
func testV2Group(t *testing.T) (*os.File, string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (a cgroup of its own)")
	}
	ms, err := cgroups.Mounts()
	if err != nil {
		t.Skip(err)
	}
	root := ""
	for _, m := range ms {
		if m.V2 {
			root = m.Dir
		}
	}
	if root == "" {
		t.Skip("no cgroup v2 hierarchy")
	}
	// Below the test's own group: v2 moves a process only between
	// groups below a common ancestor it may write.
	own, err := procfs.Cgroup2("self")
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(own, "shoal-test-freeze-"+strconv.Itoa(os.Getpid()))
	dir := filepath.Join(root, path)
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Skipf("no group of its own: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "cgroup.freeze")); err != nil {
		os.Remove(dir)
		t.Skipf("no cgroup freezer: %v", err)
	}
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		f.Close()
		cgroups.Remove(dir, 5*time.Second)
	})
	return f, path
}

// utime is process pid's user CPU time in clock ticks.
func utime(t *testing.T, pid int) uint64 {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	n, _ := strconv.ParseUint(f[11], 10, 64)
	return n
}

// A VM's commands are born in their group (clone3 CLONE_INTO_CGROUP), and
// an export's freeze stops them there, those started while it lasts too,
// until the thaw.
func TestCommandsCgroupFreeze(t *testing.T) {
	dir, path := testV2Group(t)
	s := &Server{cfg: Config{CommandsCgroup: dir, CommandsCgroupPath: path}}
	spin := func() (*exec.Cmd, error) {
		c := exec.Command("sh", "-c", "while :; do :; done")
		c.SysProcAttr = s.sysProcAttr(&syscall.SysProcAttr{})
		if err := c.Start(); err != nil {
			return nil, err
		}
		t.Cleanup(func() { c.Process.Kill(); c.Wait() })
		return c, nil
	}
	runs := func(pid int) bool {
		t.Helper()
		u := utime(t, pid)
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
			if utime(t, pid) != u {
				return true
			}
		}
		return false
	}
	a, err := spin()
	if err != nil {
		t.Fatal(err)
	}
	if !inCgroup(a.Process.Pid, path) {
		b, _ := os.ReadFile("/proc/" + strconv.Itoa(a.Process.Pid) + "/cgroup")
		t.Fatalf("a command was not born in %s: %s", path, b)
	}
	if inCgroup(os.Getpid(), path) {
		t.Fatal("the agent's own process is in the commands' group")
	}
	if !runs(a.Process.Pid) {
		t.Fatal("the command does not run")
	}
	thaw, err := freezeCgroup(dir, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if ev, _ := cgroupFileAt(dir, "cgroup.events"); cgroupKey(ev, "frozen") != "1" {
		t.Errorf("not frozen: %q", ev)
	}
	// A command started meanwhile is born frozen: its fork (a vfork,
	// which returns once the child executes) ends after the thaw.
	bc := make(chan *exec.Cmd, 1)
	go func() {
		c, err := spin()
		if err != nil {
			t.Error(err)
		}
		bc <- c
	}()
	u := utime(t, a.Process.Pid)
	time.Sleep(300 * time.Millisecond)
	if utime(t, a.Process.Pid) != u {
		t.Error("a frozen command ran")
	}
	select {
	case <-bc:
		t.Error("a command started in a frozen group")
	default:
	}
	// A second freeze (the guest's own, say) is left for its owner.
	if again, err := freezeCgroup(dir, time.Second); err != nil {
		t.Fatal(err)
	} else {
		again()
	}
	if ev, _ := cgroupFileAt(dir, "cgroup.events"); cgroupKey(ev, "frozen") != "1" {
		t.Errorf("thawed by a freeze that found it frozen: %q", ev)
	}
	thaw()
	var b *exec.Cmd
	select {
	case b = <-bc:
		if b == nil {
			t.FailNow()
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a command started during the freeze did not start after it")
	}
	if !runs(a.Process.Pid) || !runs(b.Process.Pid) {
		t.Error("the commands do not run after the thaw")
	}
}

package microvm

import (
	"os"
	"os/exec"
	"strconv"
	"testing"

	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// A VM's process goes into groups of its own with the sandbox's limits, a
// best-effort one's cpu group under the idle parent, and they are removed
// with it. (A process stands in for QEMU: a best-effort VM would boot
// only when the host has CPU to spare; TestVMCreateExecFilesDelete checks
// a booted VM's groups.)
func TestVMCgroup(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (cgroups)")
	}
	if _, err := os.Stat("/sys/fs/cgroup/memory/memory.limit_in_bytes"); err != nil {
		t.Skip("no cgroup v1 memory hierarchy")
	}
	b := &Backend{cfg: Config{CgroupParent: "shoal-test-vm"}}
	for _, be := range []bool{false, true} {
		res := sandbox.Resources{MemoryBytes: 300 << 20, MilliCPU: 1500, BestEffort: be}
		h := sandbox.Handle{ID: "vmcg-" + strconv.Itoa(os.Getpid()) + map[bool]string{false: "-ls", true: "-be"}[be],
			Data: map[string]string{"mem": strconv.FormatInt(res.MemoryBytes, 10), "millicpu": "1500"}}
		if be {
			h.Data["qos"] = "be"
		}
		cmd := exec.Command("sleep", "60")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		if err := b.enterCgroup(h, cmd.Process.Pid); err != nil {
			cmd.Process.Kill()
			t.Fatal(err)
		}
		h.Data["pid"] = strconv.Itoa(cmd.Process.Pid)
		groups := checkCgroup(t, h, res)
		if u := b.Usage(h); u.MemoryBytes < 0 || u.CPUUsec < 0 {
			t.Errorf("usage %+v", u)
		}
		cmd.Process.Kill()
		cmd.Wait()
		if err := b.removeCgroup(h); err != nil {
			t.Fatal(err)
		}
		for _, g := range groups {
			if _, err := os.Stat(g); !os.IsNotExist(err) {
				t.Errorf("cgroup %s left: %v", g, err)
			}
		}
	}
}

package container

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The bound of all sandboxes' tasks together is pids.max of their parent
// cgroup, made if no sandbox made it yet.
func TestParentPidsMax(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (cgroups)")
	}
	parent := fmt.Sprintf("shoal-test-pidsmax-%d", os.Getpid())
	b := &Backend{cgroupParent: parent}
	mounts, err := b.cgroupMounts()
	if err != nil {
		t.Skip(err)
	}
	var dir string
	for _, m := range mounts {
		if !m.v2 && strings.Contains(strings.Join(m.options, ","), "pids") {
			dir = filepath.Join(m.dir, parent)
		}
	}
	if dir == "" {
		t.Skip("no cgroup v1 pids hierarchy")
	}
	t.Cleanup(func() { os.Remove(dir) })
	if err := b.setParentPidsMax(12345); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(filepath.Join(dir, "pids.max"))
	if err != nil || strings.TrimSpace(string(got)) != "12345" {
		t.Fatalf("pids.max = %q, %v", got, err)
	}
}

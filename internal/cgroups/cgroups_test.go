package cgroups

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The host's hierarchies are found, each once; a group is made, written,
// listed and removed.
func TestMountsAndGroup(t *testing.T) {
	ms, err := Mounts()
	if err != nil {
		t.Fatal(err)
	}
	if len(ms) == 0 {
		t.Skip("no cgroup hierarchy mounted")
	}
	seen := map[string]bool{}
	var pids *Mount
	for i, m := range ms {
		if seen[m.Dir] {
			t.Errorf("%s listed twice", m.Dir)
		}
		seen[m.Dir] = true
		if m.Has("pids") {
			pids = &ms[i]
		}
	}
	if os.Geteuid() != 0 || pids == nil {
		t.Skip("needs root and a v1 pids hierarchy")
	}
	dir := filepath.Join(pids.Dir, "shoal-test-cgroups-"+strings.ReplaceAll(t.Name(), "/", "-"))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	defer Remove(dir, time.Second)
	if err := Write(filepath.Join(dir, "pids.max"), "7"); err != nil {
		t.Fatal(err)
	}
	if err := WriteIfExists(filepath.Join(dir, "no.such.file"), "1"); err != nil {
		t.Errorf("WriteIfExists of a missing file: %v", err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "pids.max")); strings.TrimSpace(string(b)) != "7" {
		t.Errorf("pids.max %q", b)
	}
	if p, err := ReadPids(filepath.Join(dir, "cgroup.procs")); err != nil || len(p) != 0 {
		t.Errorf("pids of a new group: %v %v", p, err)
	}
	if err := Remove(dir, time.Second); err != nil {
		t.Fatal(err)
	}
	if err := Remove(dir, time.Second); err != nil {
		t.Errorf("removing a removed group: %v", err)
	}
}

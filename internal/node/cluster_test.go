package node

import (
	"strings"
	"testing"

	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

func TestIDPrefix(t *testing.T) {
	m, _, _ := newTestManager(t)
	m.cfg.IDPrefix = "n2ab"
	for i := 0; i < 100; i++ {
		id := m.newSandboxID()
		if !strings.HasPrefix(id, "n2ab") || !validID(id) {
			t.Fatalf("ID %q: want a valid ID starting with n2ab", id)
		}
	}
	for _, bad := range []string{"abcde", "AB", "n-1", "01"} {
		if validIDPrefix(bad) == nil {
			t.Errorf("prefix %q accepted", bad)
		}
	}
}

func TestLoad(t *testing.T) {
	m, _, _ := newTestManager(t)
	m.cfg.Capacity = Capacity{MemoryOvercommit: 2, CPUOvercommit: 4,
		Host: func() (int64, int64, int, error) { return 8 << 30, 4 << 30, 2, nil }}
	m.sandboxes["a"] = &entry{rec: Record{ID: "a", State: StateRunning, Resources: sandbox.Resources{MemoryBytes: 1 << 30, MilliCPU: 1000}}}
	m.sandboxes["b"] = &entry{rec: Record{ID: "b", State: StatePaused, Resources: sandbox.Resources{MemoryBytes: 1 << 30, MilliCPU: 1000}}}
	if err := m.admit("c", "", sandbox.Resources{MemoryBytes: 512 << 20, MilliCPU: 500}); err != nil {
		t.Fatal(err)
	}
	l := m.Load()
	if l.Memory != 16<<30 || l.MilliCPU != 8000 || l.UsedMemory != 1536<<20 || l.UsedMilliCPU != 1500 || l.Sandboxes != 3 {
		t.Fatalf("load %+v", l)
	}
}

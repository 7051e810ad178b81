package node

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
	"github.com/shoal-sandbox/shoal/internal/tenant"
)

// diskBackend is a fake backend that bounds disks (or says why it cannot).
type diskBackend struct {
	fakeBackend
	ok bool
}

func (b diskBackend) DiskLimits() (bool, string) { return b.ok, "test" }

func TestValidateDisk(t *testing.T) {
	m, _, _ := newTestManager(t)
	m.cfg.DefaultDisk, m.cfg.MaxDisk = 1<<30, 4<<30
	for _, tc := range []struct {
		name    string
		limits  bool // the backend bounds disks
		disk    int64
		want    int64
		wantErr error
	}{
		{"default", true, 0, 1 << 30, nil},
		{"given", true, 64 << 20, 64 << 20, nil},
		{"negative", true, -1, 0, errdefs.ErrInvalidArgument},
		{"too small", true, 1 << 20, 0, errdefs.ErrInvalidArgument},
		{"too large", true, 4<<30 + 1, 0, errdefs.ErrInvalidArgument},
		{"max int", true, math.MaxInt64, 0, errdefs.ErrInvalidArgument},
		{"no limits: default is none", false, 0, 0, nil},
		{"no limits: given is refused", false, 64 << 20, 0, errdefs.ErrFailedPrecondition},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m.backends["fake"] = diskBackend{ok: tc.limits}
			req := CreateRequest{Backend: "fake", Disk: tc.disk}
			err := m.validateDisk(&req)
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("disk %d: %v, want %v", tc.disk, err, tc.wantErr)
				}
				return
			}
			if err != nil || req.Disk != tc.want {
				t.Fatalf("disk %d: %d, %v; want %d", tc.disk, req.Disk, err, tc.want)
			}
		})
	}
}

func TestAdmission(t *testing.T) {
	m, _, _ := newTestManager(t)
	m.cfg.DiskBudget = 3 << 30
	r := sandbox.Resources{Pids: 1024, DiskBytes: 1 << 30}
	if err := m.admit("a", "", r); err != nil {
		t.Fatal(err)
	}
	m.sandboxes["b"] = &entry{rec: Record{ID: "b", Resources: r}} // a running one
	if err := m.admit("c", "", sandbox.Resources{Pids: 900, DiskBytes: 1<<30 + 1}); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("over the disk budget: %v, want resource_exhausted", err)
	}
	if err := m.admit("c", "", r); err != nil {
		t.Fatalf("within the budget: %v", err)
	}
	if err := m.admit("d", "", r); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("fourth disk over the budget: %v, want resource_exhausted", err)
	}
	// A failed create gives its share back; so does a deleted sandbox.
	m.admitted("c")
	delete(m.sandboxes, "b")
	if err := m.admit("d", "", r); err != nil {
		t.Fatal(err)
	}
	if err := m.admit("e", "", sandbox.Resources{DiskBytes: math.MaxInt64}); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("max int disk: %v, want resource_exhausted", err)
	}
	// Log budgets count with the disks (the host's disk holds both): 2 GiB
	// of 3 are taken.
	if err := m.admit("g", "", sandbox.Resources{DiskBytes: 1 << 29, LogBytes: 1<<29 + 1}); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("disk and log over the budget: %v, want resource_exhausted", err)
	}
	if err := m.admit("g", "", sandbox.Resources{DiskBytes: 1 << 29, LogBytes: 1 << 29}); err != nil {
		t.Fatalf("disk and log within the budget: %v", err)
	}
	// No budget: anything goes.
	m.cfg.DiskBudget = 0
	if err := m.admit("f", "", sandbox.Resources{Pids: math.MaxInt64, DiskBytes: math.MaxInt64}); err != nil {
		t.Fatal(err)
	}
}

func TestHostPidsBudget(t *testing.T) {
	b, err := HostPidsBudget()
	if err != nil {
		t.Skip(err)
	}
	pidMax, _ := readSysctl("/proc/sys/kernel/pid_max")
	if b <= 0 || b > pidMax {
		t.Errorf("pids budget %d, pid_max %d", b, pidMax)
	}
}

type quotaMap map[string]tenant.Quota

func (q quotaMap) Quota(t string) tenant.Quota { return q[t] }

func TestTenantQuota(t *testing.T) {
	m, _, _ := newTestManager(t)
	quotas := quotaMap{"a": {MaxSandboxes: 2, MaxMemory: 3 << 30, MaxMilliCPU: 3000}}
	m.cfg.Quotas = quotas
	r := sandbox.Resources{MemoryBytes: 1 << 30, MilliCPU: 1000}
	exhausted := func(err error, quota string) {
		t.Helper()
		if !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "quota "+quota) {
			t.Fatalf("%v, want resource_exhausted naming quota %s", err, quota)
		}
	}
	if err := m.admit("a1", "a", r); err != nil {
		t.Fatal(err)
	}
	m.sandboxes["a2"] = &entry{rec: Record{ID: "a2", Tenant: "a", Resources: r}}
	exhausted(m.admit("a3", "a", r), "max-sandboxes")
	// Another tenant, and the admin, are not counted against a.
	if err := m.admit("b1", "b", r); err != nil {
		t.Fatal(err)
	}
	if err := m.admit("x1", "", r); err != nil {
		t.Fatal(err)
	}
	m.admitted("a1") // a failed create gives its share back
	if err := m.admit("a3", "a", r); err != nil {
		t.Fatalf("after a failed create: %v", err)
	}
	m.admitted("a3")
	exhausted(m.admit("a4", "a", sandbox.Resources{MemoryBytes: 2<<30 + 1, MilliCPU: 10}), "max-memory")
	exhausted(m.admit("a4", "a", sandbox.Resources{MemoryBytes: 1 << 20, MilliCPU: 2001}), "max-cpus")
	if err := m.admit("a4", "a", sandbox.Resources{MemoryBytes: 2 << 30, MilliCPU: 2000}); err != nil {
		t.Fatalf("exactly at the quota: %v", err)
	}
	// Creates per second: a burst of 2, then refused until refilled.
	quotas["c"] = tenant.Quota{CreatesPerSecond: 0.001, Burst: 2}
	for i := 0; i < 2; i++ {
		if err := m.admit(fmt.Sprint("c", i), "c", r); err != nil {
			t.Fatalf("burst create %d: %v", i, err)
		}
	}
	exhausted(m.admit("c2", "c", r), "creates-per-second")
	// A raised rate takes effect at once.
	quotas["c"] = tenant.Quota{CreatesPerSecond: 1000, Burst: 5}
	if err := m.admit("c2", "c", r); err != nil {
		t.Fatalf("after raising the rate: %v", err)
	}
}

// The node admits memory and CPU limits up to a multiple of the host's,
// counts paused sandboxes as neither, keeps the host's available memory
// above a floor, and refuses past them with unavailable ("node full"),
// not resource_exhausted (a tenant's quota).
func TestCapacity(t *testing.T) {
	m, _, _ := newTestManager(t)
	avail := int64(8 << 30)
	m.cfg.Capacity = Capacity{MemoryOvercommit: 2, CPUOvercommit: 4, MinAvailable: 1 << 30,
		Host: func() (int64, int64, int, error) { return 4 << 30, avail, 2, nil }}
	r := sandbox.Resources{MemoryBytes: 3 << 30, MilliCPU: 3000}
	m.sandboxes["a"] = &entry{rec: Record{ID: "a", State: StateRunning, Resources: r}}
	m.sandboxes["b"] = &entry{rec: Record{ID: "b", State: StatePaused, Resources: r}} // counts nothing
	if err := m.admit("c", "", sandbox.Resources{MemoryBytes: 5 << 30, MilliCPU: 1000}); err != nil {
		t.Fatalf("3 + 5 GiB of 2 × 4 GiB: %v", err)
	}
	m.admitted("c")
	err := m.admit("c", "", sandbox.Resources{MemoryBytes: 5<<30 + 1, MilliCPU: 1000})
	if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "node full") || !strings.Contains(err.Error(), "--memory-overcommit") {
		t.Fatalf("past the memory overcommit: %v", err)
	}
	if err := m.admit("c", "", sandbox.Resources{MemoryBytes: 1 << 20, MilliCPU: 5001}); !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "--cpu-overcommit") {
		t.Fatalf("3 + 5.001 CPUs of 4 × 2: %v", err)
	}
	avail = 512 << 20
	if err := m.admit("c", "", sandbox.Resources{MemoryBytes: 1 << 20}); !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "--min-available") {
		t.Fatalf("below the available floor: %v", err)
	}
	avail = 8 << 30
	// Deleting a running sandbox makes room.
	delete(m.sandboxes, "a")
	if err := m.admit("c", "", sandbox.Resources{MemoryBytes: 8 << 30, MilliCPU: 8000}); err != nil {
		t.Fatalf("after a delete: %v", err)
	}
	m.admitted("c")
	m.cfg.Capacity = Capacity{}
	if err := m.admit("d", "", sandbox.Resources{MemoryBytes: math.MaxInt64, MilliCPU: math.MaxInt64}); err != nil {
		t.Fatalf("no capacity bounds: %v", err)
	}
}

func TestHostCapacity(t *testing.T) {
	total, avail, cpus, err := HostCapacity()
	if err != nil {
		t.Skip(err)
	}
	if total <= 0 || avail <= 0 || avail > total || cpus < 1 {
		t.Errorf("host capacity %d %d %d", total, avail, cpus)
	}
}

// TestHostCacheTTL: admission reads the host at most once per TTL, again
// after it, and never keeps a failed reading.
func TestHostCacheTTL(t *testing.T) {
	now := time.Unix(1000, 0)
	reads := 0
	var fail error
	h := &hostCache{ttl: 50 * time.Millisecond, now: func() time.Time { return now },
		read: func() (int64, int64, int, error) {
			reads++
			return 8 << 30, int64(reads) << 30, 2, fail
		}}
	for range 3 {
		if _, avail, _, err := h.get(); err != nil || avail != 1<<30 {
			t.Fatalf("within the TTL: available %d, %v (want the first reading)", avail, err)
		}
	}
	now = now.Add(50 * time.Millisecond)
	if _, avail, _, _ := h.get(); avail != 2<<30 || reads != 2 {
		t.Fatalf("after the TTL: available %d after %d reads (want a new reading)", avail, reads)
	}
	now = now.Add(time.Second)
	fail = errors.New("no meminfo")
	if _, _, _, err := h.get(); err == nil {
		t.Fatal("a failed reading was not returned")
	}
	fail = nil
	if _, avail, _, err := h.get(); err != nil || avail != 4<<30 {
		t.Fatalf("after a failed reading: available %d, %v (want a new reading)", avail, err)
	}
}

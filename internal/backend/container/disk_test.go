package container

import (
	"context"
	"errors"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// diskBackend returns a backend with disk images (and a pool of size, if
// size > 0), or skips when this host cannot make them.
func diskBackend(t *testing.T, size int) *Backend {
	return diskBackendPremade(t, size, 0)
}

// diskBackendPremade is diskBackend whose pool containers wait with a disk
// of premade bytes.
func diskBackendPremade(t *testing.T, size int, premade int64) *Backend {
	t.Helper()
	requireRoot(t)
	if size <= 0 {
		size = -1
	}
	b, err := New(Config{StateDir: t.TempDir(), CgroupParent: testCgroupParent, Launcher: testLauncher, PoolSize: size,
		DiskDir: t.TempDir(), PremadeDisk: premade, Log: testLog(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.agents.close) // the agent binary's tmpfs (agentcopy.go)
	t.Cleanup(func() { b.Close(context.Background()) })
	if ok, why := b.DiskLimits(); !ok {
		t.Skipf("no disk images on this host: %s", why)
	}
	if size > 0 {
		b.pool.take(realAgent) // starts the filler
		waitPool(t, b, 1)
	}
	return b
}

// TestDiskLimit: a sandbox's writable layer holds no more than its disk
// size, cold and pooled; the host's disk holds no more than that for it;
// Delete leaves no mount and no image.
func TestDiskLimit(t *testing.T) {
	const size = 32 << 20
	for _, c := range []struct {
		name    string
		pooled  bool
		premade int64 // the pool containers' disk made ahead
	}{
		{"cold", false, 0},
		{"pooled", true, 0},
		{"premade", true, size},
		{"premade-other", true, 2 * size},
	} {
		t.Run(c.name, func(t *testing.T) {
			pooled := c.pooled
			b := diskBackendPremade(t, map[bool]int{false: -1, true: 1}[pooled], c.premade)
			spec := poolSpec(t)
			spec.Resources.DiskBytes = size
			// Where the disk is: made ahead, it came with the container.
			diskDir := spec.Dir
			if c.premade == size {
				diskDir = b.claimedDir(spec.ID)
			}
			h, err := b.Create(createCtx(t), spec)
			if err != nil {
				t.Fatal(err)
			}
			if got := h.Data["pooled"] == "true"; got != pooled {
				t.Fatalf("pooled = %v, want %v", got, pooled)
			}
			out, code := run(t, h, "busybox dd if=/dev/zero of=/root/fill bs=1M count=100; echo rc=$?; stat -c size=%s /root/fill")
			if code != 0 || !strings.Contains(out, "No space left on device") {
				t.Errorf("writing 100 MiB into a 32 MiB disk: exit %d, output %q; want ENOSPC", code, out)
			}
			// stdout and stderr interleave in out: find the size by its name.
			var n int64
			for _, l := range strings.Split(out, "\n") {
				if v, ok := strings.CutPrefix(l, "size="); ok {
					n, _ = strconv.ParseInt(v, 10, 64)
				}
			}
			if n > size || n < size/2 {
				t.Errorf("wrote %d bytes before ENOSPC, want about %d; output %q", n, size, out)
			}
			var st unix.Stat_t
			if err := unix.Stat(filepath.Join(diskDir, diskImageName), &st); err != nil {
				t.Fatal(err)
			}
			if st.Blocks*512 > size {
				t.Errorf("the host holds %d bytes for a %d-byte disk", st.Blocks*512, size)
			}
			if h.Data["upper"] != filepath.Join(diskDir, diskMountName, upperDir) {
				t.Errorf("handle's upper = %q, want it in %s", h.Data["upper"], diskDir)
			}
			if c.premade != 0 && c.premade != size && exists(filepath.Join(b.claimedDir(spec.ID), diskImageName)) {
				t.Error("the disk made ahead of another size is still there")
			}
			// Still writable after removing the file.
			if out, code := run(t, h, "rm /root/fill && echo hi > /root/small && cat /root/small"); code != 0 || out != "hi\n" {
				t.Errorf("after freeing space: exit %d, %q", code, out)
			}
			if err := b.Delete(context.Background(), h); err != nil {
				t.Fatal(err)
			}
			if left := leftovers(t, b, spec); len(left) > 0 {
				t.Errorf("left after Delete: %v", left)
			}
			if exists(filepath.Join(diskDir, diskImageName)) || exists(filepath.Join(b.claimedDir(spec.ID), diskImageName)) {
				t.Error("disk image left after Delete")
			}
		})
	}
}

// TestDiskUnsupported: a disk size on a backend without disk images is
// refused, and leaves nothing.
func TestDiskUnsupported(t *testing.T) {
	requireRoot(t)
	b := newBackend(t)
	spec := newSpec(t)
	spec.Resources.DiskBytes = 64 << 20
	if _, err := b.Create(createCtx(t), spec); !errors.Is(err, sandbox.ErrUnsupported) {
		t.Fatalf("Create with a disk size on a backend without disks: %v, want ErrUnsupported", err)
	}
	if left := leftovers(t, b, spec); len(left) > 0 {
		t.Errorf("left after failed Create: %v", left)
	}
}

package microvm

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// TestVMDiskLimit: a VM created with a disk size has its writable layer on
// an ext4 device of that size: writing more fails with ENOSPC in the guest,
// the host's image stays within the size (sparse, discard), and what was
// written survives a pause and resume, and can be committed after it. The
// node's bound on a VM's disk I/O holds (16 MiB/s here).
func TestVMDiskLimit(t *testing.T) {
	const bps = 16 << 20
	b, img := vmTestEnv(t, MachineMicroVM, func(c *Config) { c.DiskBPS, c.DiskIOPS = bps, 1000 })
	if ok, why := b.DiskLimits(); !ok {
		t.Skipf("no disk limits: %s", why)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	sdir, err := os.MkdirTemp("/tmp", "vmd")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(sdir)
	const size = 48 << 20
	h, err := b.Create(ctx, sandbox.Spec{ID: "vmdisk", Dir: sdir,
		Resources: sandbox.Resources{MemoryBytes: 256 << 20, MilliCPU: 1000, DiskBytes: size},
		Layers:    []sandbox.Layer{{Digest: "sha256:x", Kind: "base", ImagePath: img}}})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { b.Delete(context.Background(), h) }()
	c := agent.NewClientDialer(h.ID, b.AgentDial(h))
	// The root's size is the disk's (a tmpfs would be half the guest's RAM).
	if f := strings.Fields(run(t, ctx, c, "sh", "-c", "df -k / | tail -1")); len(f) < 2 {
		t.Errorf("df: %v", f)
	} else if kb, _ := strconv.Atoi(f[1]); kb < 40<<10 || kb > size>>10 {
		t.Errorf("the root holds %d KiB, want the disk's %d MiB less ext4's own", kb, size>>20)
	}
	out := run(t, ctx, c, "sh", "-c", "dd if=/dev/zero of=/work/big bs=1M count=96 2>&1; echo rc=$?; sync")
	if !strings.Contains(out, "No space left") || strings.Contains(out, "rc=0") {
		t.Errorf("writing 96 MiB into a 48 MiB disk: %s", out)
	}
	if fi, err := os.Stat(filepath.Join(sdir, upperImage)); err != nil || fi.Size() != size {
		t.Errorf("the host's image: %v, %v (want %d bytes)", fi, err, size)
	}
	run(t, ctx, c, "rm", "/work/big")
	// The node's I/O bound holds whatever the guest does (writeback
	// here): 32 MiB written and flushed at 16 MiB/s take 2 s less the
	// throttle's burst (a tenth of a second's worth).
	start := time.Now()
	run(t, ctx, c, "dd", "if=/dev/zero", "of=/work/t", "bs=1M", "count=32", "conv=fsync")
	took := time.Since(start)
	t.Logf("32 MiB written and flushed in %s", took)
	if min := time.Duration(32<<20) * time.Second / bps * 3 / 4; took < min { // unbounded: ~0.3 s
		t.Errorf("32 MiB written and flushed in %s with the disk bound to %d MiB/s: want %s at least", took, bps>>20, min)
	}
	run(t, ctx, c, "rm", "/work/t")
	run(t, ctx, c, "sh", "-c", "echo kept > /work/kept; sync")

	if _, err := b.Pause(ctx, h); err != nil {
		t.Fatal(err)
	}
	nh, err := b.Resume(ctx, h)
	if err != nil {
		t.Fatal(err)
	}
	h = nh
	c = agent.NewClientDialer(h.ID, b.AgentDial(h))
	if got := run(t, ctx, c, "cat", "/work/kept"); got != "kept\n" {
		t.Errorf("after pause and resume: %q", got)
	}
	// A commit of the disk's writable layer, by the agent restored from
	// the snapshot (the upper it opened at boot).
	checkExport(t, ctx, b, c, h)
}

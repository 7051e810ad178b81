package vminit

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// A device node whose disk the kernel has not finished adding (here: one
// with no driver behind it) opens with ENXIO: not ready, so the boot waits
// for it instead of failing its mount ("/dev/pmem0: Can't open blockdev",
// seen once in CI). An openable one is ready.
func TestDeviceReady(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (mknod)")
	}
	node := filepath.Join(t.TempDir(), "pmem-not-yet")
	// Block major 259 (blkext), a minor no disk has.
	if err := unix.Mknod(node, unix.S_IFBLK|0o600, int(unix.Mkdev(259, 1<<19-1))); err != nil {
		t.Skipf("mknod: %v", err)
	}
	if deviceReady(node) {
		t.Errorf("%s: ready, with no disk behind it", node)
	}
	if !deviceReady("/dev/null") {
		t.Error("/dev/null: not ready")
	}
	if deviceReady(filepath.Join(t.TempDir(), "missing")) {
		t.Error("a missing node: ready")
	}
}

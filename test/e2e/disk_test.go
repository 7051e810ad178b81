package e2e

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// needDisks skips when this server runs without disk limits (no loop
// devices, say): its log says why.
func needDisks(t *testing.T) {
	t.Helper()
	need(t)
	log, _ := os.ReadFile(filepath.Join(dataDir, "serve.log"))
	if strings.Contains(string(log), "sandbox disks: NOT limited") {
		t.Skip("this host cannot give sandboxes disk images (see serve.log)")
	}
}

// imageBytes is what the host's disk holds for a sandbox's disk image.
func imageBytes(t *testing.T, id string) int64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(dataDir, "sandboxes", id, "disk.img"), &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

func lastInt(t *testing.T, out string) int64 {
	t.Helper()
	f := strings.Fields(out)
	if len(f) == 0 {
		t.Fatalf("no number in %q", out)
	}
	n, err := strconv.ParseInt(f[len(f)-1], 10, 64)
	if err != nil {
		t.Fatalf("no number at the end of %q", out)
	}
	return n
}

// TestDiskLimit: a sandbox created with --disk 64M that writes 200 MiB gets
// ENOSPC at about 64 MiB; the host's disk holds at most that for it;
// another sandbox still writes; the limit outlives a restart of serve; and
// delete leaves no mount and no image.
func TestDiskLimit(t *testing.T) {
	needDisks(t)
	const size = 64 << 20
	id := create(t, "--disk", "64M")
	out, _ := run(nil, "inspect", id)
	if !strings.Contains(out, `"diskBytes": "67108864"`) && !strings.Contains(out, `"disk_bytes": "67108864"`) && !strings.Contains(out, "67108864") {
		t.Errorf("inspect does not show the disk size: %s", out)
	}
	out, errOut, code := run3(nil, "exec", id, "--", "sh", "-c", "dd if=/dev/zero of=/root/fill bs=1M count=200; stat -c %s /root/fill")
	if code != 0 || !strings.Contains(errOut, "No space left on device") {
		t.Fatalf("writing 200 MiB into a 64 MiB disk: exit %d: %s %s", code, out, errOut)
	}
	if n := lastInt(t, out); n > size || n < size*3/4 {
		t.Errorf("wrote %d bytes before ENOSPC, want about %d", n, size)
	}
	if b := imageBytes(t, id); b > size {
		t.Errorf("the host holds %d bytes for a %d-byte disk", b, size)
	}

	// Another sandbox (the node's default disk) is not troubled.
	other := create(t)
	if out, code := run(nil, "exec", other, "--", "sh", "-c", "dd if=/dev/zero of=/root/fill bs=1M count=100 2>/dev/null && stat -c %s /root/fill"); code != 0 || lastInt(t, out) != 100<<20 {
		t.Errorf("a second sandbox writing 100 MiB: exit %d: %s", code, out)
	}

	// Across a restart of serve: the disk is still there, still full, and
	// still limited.
	killServe()
	if err := startServe(); err != nil {
		t.Fatal(err)
	}
	out, code = run(nil, "exec", id, "--", "sh", "-c", "stat -c %s /root/fill; dd if=/dev/zero of=/root/more bs=1M count=10")
	if code == 0 || !strings.Contains(out, "No space left on device") {
		t.Errorf("writing into the full disk after a restart: exit %d: %s", code, out)
	}
	if out, code := run(nil, "exec", id, "--", "sh", "-c", "rm /root/fill /root/more; echo ok > /root/small && cat /root/small"); code != 0 || !strings.Contains(out, "ok") {
		t.Errorf("after freeing space: exit %d: %s", code, out)
	}

	// Delete: no mount left under the sandbox's dir, no image.
	dir := filepath.Join(dataDir, "sandboxes", id)
	if out, code := run(nil, "rm", id); code != 0 {
		t.Fatal(out)
	}
	if !eventually(teardownTimeout, func() bool { return len(mountsUnder(dir)) == 0 }) {
		t.Errorf("mounts left after delete: %v", mountsUnder(dir))
	}
	if !eventually(teardownTimeout, func() bool { _, err := os.Stat(filepath.Join(dir, "disk.img")); return os.IsNotExist(err) }) {
		t.Errorf("disk image left after delete")
	}
}

// TestDiskInodeLimit: a sandbox's disk has a bounded number of inodes
// (one per 8 KiB): creating empty files fails with ENOSPC at the bound.
func TestDiskInodeLimit(t *testing.T) {
	needDisks(t)
	id := create(t, "--disk", "16M") // 2048 inodes
	out, errOut, code := run3(nil, "exec", id, "--", "sh", "-c",
		`mkdir /root/many && cd /root/many && i=0; while [ $i -lt 5000 ]; do touch f$i || break; i=$((i+1)); done; echo made $i`)
	if code != 0 || !strings.Contains(errOut, "No space left on device") {
		t.Fatalf("creating 5000 files on a 16 MiB disk: exit %d: %s %s", code, out, errOut)
	}
	if n := lastInt(t, out); n < 1800 || n > 2600 {
		t.Errorf("made %d files before ENOSPC, want about 2048", n)
	}
}

// TestDiskRefused: bad sizes are refused with a message.
func TestDiskRefused(t *testing.T) {
	needDisks(t)
	for _, size := range []string{"1M", "-5", "99999999T", "2T"} {
		out, code := run(nil, "create", "--base", baseRef, "--disk", size)
		if code == 0 {
			run(nil, "rm", strings.TrimSpace(out))
			t.Errorf("--disk %s: created", size)
			continue
		}
		if !strings.Contains(strings.ToLower(out), "disk") && !strings.Contains(out, "size") {
			t.Errorf("--disk %s: the error does not say what is wrong: %s", size, out)
		}
	}
}

package microvm

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// testImage returns the full-system image of the tests, built once per
// package list with debootstrap and cached under $SHOAL_TEST_CACHE
// (default /var/cache/shoal-test), or skips with the reason.
func testImage(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (debootstrap)")
	}
	if need := ImageNeeds(); need != "" {
		t.Skip(need)
	}
	cache := os.Getenv("SHOAL_TEST_CACHE")
	if cache == "" {
		cache = "/var/cache/shoal-test"
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute) // a hang detector: ~70 s here
	defer cancel()
	start := time.Now()
	img, err := BuildImage(ctx, ImageSpec{Dir: filepath.Join(cache, "fullvm"),
		Logger: slog.New(slog.NewTextHandler(os.Stderr, nil))})
	if err != nil {
		t.Fatalf("build the image: %v", err)
	}
	fi, _ := os.Stat(img)
	t.Logf("image %s: %d MiB, ready in %s", img, fi.Size()>>20, time.Since(start).Round(time.Millisecond))
	return img
}

// A fullvm sandbox: systemd is PID 1 and the system gets to "running";
// exec and files work in the root composed of the sandbox's layers over
// the system; each sandbox's disk is an overlay backed by the one image;
// a second sandbox sees none of the first's writes; pause and resume keep
// the system; delete removes the overlay.
func TestFullVM(t *testing.T) {
	img := testImage(t)
	b, _ := vmTestEnv(t, MachineQ35, func(c *Config) { c.Name, c.Image = "fullvm", filepath.Join(filepath.Dir(img), ImageLink) })
	// A base layer of one file: the commands are the system's.
	root := t.TempDir()
	os.MkdirAll(filepath.Join(root, "etc"), 0o755)
	os.MkdirAll(filepath.Join(root, "work"), 0o755)
	os.WriteFile(filepath.Join(root, "etc", "base-file"), []byte("from the base\n"), 0o644)
	layer := filepath.Join(t.TempDir(), "base.erofs")
	if out, err := exec.Command("mkfs.erofs", "--quiet", "--all-root", layer, root).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.erofs: %v\n%s", err, out)
	}
	imgBefore, err := os.Stat(img)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute) // a hang detector
	defer cancel()

	// Two sandboxes, booted at once.
	type vm struct {
		h   sandbox.Handle
		dir string
		c   *agent.Client
		err error
	}
	vms := make([]*vm, 2)
	done := make(chan *vm, 2)
	start := time.Now()
	for i := range vms {
		sdir, err := os.MkdirTemp("/tmp", "fvm")
		if err != nil {
			t.Fatal(err)
		}
		defer os.RemoveAll(sdir)
		v := &vm{dir: sdir}
		vms[i] = v
		go func(i int) {
			res := sandbox.Resources{MemoryBytes: 512 << 20, MilliCPU: 1000, Pids: 64}
			if i == 0 {
				res.DiskBytes = 512 << 20 // the other: DefaultSystemDisk
			}
			v.h, v.err = b.Create(ctx, sandbox.Spec{ID: "fullvmtest" + string(rune('a'+i)) + "0", Dir: sdir, Env: []string{"FOO=bar"},
				Resources: res,
				Layers:    []sandbox.Layer{{Digest: "sha256:x", Kind: "base", ImagePath: layer}}})
			if v.err == nil {
				t.Logf("sandbox %d: create → agent answers in %s", i, time.Since(start).Round(time.Millisecond))
			}
			done <- v
		}(i)
	}
	for range vms {
		if v := <-done; v.err != nil {
			t.Fatal(v.err)
		}
	}
	for _, v := range vms {
		defer b.Delete(context.Background(), v.h)
		v.c = agent.NewClientDialer(v.h.ID, b.AgentDial(v.h))
	}
	a, c := vms[0], vms[1]

	// A full system: systemd is PID 1 and gets to running (no failed unit).
	if got := run(t, ctx, a.c, "cat", "/proc/1/comm"); got != "systemd\n" {
		t.Errorf("PID 1 is %q, want systemd", got)
	}
	state := run(t, ctx, a.c, "sh", "-c", "systemctl is-system-running --wait; systemctl --failed --no-legend --plain")
	t.Logf("create → system running: %s", time.Since(start).Round(time.Millisecond))
	if strings.TrimSpace(state) != "running" {
		t.Errorf("systemctl is-system-running: %q", state)
	}
	t.Logf("where the boot went:\n%s", run(t, ctx, a.c, "sh", "-c", "systemd-analyze time; systemd-analyze blame --no-pager | head -12; systemd-analyze critical-chain --no-pager shoal-agent.service || true"))
	if got := run(t, ctx, a.c, "systemctl", "is-active", "shoal-agent.service", "systemd-journald.service", "dbus.socket"); got != "active\nactive\nactive\n" {
		t.Errorf("units: %q", got)
	}
	// Its commands' cgroup, below the agent's service (delegated).
	checkGuestPids(t, ctx, a.c, "/system.slice/shoal-agent.service/cmds", 64)
	// The sandbox's layer over the system, its environment, its name.
	if got := run(t, ctx, a.c, "sh", "-c", "echo $FOO; cat /etc/base-file; hostname; test -s /etc/machine-id && echo id"); got != "bar\nfrom the base\n"+hostname(a.h.ID)+"\nid\n" {
		t.Errorf("exec output %q", got)
	}
	if _, err := a.c.WriteFile(ctx, "/work/a.txt", 0o644, strings.NewReader("hello fullvm")); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, ctx, a.c, "/work/a.txt"); got != "hello fullvm" {
		t.Errorf("read back %q", got)
	}
	run(t, ctx, a.c, "sh", "-c", "echo mine > /usr/share/a-marker && sync")
	if got := run(t, ctx, a.c, "cat", "/work/a.txt", "/usr/share/a-marker"); got != "hello fullvmmine\n" {
		t.Errorf("cat %q", got)
	}
	// Each disk is an overlay backed by the one image.
	for _, v := range vms {
		out, err := exec.Command("qemu-img", "info", "--output=json", "-U", filepath.Join(v.dir, rootOverlay)).Output()
		if err != nil {
			t.Fatalf("qemu-img info: %v", err)
		}
		var info struct {
			Format  string `json:"format"`
			Backing string `json:"full-backing-filename"`
		}
		json.Unmarshal(out, &info)
		if info.Format != "qcow2" || info.Backing != img {
			t.Errorf("%s: %s backed by %q, want a qcow2 overlay backed by %s", v.h.ID, info.Format, info.Backing, img)
		}
	}
	// The disk size bounds the writes: the file system grew by it (and
	// the other's by the default).
	for i, v := range vms {
		want := int64(512 << 20)
		if i == 1 {
			want = DefaultSystemDisk
		}
		var size, avail int64
		fmt.Sscan(run(t, ctx, v.c, "df", "-B1", "--output=size,avail", "/"), new(string), new(string), &size, &avail)
		t.Logf("%s: file system %d MiB, %d MiB free", v.h.ID, size>>20, avail>>20)
		if avail < want-32<<20 || avail > want+512<<20 {
			t.Errorf("%s: %d MiB free, want about %d", v.h.ID, avail>>20, want>>20)
		}
	}
	if got := run(t, ctx, a.c, "sh", "-c", "fallocate -l 1G /work/big 2>&1; echo $?; rm -f /work/big"); !strings.Contains(got, "No space left") {
		t.Errorf("1 GiB on a 512 MiB disk: %q", got)
	}
	// The other sandbox sees none of it.
	if got := run(t, ctx, c.c, "sh", "-c", "ls /work/a.txt /usr/share/a-marker 2>&1 || echo absent"); !strings.HasSuffix(got, "absent\n") {
		t.Errorf("the second sandbox sees the first's writes: %q", got)
	}
	// A commit's export: the service agent has the writable layer too
	// (handed over by the initramfs's agent through /run/shoal).
	checkExport(t, ctx, b, c.c, c.h)

	// Pause (a snapshot of RAM and devices; the overlay stays) and resume.
	ps, err := b.Pause(ctx, a.h)
	if err != nil {
		t.Fatal(err)
	}
	st, _ := os.Stat(filepath.Join(a.dir, stateFile))
	t.Logf("pause: RSS before %d MiB, snapshot %d MiB in %s", ps.MemoryBefore>>20, st.Size()>>20, (ps.FreezeTook + ps.ReclaimTook).Round(time.Millisecond))
	rstart := time.Now()
	if a.h, err = b.Resume(ctx, a.h); err != nil {
		t.Fatal(err)
	}
	a.c = agent.NewClientDialer(a.h.ID, b.AgentDial(a.h))
	if got := run(t, ctx, a.c, "sh", "-c", "cat /work/a.txt; systemctl is-system-running"); got != "hello fullvmrunning\n" {
		t.Errorf("after resume: %q", got)
	}
	t.Logf("resume → first exec: %s", time.Since(rstart).Round(time.Millisecond))
	if st, _ := b.Recover(ctx, a.h); st != sandbox.StatusRunning {
		t.Errorf("recover: %s", st)
	}

	// Delete ends QEMU and removes the overlay; the image is unchanged.
	if err := b.Delete(ctx, a.h); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(a.dir, rootOverlay)); !os.IsNotExist(err) {
		t.Errorf("overlay after delete: %v", err)
	}
	if ok, _ := b.Alive(a.h); ok {
		t.Error("alive after delete")
	}
	if imgAfter, err := os.Stat(img); err != nil || !imgAfter.ModTime().Equal(imgBefore.ModTime()) || imgAfter.Size() != imgBefore.Size() {
		t.Errorf("the image changed: %v", err)
	}
}

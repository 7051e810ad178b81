package microvm

import (
	"context"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/egress"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// With templates (Config.Boot BootTemplate), the first VM of a shape boots
// and has its template made after it; the next ones restore it, each with
// its own devices and config: the layer, the writable disk, the
// environment and host name, a random generator of its own, the host's
// time. One of another shape (more memory) boots. A template whose
// restore fails is dropped and the create boots.
func TestVMTemplate(t *testing.T) {
	b, img := vmTestEnv(t, MachineMicroVM, func(c *Config) { c.Boot = BootTemplate; c.CgroupParent = "shoal-test-vmtpl" })
	if b.LayerDevices() != LayersBlk {
		t.Fatalf("layers as %s with templates, want blk", b.LayerDevices())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	disk := int64(0)
	if b.disks != nil {
		disk = 64 << 20
	}
	create := func(name string, mem int64) (sandbox.Handle, *agent.Client, time.Duration) {
		t.Helper()
		sdir, err := os.MkdirTemp("/tmp", "vmtpl")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(sdir) })
		start := time.Now()
		h, err := b.Create(ctx, sandbox.Spec{ID: "tpl-test-" + name, Dir: sdir, Env: []string{"WHO=" + name},
			Resources: sandbox.Resources{MemoryBytes: mem, MilliCPU: 1000, DiskBytes: disk},
			Layers:    []sandbox.Layer{{Digest: "sha256:x", Kind: "base", ImagePath: img}}})
		if err != nil {
			t.Fatalf("create %s: %v", name, err)
		}
		took := time.Since(start)
		t.Cleanup(func() { b.Delete(context.Background(), h) })
		t.Logf("%s: %s in %s", name, h.Data["boot"], took)
		return h, agent.NewClientDialer(h.ID, b.AgentDial(h)), took
	}
	first, c1, _ := create("first", 256<<20)
	if first.Data["boot"] != BootCold {
		t.Fatalf("the first VM of its shape: boot %q, want %s", first.Data["boot"], BootCold)
	}
	key, ok := b.templateKey(first)
	if !ok {
		t.Fatal("no template key for a blk microVM")
	}
	deadline := time.Now().Add(4 * time.Minute)
	for b.tpl.get(key) == "" {
		b.tpl.mu.Lock()
		why := b.tpl.refused[key]
		b.tpl.mu.Unlock()
		if why != "" {
			t.Fatalf("template not made: %s", why)
		}
		if time.Now().After(deadline) {
			t.Fatal("no template 4 minutes after the first create")
		}
		time.Sleep(100 * time.Millisecond)
	}
	if fi, err := os.Stat(b.tpl.get(key)); err == nil {
		t.Logf("template %s: %d MiB", key, fi.Size()>>20)
	}
	var clients []*agent.Client
	var handles []sandbox.Handle
	for _, name := range []string{"second", "third"} {
		h, c, _ := create(name, 256<<20)
		handles = append(handles, h)
		if h.Data["boot"] != BootTemplate {
			t.Fatalf("%s: boot %q, want %s", name, h.Data["boot"], BootTemplate)
		}
		clients = append(clients, c)
		if got := run(t, ctx, c, "sh", "-c", "echo $WHO; cat /etc/base-file; uname -n"); got != name+"\nfrom the base\n"+hostname(h.ID)+"\n" {
			t.Errorf("%s: %q", name, got)
		}
		// Its own writable layer (its disk, if the node makes disks).
		if _, err := c.WriteFile(ctx, "/work/mine", 0o644, strings.NewReader(name)); err != nil {
			t.Fatal(err)
		}
		if disk > 0 {
			// The root's size is its writable layer's: the 64 MiB disk
			// (a tmpfs would be half the guest's memory).
			out := run(t, ctx, c, "sh", "-c", "df -k / | tail -1")
			if f := strings.Fields(out); len(f) < 2 || f[1] < "60000" || f[1] > "66000" || len(f[1]) != 5 {
				t.Errorf("%s: the root is not on its 64 MiB disk: %s", name, out)
			}
		}
		// The host's time, not the template's.
		out := strings.TrimSpace(run(t, ctx, c, "sh", "-c", "cut -d. -f1 /proc/uptime; date +%s"))
		f := strings.Fields(out)
		if len(f) != 2 {
			t.Fatalf("uptime and date: %q", out)
		}
		if sec, _ := strconv.ParseInt(f[1], 10, 64); time.Since(time.Unix(sec, 0)).Abs() > 3*time.Second {
			t.Errorf("%s: the guest's clock says %s, the host's %s", name, time.Unix(sec, 0), time.Now())
		}
	}
	if got := run(t, ctx, clients[0], "cat", "/work/mine"); got != "second" {
		t.Errorf("second's file: %q", got)
	}
	if got := run(t, ctx, clients[1], "cat", "/work/mine"); got != "third" {
		t.Errorf("third's file: %q", got)
	}
	r1 := run(t, ctx, clients[0], "sh", "-c", "dd if=/dev/urandom bs=16 count=1 2>/dev/null | od -An -tx1; cat /proc/sys/kernel/random/boot_id")
	r2 := run(t, ctx, clients[1], "sh", "-c", "dd if=/dev/urandom bs=16 count=1 2>/dev/null | od -An -tx1; cat /proc/sys/kernel/random/boot_id")
	if r1 == r2 {
		t.Errorf("two VMs of one template draw the same random bytes and boot ID:\n%s", r1)
	}
	_ = c1
	// A VM from a template pauses and resumes as any other.
	if _, err := b.Pause(ctx, handles[0]); err != nil {
		t.Fatalf("pause: %v", err)
	}
	nh, err := b.Resume(ctx, handles[0])
	if err != nil {
		t.Fatalf("resume: %v", err)
	}
	if got := run(t, ctx, agent.NewClientDialer(nh.ID, b.AgentDial(nh)), "cat", "/work/mine"); got != "second" {
		t.Errorf("second's file after a pause: %q", got)
	}
	// Another shape boots.
	if h, _, _ := create("bigger", 384<<20); h.Data["boot"] != BootCold {
		t.Errorf("a VM of another shape: boot %q, want %s", h.Data["boot"], BootCold)
	}
	// A template that cannot be restored (a damaged snapshot) is dropped
	// and the create boots.
	if err := os.WriteFile(b.tpl.get(key), []byte("not a snapshot"), 0o600); err != nil {
		t.Fatal(err)
	}
	if h, c, _ := create("fallback", 256<<20); h.Data["boot"] != BootCold {
		t.Errorf("after a failed restore: boot %q, want %s", h.Data["boot"], BootCold)
	} else if got := run(t, ctx, c, "cat", "/etc/base-file"); got != "from the base\n" {
		t.Errorf("fallback: %q", got)
	}
	if b.tpl.get(key) != "" {
		t.Error("the damaged template is still used")
	}
	// The other shape's template, made meanwhile: its QEMU gone when it is.
	for deadline := time.Now().Add(4 * time.Minute); ; time.Sleep(100 * time.Millisecond) {
		b.tpl.mu.Lock()
		n := len(b.tpl.making)
		b.tpl.mu.Unlock()
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("a template still being made 4 minutes later")
		}
	}
	if ents, _ := os.ReadDir(b.tpl.dir); len(ents) > 1 {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("left in %s: %v", filepath.Base(b.tpl.dir), names)
	}
}

// A template's key is its shape: what a restore must match (memory, CPUs,
// device count, accelerator) changes it, the sandbox's own files do not;
// pmem layers, network egress and full systems have none.
func TestTemplateKey(t *testing.T) {
	dir := t.TempDir()
	b := &Backend{cfg: Config{Machine: MachineMicroVM, QEMU: "qemu-system-x86_64"}, kernel: filepath.Join(dir, "vmlinux"), initrd: filepath.Join(dir, "initrd"), tpl: &templates{}}
	h := func(mod func(map[string]string)) sandbox.Handle {
		d := map[string]string{"dir": "/x/a", "accel": "tcg", "mem": "268435456", "cpus": "1", "layers": `["/l/a.erofs"]`, "balloon": "1"}
		if mod != nil {
			mod(d)
		}
		return sandbox.Handle{ID: "a", Data: d}
	}
	base, ok := b.templateKey(h(nil))
	if !ok {
		t.Fatal("no key for a blk microVM")
	}
	if k, _ := b.templateKey(h(func(d map[string]string) { d["dir"], d["layers"] = "/x/b", `["/l/b.erofs"]` })); k != base {
		t.Error("another sandbox's files changed the key")
	}
	for name, mod := range map[string]func(map[string]string){
		"memory": func(d map[string]string) { d["mem"] = "536870912" },
		"cpus":   func(d map[string]string) { d["cpus"] = "2" },
		"layers": func(d map[string]string) { d["layers"] = `["/l/a","/l/b"]` },
		"disk":   func(d map[string]string) { d["disk"] = "1073741824" },
		"accel":  func(d map[string]string) { d["accel"] = "kvm" },
	} {
		if k, ok := b.templateKey(h(mod)); !ok || k == base {
			t.Errorf("%s: key %q (%v), the same as the base shape's", name, k, ok)
		}
	}
	for name, mod := range map[string]func(map[string]string){
		"pmem":   func(d map[string]string) { d["pmem"] = "{}" },
		"egress": func(d map[string]string) { d[egress.DataSlot] = "3" },
		"system": func(d map[string]string) { d["image"] = "/i/overlay.qcow2" },
	} {
		if _, ok := b.templateKey(h(mod)); ok {
			t.Errorf("%s: a template key", name)
		}
	}
	if _, ok := (&Backend{cfg: b.cfg}).templateKey(h(nil)); ok {
		t.Error("a key without templates")
	}
}

// At most maxTemplates are kept: the least recently used goes, file and
// all; a dropped template is not made again.
func TestTemplatesBound(t *testing.T) {
	tp, err := newTemplates(filepath.Join(t.TempDir(), "templates"))
	if err != nil {
		t.Fatal(err)
	}
	state := func(i int) string { return filepath.Join(tp.dir, strconv.Itoa(i)+".state") }
	for i := 0; i <= maxTemplates; i++ {
		if i == maxTemplates {
			tp.get("0") // the first is used again: the second is the oldest
			time.Sleep(time.Millisecond)
		}
		if !tp.claim(strconv.Itoa(i)) {
			t.Fatalf("claim %d", i)
		}
		if tp.claim(strconv.Itoa(i)) {
			t.Fatalf("claimed %d twice", i)
		}
		os.WriteFile(state(i), []byte("x"), 0o600)
		tp.done(strconv.Itoa(i), state(i), nil)
		time.Sleep(time.Millisecond)
	}
	if tp.get("1") != "" {
		t.Error("the least recently used template is kept")
	}
	if _, err := os.Stat(state(1)); !os.IsNotExist(err) {
		t.Errorf("its file: %v", err)
	}
	if tp.get("0") == "" || tp.get(strconv.Itoa(maxTemplates)) == "" {
		t.Error("a recently used template went")
	}
	tp.drop("0", "restore failed")
	if tp.get("0") != "" {
		t.Error("a dropped template is used")
	}
	// Made again once; a second failed restore is the last.
	if !tp.claim("0") {
		t.Fatal("a template dropped once is not made again")
	}
	tp.done("0", state(0), nil)
	tp.drop("0", "restore failed again")
	if tp.claim("0") {
		t.Error("a template dropped twice is made again")
	}
	tp.done("9x", "", os.ErrInvalid)
	if tp.claim("9x") {
		t.Error("a template whose making failed is made again")
	}
}

// A template's QEMU left running by a process that died while making it
// (QEMU has a session of its own) is ended when the backend starts again,
// and its directory removed.
func TestSweepTemplates(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "templates")
	left := filepath.Join(dir, "0123456789abcdef.42")
	if err := os.MkdirAll(left, 0o700); err != nil {
		t.Fatal(err)
	}
	// Not a QEMU, but its command line names the template's channel as
	// one does (what pidfileProcess checks).
	cmd := exec.Command("sh", "-c", "sleep 600; :", "qemu", agentChardev(left))
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	t.Cleanup(func() { cmd.Process.Kill() })
	os.WriteFile(filepath.Join(left, "qemu.pid"), []byte(strconv.Itoa(cmd.Process.Pid)), 0o600)
	// Start returns once the exec has begun (its close-on-exec pipe
	// closed), which is before the kernel sets the new command line: a
	// sweep at once could read an empty one and leave the process alone.
	for deadline := time.Now().Add(10 * time.Second); pidfileProcess(left) == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the left template's process never showed its command line")
		}
	}
	b := &Backend{log: slog.New(slog.DiscardHandler)}
	b.sweepTemplates(dir)
	select {
	case <-exited:
	case <-time.After(10 * time.Second):
		t.Fatal("the left template's process still runs")
	}
	tp, err := newTemplates(dir)
	if err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(tp.dir); len(ents) != 0 {
		t.Errorf("left in the templates' directory: %v", ents)
	}
}

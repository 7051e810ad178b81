package microvm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// vmTestEnv returns a backend on this host's QEMU and guest kernel (forced
// to TCG unless $SHOAL_VM_ACCEL says otherwise: KVM may hang here) and a
// busybox base layer image, or skips with the reason.
func vmTestEnv(t *testing.T, machine string, opts ...func(*Config)) (*Backend, string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (QEMU, mkfs.erofs images)")
	}
	kdir := os.Getenv("SHOAL_VM_KERNEL_DIR")
	if kdir == "" {
		kdir = DefaultKernelDir
	}
	cfg := Config{Machine: machine, KernelDir: kdir, StateDir: t.TempDir(), Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))}
	if err := cfg.Check(); err != nil {
		t.Skipf("no VMs on this host: %v", err)
	}
	for _, b := range []string{"mkfs.erofs", "busybox"} {
		if _, err := exec.LookPath(b); err != nil {
			t.Skipf("needs %s", b)
		}
	}
	if os.Getenv("SHOAL_VM_ACCEL") == "" {
		cfg.Accel = "tcg"
	}
	// SHOAL_VM_LAYERS=blk|pmem: the microvm tests with one layer mode
	// (default auto: pmem where the guest kernel has it).
	if machine == MachineMicroVM {
		cfg.Layers = os.Getenv("SHOAL_VM_LAYERS")
	}
	for _, o := range opts {
		o(&cfg)
	}
	dir := t.TempDir()
	cfg.AgentBinary = filepath.Join(dir, "shoal-agent")
	build := exec.Command("go", "build", "-o", cfg.AgentBinary, "github.com/shoal-sandbox/shoal/cmd/shoal-agent")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build agent: %v\n%s", err, out)
	}
	root := filepath.Join(dir, "root")
	for _, d := range []string{"bin", "etc", "tmp", "proc", "sys", "dev", "work"} {
		os.MkdirAll(filepath.Join(root, d), 0o755)
	}
	bb, _ := exec.LookPath("busybox")
	data, err := os.ReadFile(bb)
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(root, "bin", "busybox"), data, 0o755)
	for _, a := range []string{"sh", "cat", "echo", "ls", "mount", "uname", "sleep", "dd", "rm", "sync", "df", "stat"} {
		os.Symlink("busybox", filepath.Join(root, "bin", a))
	}
	os.WriteFile(filepath.Join(root, "etc", "base-file"), []byte("from the base\n"), 0o644)
	img := filepath.Join(dir, "base.erofs")
	if out, err := exec.Command("mkfs.erofs", "--quiet", "--all-root", img, root).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.erofs: %v\n%s", err, out)
	}
	b, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return b, img
}

func run(t *testing.T, ctx context.Context, c *agent.Client, args ...string) string {
	t.Helper()
	p, err := c.Exec(ctx, agent.ExecRequest{Args: args})
	if err != nil {
		t.Fatalf("exec %v: %v", args, err)
	}
	defer p.Close()
	var out bytes.Buffer
	for {
		ev, err := p.Recv()
		if err != nil {
			t.Fatalf("exec %v: %v (output %q)", args, err, out.String())
		}
		if ev.Kind == agent.EventExit {
			if ev.Exit.Code != 0 {
				t.Fatalf("exec %v: exit %+v: %s", args, ev.Exit, out.String())
			}
			return out.String()
		}
		out.Write(ev.Data)
	}
}

// A VM sandbox end to end: boot from an EROFS layer device, exec, files
// both ways (the layer's file is read through the overlay, a written one
// lands in the writable layer), a guest that cannot see the host's files,
// and a delete that ends QEMU.
func TestVMCreateExecFilesDelete(t *testing.T) {
	for _, m := range []string{MachineMicroVM, MachineQ35} {
		t.Run(m, func(t *testing.T) {
			t.Parallel()
			testVMCreateExecFilesDelete(t, m)
		})
	}
}

func testVMCreateExecFilesDelete(t *testing.T, machine string) {
	// Its QEMU in cgroups of its own (a best-effort VM's: TestVMCgroup).
	b, img := vmTestEnv(t, machine, func(c *Config) { c.CgroupParent = "shoal-test-vm" })
	res := sandbox.Resources{MemoryBytes: 256 << 20, MilliCPU: 1000, Pids: 64}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	sdir, err := os.MkdirTemp("/tmp", "vmt") // short: unix socket paths
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(sdir)
	start := time.Now()
	h, err := b.Create(ctx, sandbox.Spec{ID: "vmtest-" + machine, Dir: sdir, Env: []string{"FOO=bar"},
		Resources: res,
		Layers:    []sandbox.Layer{{Digest: "sha256:x", Kind: "base", ImagePath: img}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("booted (%s) in %s", h.Data["accel"], time.Since(start))
	deleted := false
	defer func() {
		if !deleted {
			b.Delete(context.Background(), h)
		}
	}()
	if ok, _ := b.Alive(h); !ok {
		t.Fatal("not alive after create")
	}
	c := agent.NewClientDialer(h.ID, b.AgentDial(h))
	if got := run(t, ctx, c, "sh", "-c", "echo $FOO; cat /etc/base-file"); got != "bar\nfrom the base\n" {
		t.Errorf("exec output %q", got)
	}
	// Commands start at nice 0, below the agent's threads (the guest's
	// agent sets its own: agent.AgentNice).
	sched := run(t, ctx, c, "sh", "-c", "cut -d' ' -f19 /proc/self/stat; cat /proc/$PPID/task/*/stat | sed 's/.*) //' | cut -d' ' -f17 | sort | uniq -c")
	if want := fmt.Sprintf(" %d\n", agent.AgentNice); !strings.HasPrefix(sched, "0\n") || !strings.Contains(sched, want) {
		t.Errorf("a command's nice value, then the agent's threads' (count, nice):\n%s", sched)
	}
	checkGuestPids(t, ctx, c, "/cmds", res.Pids)
	if _, err := c.WriteFile(ctx, "/work/a.txt", 0o644, strings.NewReader("hello vm")); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, ctx, c, "/work/a.txt"); got != "hello vm" {
		t.Errorf("read back %q", got)
	}
	if got := run(t, ctx, c, "cat", "/work/a.txt"); got != "hello vm" {
		t.Errorf("cat %q", got)
	}
	// The guest's root is its layers and writable layer: the host's files
	// (this test's own directory, say) are not there.
	if out := run(t, ctx, c, "sh", "-c", "ls / ; test -e "+sdir+" && echo HOST-VISIBLE || true"); strings.Contains(out, "HOST-VISIBLE") {
		t.Errorf("the guest sees the host's %s: %s", sdir, out)
	}
	groups := checkCgroup(t, h, res)
	if u := b.Usage(h); groups != nil && (u.MemoryBytes < 32<<20 || u.CPUUsec <= 0) {
		t.Errorf("a booted VM's usage from its groups: %+v", u)
	}
	checkFreePageReporting(t, ctx, c, h)
	// Several requests at once share the one channel.
	errs := make(chan error, 8)
	for i := 0; i < 8; i++ {
		go func() {
			_, err := c.Stat(ctx, "/etc/base-file")
			errs <- err
		}()
	}
	for i := 0; i < 8; i++ {
		if err := <-errs; err != nil {
			t.Errorf("concurrent stat: %v", err)
		}
	}
	checkExport(t, ctx, b, c, h)
	measureExport(t, ctx, b, c, h)
	checkHalfClose(t, ctx, c)
	// The host's end of the channel goes away (as when the server
	// restarts): the next request dials the VM's socket again and the
	// guest serves the new session.
	b.mu.Lock()
	b.muxes[h.ID].close()
	b.mu.Unlock()
	rctx, rcancel := context.WithTimeout(ctx, time.Minute)
	if got := run(t, rctx, agent.NewClientDialer(h.ID, b.AgentDial(h)), "cat", "/work/a.txt"); got != "hello vm" {
		t.Errorf("after the channel was re-dialed: %q", got)
	}
	rcancel()
	// Deleted through the handle the node persists before the create
	// ends (a crash in the middle leaves only that): the sandbox's
	// directory, where QEMU's pidfile names it.
	if err := b.Delete(ctx, sandbox.Handle{ID: h.ID, Backend: h.Backend, Data: map[string]string{"dir": sdir}}); err != nil {
		t.Fatal(err)
	}
	deleted = true
	if ok, _ := b.Alive(h); ok {
		t.Error("alive after delete")
	}
	for _, g := range groups {
		if _, err := os.Stat(g); !os.IsNotExist(err) {
			t.Errorf("cgroup %s left after delete: %v", g, err)
		}
	}
	if st, _ := b.Recover(ctx, h); st != sandbox.StatusStopped {
		t.Errorf("recover after delete: %s", st)
	}
	if err := b.Delete(ctx, h); err != nil {
		t.Errorf("second delete: %v", err)
	}
}

// checkCgroup: the VM's QEMU, every thread of it, is in its own groups
// (cgroup v1 here) with the sandbox's limits: memory (guest RAM plus
// QEMU's overhead, memory+swap the same), tasks, CPU quota; a
// best-effort VM's cpu group under the idle parent. It returns the
// groups' directories.
func checkCgroup(t *testing.T, h sandbox.Handle, res sandbox.Resources) []string {
	t.Helper()
	if _, err := os.Stat("/sys/fs/cgroup/memory/memory.limit_in_bytes"); err != nil {
		t.Log("no cgroup v1 memory hierarchy: cgroups not checked")
		return nil
	}
	pid := h.Data["pid"]
	cpuParent := "/shoal-test-vm/"
	if res.BestEffort {
		cpuParent = "/shoal-test-vm-be/"
	}
	var groups []string
	tasks, _ := filepath.Glob("/proc/" + pid + "/task/*/cgroup")
	if len(tasks) == 0 {
		t.Fatalf("no process %s", pid)
	}
	for _, task := range tasks {
		data, err := os.ReadFile(task)
		if err != nil {
			continue
		}
		for _, l := range strings.Split(strings.TrimSpace(string(data)), "\n") {
			f := strings.SplitN(l, ":", 3)
			if len(f) != 3 {
				continue
			}
			want := ""
			switch f[1] {
			case "memory", "pids", "cpuacct":
				want = "/shoal-test-vm/" + h.ID
			case "cpu", "cpu,cpuacct":
				want = cpuParent + h.ID
			}
			if want != "" && f[2] != want {
				t.Errorf("%s: %s group %s, want %s", task, f[1], f[2], want)
			}
		}
	}
	mem := "/sys/fs/cgroup/memory/shoal-test-vm/" + h.ID
	cpu := "/sys/fs/cgroup/cpu" + cpuParent + h.ID
	pids := "/sys/fs/cgroup/pids/shoal-test-vm/" + h.ID
	for file, want := range map[string]string{
		mem + "/memory.limit_in_bytes": strconv.FormatInt(res.MemoryBytes+qemuOverhead, 10),
		pids + "/pids.max":             strconv.Itoa(qemuPids),
		cpu + "/cpu.cfs_quota_us":      strconv.FormatInt(res.MilliCPU*cpuPeriod/1000, 10),
	} {
		data, err := os.ReadFile(file)
		if err != nil || strings.TrimSpace(string(data)) != want {
			t.Errorf("%s = %q (%v), want %s", file, data, err, want)
		}
	}
	if res.BestEffort {
		if data, err := os.ReadFile("/sys/fs/cgroup/cpu/shoal-test-vm-be/cpu.idle"); err == nil && strings.TrimSpace(string(data)) != "1" {
			t.Errorf("the best-effort parent is not idle: %q", data)
		}
	}
	return append(groups, mem, cpu, pids)
}

// checkFreePageReporting: memory the guest frees goes back to the host
// (virtio-balloon free page reporting): QEMU's resident memory grows while
// the guest holds 96 MiB in a tmpfs and shrinks again once it frees them.
func checkFreePageReporting(t *testing.T, ctx context.Context, c *agent.Client, h sandbox.Handle) {
	t.Helper()
	pid, err := strconv.Atoi(h.Data["pid"])
	if err != nil {
		t.Fatalf("no QEMU pid in the handle: %v", h.Data)
	}
	before := rss(pid)
	run(t, ctx, c, "dd", "if=/dev/zero", "of=/dev/shm/fill", "bs=1M", "count=96")
	held := rss(pid)
	run(t, ctx, c, "rm", "/dev/shm/fill")
	deadline := time.Now().Add(60 * time.Second) // a hang detector: reporting runs within seconds
	after := rss(pid)
	for held-after < 64<<20 && time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond)
		after = rss(pid)
	}
	t.Logf("QEMU RSS: %d MiB idle, %d MiB with 96 MiB held in the guest, %d MiB after the guest freed them", before>>20, held>>20, after>>20)
	if held-before < 64<<20 {
		t.Fatalf("QEMU RSS grew by %d MiB while the guest held 96 MiB: the measure does not work", (held-before)>>20)
	}
	if held-after < 64<<20 {
		t.Errorf("QEMU RSS fell by %d MiB after the guest freed 96 MiB, want at least 64: free pages are not reported", (held-after)>>20)
	}
}

// readFile reads a file of the guest through its agent.
// checkGuestPids: the guest's commands are in their cgroup (group, in the
// guest's hierarchy), with the sandbox's pids limit, which a fork loop
// reaches without harm to the agent; the loop's tasks gone, commands start
// again.
func checkGuestPids(t *testing.T, ctx context.Context, c *agent.Client, group string, pids int64) {
	t.Helper()
	dir := "/sys/fs/cgroup" + group
	if got := readFile(t, ctx, c, dir+"/pids.max"); got != fmt.Sprintf("%d\n", pids) {
		t.Errorf("the commands' pids.max %q, want %d", got, pids)
	}
	if got := run(t, ctx, c, "cat", "/proc/self/cgroup"); got != "0::"+group+"\n" {
		t.Errorf("a command's cgroup %q, want %s", got, group)
	}
	// More tasks than the limit: the shell's forks fail past it (and it
	// gives up), whatever its exit. The tasks live until the shell ends
	// (its process group killed on exit), so the limit is reached however
	// slowly a loaded TCG guest forks (with tasks that end by themselves,
	// a slow loop never held 64 at once).
	p, err := c.Exec(ctx, agent.ExecRequest{Args: []string{"sh", "-c", "trap 'kill -9 0' EXIT; i=0; while [ $i -lt 100 ]; do sleep 1000 & i=$((i+1)); done"}})
	if err != nil {
		t.Fatal(err)
	}
	for {
		ev, err := p.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if ev.Kind == agent.EventExit {
			break
		}
	}
	p.Close()
	if ev := readFile(t, ctx, c, dir+"/pids.events"); !strings.HasPrefix(ev, "max ") || ev == "max 0\n" {
		t.Errorf("the fork loop never reached the limit: pids.events %q", ev)
	}
	deadline := time.Now().Add(30 * time.Second) // a hang detector
	for readFile(t, ctx, c, dir+"/pids.current") != "0\n" {
		if time.Now().After(deadline) {
			t.Fatal("the fork loop's tasks stay")
		}
		time.Sleep(100 * time.Millisecond)
	}
	run(t, ctx, c, "sh", "-c", ":")
}

func readFile(t *testing.T, ctx context.Context, c *agent.Client, path string) string {
	t.Helper()
	r, _, err := c.ReadFile(ctx, path)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	got, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	return string(got)
}

// A guest that powers off while it boots (here its init cannot mount a
// layer that is not EROFS) takes its console with its QEMU; the boot error
// still quotes the agent's last words, read while it booted.
func TestVMBootFailureSaysWhy(t *testing.T) {
	b, _ := vmTestEnv(t, MachineMicroVM)
	bad := filepath.Join(t.TempDir(), "bad.erofs")
	if err := os.WriteFile(bad, make([]byte, 4<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	sdir, err := os.MkdirTemp("/tmp", "vmt")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(sdir)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	h, err := b.Create(ctx, sandbox.Spec{ID: "vmbad", Dir: sdir, Resources: sandbox.Resources{MemoryBytes: 256 << 20, MilliCPU: 1000},
		Layers: []sandbox.Layer{{Digest: "sha256:x", Kind: "base", ImagePath: bad}}})
	if err == nil {
		b.Delete(context.Background(), h)
		t.Fatal("a VM whose layer is not EROFS booted")
	}
	t.Logf("boot error: %v", err)
	if !strings.Contains(err.Error(), "console:") || !strings.Contains(err.Error(), "vm boot:") {
		t.Errorf("the boot error does not say what the guest said: %v", err)
	}
}

// How many virtio devices fit: a microvm's transports under KVM's in-kernel
// interrupt controller (8) and otherwise (24).
func TestVirtioBudget(t *testing.T) {
	if got := virtioSlots(MachineMicroVM, "kvm"); got != 8 {
		t.Errorf("microvm under kvm: %d", got)
	}
	if got := virtioSlots(MachineMicroVM, "tcg"); got != 24 {
		t.Errorf("microvm under tcg: %d", got)
	}
	if got := virtioDevices(5, false, false, false); got != 8 {
		t.Errorf("5 block layers: %d devices", got)
	}
	if got := virtioDevices(5, true, true, false); got != 10 {
		t.Errorf("5 block layers, a disk, a link: %d devices", got)
	}
	if MaxLayers != virtioSlots(MachineMicroVM, "tcg")-virtioDevices(0, false, false, false) {
		t.Errorf("MaxLayers %d", MaxLayers)
	}
}

// A VM of many layers (more than the 8 virtio-mmio transports a microvm
// has without its second IOAPIC): each is a block device, stacked in
// order, the top one winning; past what the VM has room for, the create
// is refused before anything starts.
func TestVMManyLayers(t *testing.T) {
	b, base := vmTestEnv(t, MachineMicroVM, func(c *Config) { c.Layers = LayersBlk })
	if accel, _, err := b.Accel(context.Background()); err != nil || accel != "tcg" {
		t.Skipf("accel %s, %v: the second IOAPIC is TCG's here", accel, err)
	}
	dir := t.TempDir()
	const n = 12
	layers := []sandbox.Layer{}
	for i := n - 1; i >= 1; i-- { // top first
		root := filepath.Join(dir, fmt.Sprintf("r%d", i))
		os.MkdirAll(filepath.Join(root, "layers"), 0o755)
		os.MkdirAll(filepath.Join(root, "etc"), 0o755)
		os.WriteFile(filepath.Join(root, "layers", strconv.Itoa(i)), nil, 0o644)
		os.WriteFile(filepath.Join(root, "etc", "who"), []byte(strconv.Itoa(i)+"\n"), 0o644)
		img := filepath.Join(dir, fmt.Sprintf("l%d.erofs", i))
		if out, err := exec.Command("mkfs.erofs", "--quiet", "--all-root", img, root).CombinedOutput(); err != nil {
			t.Fatalf("mkfs.erofs: %v\n%s", err, out)
		}
		layers = append(layers, sandbox.Layer{Digest: fmt.Sprintf("sha256:%d", i), Kind: "toolkit", ImagePath: img})
	}
	layers = append(layers, sandbox.Layer{Digest: "sha256:x", Kind: "base", ImagePath: base})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	sdir, err := os.MkdirTemp("/tmp", "vmt")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(sdir)
	h, err := b.Create(ctx, sandbox.Spec{ID: "vmlayers", Dir: sdir, Resources: sandbox.Resources{MemoryBytes: 256 << 20}, Layers: layers})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Delete(context.Background(), h)
	c := agent.NewClientDialer(h.ID, b.AgentDial(h))
	if got := run(t, ctx, c, "sh", "-c", "cat /etc/who /etc/base-file; ls /layers | wc -l"); got != fmt.Sprintf("%d\nfrom the base\n%d\n", n-1, n-1) {
		t.Errorf("the stacked layers: %q", got)
	}
	// One layer more than MaxLayers is refused at once.
	many := make([]sandbox.Layer, MaxLayers+1)
	for i := range many {
		many[i] = layers[0]
	}
	if _, err := b.Create(ctx, sandbox.Spec{ID: "vmlayers2", Dir: t.TempDir(), Layers: many}); !errors.Is(err, sandbox.ErrUnsupported) {
		t.Errorf("%d layers: %v", len(many), err)
	}
}

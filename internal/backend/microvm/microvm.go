// Package microvm is the sandbox backend that runs each sandbox in its own
// QEMU virtual machine: `-M microvm` (the "microvm" backend) or, with the
// same code and another machine type, a q35 PC with PCI devices that boots
// a full Debian system from a qcow2 overlay of a base image ("fullvm":
// fullvm.go, image.go).
//
// A guest boots Debian's cloud kernel (scripts/vmkernel.sh puts it in
// Config.KernelDir) with an initramfs that this package builds from the
// static shoal-agent (as /init) and the few modules the guest loads. Each
// read-only layer is attached as a read-only virtio-blk device of its EROFS
// image, found in the guest by its serial number, or as persistent memory
// that the guest mounts with DAX, sharing the host's page cache of the
// image with every other VM (Config.Layers, pmem.go); the agent stacks them
// under a writable layer (a tmpfs, or the disk) with overlayfs in the
// order a container's root has (internal/agent/vminit), switches root and
// serves the usual agent protocol on a virtio-serial port. On the host that
// port is a pair of FIFOs (QEMU's pipe chardev: the sandbox's agent.in and
// agent.out)
// carrying one yamux session at a time, each begun with a handshake
// (vminit.DialLink): AgentDial opens one stream per request. FIFOs and not
// a socket chardev: QEMU holds both open for the VM's life, so there is no
// connection state (a socket chardev fails the guest's writes while no
// host is connected, as when a node restarts); what the guest writes while
// no host reads waits in the FIFO, and QEMU throttles the port when it is
// full.
//
// Acceleration: KVM when /dev/kvm exists and a probe guest boots on it
// within a short timeout, else TCG (logged with the reason);
// Config.Accel or $SHOAL_VM_ACCEL forces one.
//
// Pause writes the VM's whole state to a file in the sandbox's directory
// and ends QEMU; Resume restores it in a new QEMU (pause.go).
//
// A disk size puts the writable layer on an ext4 image (disk.go); every VM
// has a virtio-balloon with free page reporting, so freed guest memory goes
// back to the host.
//
// Commit: the guest's agent streams the writable layer (commit.go).
//
// No network but loopback, unless the sandbox asks for egress: then a tap
// on the host under the node's egress rules, and a virtio-net device
// (egress.go).
package microvm

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/yamux"
	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/agent/vminit"
	"github.com/shoal-sandbox/shoal/internal/diskimg"
	"github.com/shoal-sandbox/shoal/internal/egress"
	"github.com/shoal-sandbox/shoal/internal/reclaim"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// Machine types.
const (
	MachineMicroVM = "microvm"
	MachineQ35     = "q35"
)

// Defaults.
const (
	DefaultKernelDir = "/usr/local/lib/shoal/vm"
	// MinMemoryBytes is the least guest RAM: the kernel and the initramfs
	// need about 100 MiB; a smaller request gets this much.
	MinMemoryBytes = 160 << 20
	// MaxLayers bounds a VM's layers: the virtio devices of the roomiest
	// VM (virtioSlots) but its agent's port, config and balloon.
	MaxLayers = maxVirtio - 3
	// ProbeTimeout bounds the boot of the KVM probe guest.
	ProbeTimeout = 10 * time.Second
)

// Config configures a Backend.
type Config struct {
	// Name is the backend's name ("microvm" or "fullvm"); Machine its QEMU
	// machine type (MachineMicroVM or MachineQ35).
	Name    string
	Machine string
	// QEMU is the emulator binary (default qemu-system-x86_64 on PATH).
	QEMU string
	// KernelDir holds vmlinux (PVH, preferred) or vmlinuz, and modules/.
	KernelDir string
	// StateDir is where the built initramfs files live.
	StateDir    string
	AgentBinary string
	// Image, if set, is the base image of a full system (fullvm.go): each
	// sandbox boots it from a copy-on-write overlay. A symlink is
	// resolved at each create.
	Image string
	// Accel: "auto" (default: $SHOAL_VM_ACCEL, else probe KVM), "kvm" or "tcg".
	Accel string
	// BootTimeout bounds a guest's boot to its agent's first answer when
	// the create's context has no deadline (default 60 s with KVM, 180 s
	// with TCG).
	BootTimeout time.Duration
	// CgroupParent: each VM's QEMU runs in CgroupParent/ID in every
	// hierarchy, with the sandbox's limits (cgroup.go); "": no cgroups.
	CgroupParent string
	// Layers: how layers reach a microVM's guest: "pmem" (persistent
	// memory, mounted with DAX: pmem.go), "blk" (read-only virtio-blk
	// devices) or "auto" (default: pmem when the machine, the guest kernel
	// and QEMU support it, logged with the reason).
	Layers string
	// Egress attaches the networks of sandboxes that ask for egress
	// (internal/egress, shared with the node's other backends;
	// egress.go); nil disables egress.
	Egress *egress.Egress
	// DiskIOPS and DiskBPS bound each VM's disk I/O, all its drives
	// together (QEMU's block throttling, one group per VM): requests per
	// second and bytes per second; 0: no bound. Every guest request goes
	// through them (writeback and direct I/O alike), unlike a cgroup v1
	// blkio limit.
	DiskIOPS, DiskBPS int64
	// Pause is how Pause stops a VM (pause.go): PauseSnapshot (default)
	// or PauseInPlace.
	Pause string
	// Boot is how a microVM's guest starts (template.go): BootCold
	// (default) or BootTemplate (restored from a snapshot of its shape;
	// layers then go as blk devices, as pmem cannot).
	Boot   string
	Logger *slog.Logger
}

// Check reports why this node cannot run VMs (nil if it can): no QEMU or
// no guest kernel.
func (c *Config) Check() error {
	if c.QEMU == "" {
		c.QEMU = "qemu-system-x86_64"
	}
	if c.KernelDir == "" {
		c.KernelDir = DefaultKernelDir
	}
	if _, err := exec.LookPath(c.QEMU); err != nil {
		return fmt.Errorf("no %s (apt-get install qemu-system-x86): %w", c.QEMU, err)
	}
	if _, err := c.kernel(); err != nil {
		return err
	}
	return c.checkImage()
}

func (c *Config) kernel() (string, error) {
	for _, n := range []string{"vmlinux", "vmlinuz"} {
		p := filepath.Join(c.KernelDir, n)
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("no guest kernel in %s (run scripts/vmkernel.sh)", c.KernelDir)
}

// Backend runs sandboxes in QEMU VMs.
type Backend struct {
	cfg    Config
	log    *slog.Logger
	kernel string
	initrd string

	probeOnce sync.Once
	probed    chan struct{} // closed when accel is known
	accel     string        // "kvm" or "tcg"; set before probed is closed
	accelWhy  string
	bootLimit time.Duration

	// pmem: layers are persistent memory (pmem.go), mapping pad, the
	// pad file; pmemWhy says why or why not. Set by New.
	pmem    bool
	pmemWhy string
	pad     string
	// netModules: the initramfs holds the guest's network modules
	// (egress.go). Set by New.
	netModules bool

	mu    sync.Mutex
	muxes map[string]*chanMux // guarded by mu; by sandbox ID
	// working: the working sets of the QEMUs of VMs paused in place
	// (read at the pause, prefetched at the resume: pause.go); guarded
	// by mu; by sandbox ID.
	working map[string]reclaim.WorkingSet

	// tpl: the templates VMs are restored from (template.go); nil when
	// every create boots.
	tpl *templates

	// disks makes the ext4 images that hold VMs' writable layers when a
	// create asks for a disk size (disk.go); nil: no disk limits.
	disks    *diskimg.Maker
	diskMode string
}

// The backend contract and the optional abilities this backend has.
var (
	_ sandbox.Backend     = (*Backend)(nil)
	_ sandbox.Prober      = (*Backend)(nil)
	_ sandbox.AgentDialer = (*Backend)(nil)
	_ sandbox.Committer   = (*Backend)(nil)
	_ sandbox.DiskLimiter = (*Backend)(nil)
	_ sandbox.Pauser      = (*Backend)(nil)
	_ sandbox.Evicter     = (*Backend)(nil)
	_ sandbox.UsageReader = (*Backend)(nil)
)

// New builds the guests' initramfs. The accelerator is chosen at the first
// create (a KVM probe costs a boot: nothing is spent on a node that runs no
// VM).
func New(cfg Config) (*Backend, error) {
	if err := cfg.Check(); err != nil {
		return nil, err
	}
	if cfg.Name == "" {
		cfg.Name = "microvm"
	}
	if cfg.Machine == "" {
		cfg.Machine = MachineMicroVM
	}
	if cfg.Machine != MachineMicroVM && cfg.Machine != MachineQ35 {
		return nil, fmt.Errorf("vm backend: machine %q: want %s or %s", cfg.Machine, MachineMicroVM, MachineQ35)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Accel == "" || cfg.Accel == "auto" {
		if env := os.Getenv("SHOAL_VM_ACCEL"); env != "" {
			cfg.Accel = env
		} else {
			cfg.Accel = "auto"
		}
	}
	switch cfg.Accel {
	case "auto", "kvm", "tcg":
	default:
		return nil, fmt.Errorf("vm backend: accel %q: want auto, kvm or tcg", cfg.Accel)
	}
	switch cfg.Pause {
	case "":
		cfg.Pause = PauseSnapshot
	case PauseSnapshot, PauseInPlace:
	default:
		return nil, fmt.Errorf("vm backend: pause %q: want %s or %s", cfg.Pause, PauseSnapshot, PauseInPlace)
	}
	switch cfg.Boot {
	case "":
		cfg.Boot = BootCold
	case BootCold:
	case BootTemplate:
		if cfg.Machine != MachineMicroVM {
			return nil, fmt.Errorf("vm backend %s: boot %s: templates are made for microvm only", cfg.Name, cfg.Boot)
		}
		if cfg.Layers == LayersPmem {
			return nil, fmt.Errorf("vm backend: boot %s and pmem layers: a template's memory cannot hold a sandbox's layers; use blk layers", cfg.Boot)
		}
	default:
		return nil, fmt.Errorf("vm backend: boot %q: want %s or %s", cfg.Boot, BootCold, BootTemplate)
	}
	kernel, _ := cfg.kernel()
	initrd, err := buildInitrd(cfg.StateDir, cfg.KernelDir, cfg.AgentBinary)
	if err != nil {
		return nil, fmt.Errorf("vm backend: initramfs: %w", err)
	}
	b := &Backend{cfg: cfg, log: cfg.Logger.With("backend", cfg.Name), kernel: kernel, initrd: initrd,
		probed: make(chan struct{}), muxes: map[string]*chanMux{}, working: map[string]reclaim.WorkingSet{}}
	// The initramfs just built has them if the directory had them.
	_, err = os.Stat(filepath.Join(cfg.KernelDir, "modules", vminit.NetOrder))
	b.netModules = err == nil
	b.initDisks()
	if cfg.Boot == BootTemplate {
		b.sweepTemplates(filepath.Join(cfg.StateDir, "templates"))
		if b.tpl, err = newTemplates(filepath.Join(cfg.StateDir, "templates")); err != nil {
			return nil, fmt.Errorf("vm backend: templates: %w", err)
		}
	}
	if err := b.choosePmem(); err != nil {
		return nil, err
	}
	b.log.Info("vm layers", "as", b.LayerDevices(), "why", b.pmemWhy)
	return b, nil
}

// chooseAccel sets b.accel: the configured one, or KVM if a probe guest
// boots on it within ProbeTimeout, else TCG.
func (b *Backend) chooseAccel() {
	defer close(b.probed)
	defer func() {
		b.bootLimit = b.cfg.BootTimeout
		if b.bootLimit == 0 {
			b.bootLimit = 180 * time.Second
			if b.accel == "kvm" {
				b.bootLimit = 60 * time.Second
			}
		}
		b.log.Info("vm accelerator", "accel", b.accel, "why", b.accelWhy, "machine", b.cfg.Machine, "kernel", b.kernel)
	}()
	switch b.cfg.Accel {
	case "kvm", "tcg":
		b.accel, b.accelWhy = b.cfg.Accel, "configured"
		return
	}
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		b.accel, b.accelWhy = "tcg", "no usable /dev/kvm: "+err.Error()
		return
	}
	f.Close()
	start := time.Now()
	if err := b.probe("kvm"); err != nil {
		b.accel, b.accelWhy = "tcg", "a probe guest did not boot on KVM: "+err.Error()
		return
	}
	b.accel, b.accelWhy = "kvm", fmt.Sprintf("a probe guest booted on KVM in %s", time.Since(start).Round(time.Millisecond))
}

// probe boots a guest that prints vminit.ProbeOK and powers off.
func (b *Backend) probe(accel string) error {
	ctx, cancel := context.WithTimeout(context.Background(), ProbeTimeout)
	defer cancel()
	args := b.baseArgs(accel, 256<<20, 1, vminit.EnvProbe+"=1", nil, nil, "")
	args = append(args, "-serial", "stdio")
	cmd := exec.CommandContext(ctx, b.cfg.QEMU, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	var stderr strings.Builder
	cmd.Stderr = &limitedWriter{w: &stderr, n: 4096}
	if err := cmd.Start(); err != nil {
		return err
	}
	ok := false
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if strings.Contains(sc.Text(), vminit.ProbeOK) {
			ok = true
			break
		}
	}
	cmd.Process.Kill()
	cmd.Wait()
	if ok {
		return nil
	}
	if ctx.Err() != nil {
		return fmt.Errorf("no answer within %s", ProbeTimeout)
	}
	return fmt.Errorf("qemu: %s", strings.TrimSpace(stderr.String()))
}

type limitedWriter struct {
	w interface{ WriteString(string) (int, error) }
	n int
}

func (l *limitedWriter) Write(p []byte) (int, error) {
	if l.n > 0 {
		q := p
		if len(q) > l.n {
			q = q[:l.n]
		}
		l.w.WriteString(string(q))
		l.n -= len(q)
	}
	return len(p), nil
}

// Accel returns the accelerator and why it was chosen, choosing it on the
// first call (the callers wait for that).
func (b *Backend) Accel(ctx context.Context) (string, string, error) {
	b.probeOnce.Do(func() { go b.chooseAccel() })
	select {
	case <-b.probed:
		return b.accel, b.accelWhy, nil
	case <-ctx.Done():
		return "", "", ctx.Err()
	}
}

// LayerDevices says how layers reach the guests: "pmem" or "blk".
func (b *Backend) LayerDevices() string {
	if b.pmem {
		return LayersPmem
	}
	return LayersBlk
}

// Name implements sandbox.Backend.
func (b *Backend) Name() string { return b.cfg.Name }

// Capabilities implements sandbox.Backend: layers are image files attached
// as devices, never mounted on the host.
func (b *Backend) Capabilities() sandbox.Capabilities { return sandbox.Capabilities{} }

// qemuEscape doubles commas, QEMU's option separator, in a value.
func qemuEscape(s string) string { return strings.ReplaceAll(s, ",", ",,") }

// baseArgs is the QEMU command line shared by sandboxes and the probe;
// pmem, if not nil, places the guest's RAM and layers (pmem.go) in it.
func (b *Backend) baseArgs(accel string, mem int64, cpus int, extraAppend string, pmem *pmemLayout, images []string, pad string) []string {
	machine := b.cfg.Machine
	if machine == MachineMicroVM {
		// No option ROMs; an RTC for the guest's clock; the guest finds its
		// virtio-mmio devices through ACPI.
		machine += ",x-option-roms=off,rtc=on,isa-serial=on"
		if pmem != nil {
			// The guest's PCI set-up puts its pmem regions in its
			// resource tree (pmem.go).
			machine += ",pcie=on"
		}
	}
	var memArgs []string
	if pmem != nil {
		var kargs string
		memArgs, kargs = pmem.qemuArgs(images, pad)
		mem = pmem.total()
		extraAppend = strings.TrimSpace(extraAppend + " " + kargs)
	}
	cpu := "max"
	if accel == "kvm" {
		cpu = "host,-arch-capabilities"
	}
	// tsc_early_khz and lpj: under TCG the guest cannot calibrate its TSC
	// or delay loop (it hangs without them). TCG's TSC is the host's, so
	// the guest's clock keeps time only with the host's frequency.
	// mitigations=off: the guest's kernel does not guard its processes
	// from each other (they are one sandbox's); the host's kernel and KVM
	// keep guarding the host from the guest. It makes TCG boots faster.
	// panic=1: a guest whose init dies (a crashed agent) reboots, and so
	// its QEMU exits (-no-reboot), one second after the kernel's panic:
	// time for consoleDuringBoot to read why.
	// The rest skip what costs a TCG boot most and the sandbox nothing
	// (measured with initcall_debug, a 256 MiB microvm; together the
	// kernel reached /init in 0.85 s instead of 1.17 s):
	// cryptomgr.notests: the crypto self-tests (229 ms); tsc=reliable:
	// no clocksource watchdog (the TSC is the host's); audit=0 and
	// nowatchdog: no audit subsystem and lockup detector; 8250.nr_uarts=1:
	// one serial port probed, not four.
	khz := hostTSCkHz()
	appendLine := fmt.Sprintf("console=ttyS0 quiet panic=1 tsc_early_khz=%d lpj=%d mitigations=off"+
		" cryptomgr.notests tsc=reliable audit=0 nowatchdog 8250.nr_uarts=1 %s=1", khz, khz*2, vminit.EnvVM)
	if extraAppend != "" {
		appendLine += " " + extraAppend
	}
	accelOpt := accel
	if accel == "tcg" {
		// TCG's translation cache: 64 MiB instead of QEMU's default (up
		// to 1 GiB of host memory per VM).
		accelOpt += ",tb-size=64"
	}
	return append([]string{
		"-M", machine, "-accel", accelOpt, "-cpu", cpu,
		"-m", strconv.FormatInt(mem>>20, 10), "-smp", strconv.Itoa(cpus),
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-kernel", b.kernel, "-initrd", b.initrd, "-append", appendLine,
	}, memArgs...)
}

// hostTSCkHz is the host's TSC frequency as /proc/cpuinfo's "cpu MHz" of
// its first CPU says (constant on x86 hosts with an invariant TSC, as
// virtual machines and KVM hosts have), else 2 GHz.
func hostTSCkHz() int64 {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return 2000000
	}
	for _, l := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(l, ":")
		if ok && strings.TrimSpace(k) == "cpu MHz" {
			if mhz, err := strconv.ParseFloat(strings.TrimSpace(v), 64); err == nil && mhz > 100 && mhz < 10000 {
				return int64(mhz * 1000)
			}
			break
		}
	}
	return 2000000
}

// configImage is the sandbox's description (vminit.Config) for its guest,
// a read-only disk in the sandbox's directory.
const configImage = "config.img"

// maxVirtio is virtioSlots' largest answer.
const maxVirtio = 24

// virtioSlots is how many virtio devices a VM of machine has room for
// under accel. A microvm's devices are virtio-mmio transports: 24 with its
// second IOAPIC, which QEMU gives it unless KVM's in-kernel interrupt
// controller (not split, as here) takes its interrupts, and then 8. q35's
// are on PCI, with room for more: bounded alike, for one rule.
func virtioSlots(machine, accel string) int {
	if machine == MachineMicroVM && accel == "kvm" {
		return 8
	}
	return maxVirtio
}

// virtioDevices is how many virtio devices a VM takes: the agent's port,
// the config and the balloon, blkLayers layers as block devices, and the
// writable layer's disk, a network link and a full system's disk if it has
// them.
func virtioDevices(blkLayers int, disk, net, system bool) int {
	n := 3 + blkLayers
	for _, has := range []bool{disk, net, system} {
		if has {
			n++
		}
	}
	return n
}

// device names of the virtio devices on this machine type.
func (b *Backend) dev(kind string) string {
	if b.cfg.Machine == MachineMicroVM {
		return kind + "-device"
	}
	return kind + "-pci"
}

// Create implements sandbox.Backend: it starts the VM and returns once its
// agent answers.
func (b *Backend) Create(ctx context.Context, spec sandbox.Spec) (h sandbox.Handle, err error) {
	if len(spec.Layers) == 0 || len(spec.Layers) > MaxLayers {
		return h, fmt.Errorf("%s backend: %d layers: a VM takes 1 to %d: %w", b.cfg.Name, len(spec.Layers), MaxLayers, sandbox.ErrUnsupported)
	}
	if spec.Network.Egress() {
		if err := b.checkEgress(); err != nil {
			return h, err
		}
	}
	system := b.cfg.Image != ""
	// A full system's writable layer is on its root overlay (fullvm.go).
	upperDisk := spec.Resources.DiskBytes > 0 && !system
	if upperDisk && b.disks == nil {
		return h, fmt.Errorf("%s backend: no disk limits on this node (%s): %w", b.cfg.Name, b.diskMode, sandbox.ErrUnsupported)
	}
	accel, _, err := b.Accel(ctx)
	if err != nil {
		return h, err
	}
	mem := alignUp(max(spec.Resources.MemoryBytes, MinMemoryBytes), pmemAlign)
	cpus := int(max((spec.Resources.MilliCPU+999)/1000, 1))
	images := make([]string, len(spec.Layers))
	for i, l := range spec.Layers {
		images[i] = l.ImagePath
	}
	var pmem *pmemLayout
	if !system {
		pmem = b.planLayers(spec, mem, images)
	}
	blk := len(images)
	if pmem != nil {
		blk = 0 // memory, not devices
	}
	if need, have := virtioDevices(blk, upperDisk, spec.Network.Egress(), system), virtioSlots(b.cfg.Machine, accel); need > have {
		return h, fmt.Errorf("%s backend: %d layers as block devices need %d virtio devices (with the agent's port, the config, the balloon and any disk or network link), and a %s VM under %s has room for %d: %w",
			b.cfg.Name, blk, need, b.cfg.Machine, accel, have, sandbox.ErrUnsupported)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, b.bootLimit)
		defer cancel()
	}
	dir := spec.Dir
	pipe := filepath.Join(dir, agentPipe)
	for _, f := range []string{pipe + ".in", pipe + ".out"} {
		if err := unix.Mkfifo(f, 0o600); err != nil {
			return h, fmt.Errorf("agent channel: %w", err)
		}
	}
	if upperDisk {
		if err := b.disks.Make(ctx, filepath.Join(dir, upperImage), spec.Resources.DiskBytes); err != nil {
			return h, fmt.Errorf("%s backend: disk: %w", b.cfg.Name, err)
		}
	}
	cfgImg := filepath.Join(dir, configImage)
	vc := vminit.Config{ID: spec.ID, Layers: len(spec.Layers), Env: guestEnv(spec), Hostname: hostname(spec.ID),
		UpperDisk: upperDisk, System: system, Pids: max(spec.Resources.Pids, 0)}
	var netData map[string]string
	if spec.Network.Egress() {
		// The link (a tap QEMU opens) and its rules before QEMU starts.
		if netData, vc.Net, err = b.attachEgress(spec.ID, spec.Network); err != nil {
			return h, fmt.Errorf("%s backend: create sandbox %s: network egress: %w", b.cfg.Name, spec.ID, err)
		}
		defer func() {
			if err != nil {
				if derr := b.cfg.Egress.Detach(spec.ID, netData); derr != nil {
					b.log.Error("undo egress", "sandbox_id", spec.ID, "err", derr)
				}
			}
		}()
	}
	pmemGuestConfig(&vc, pmem)
	vc.Seed = make([]byte, vminit.SeedLen)
	if _, err := rand.Read(vc.Seed); err != nil {
		return h, err
	}
	doc, err := json.Marshal(vc)
	if err != nil {
		return h, err
	}
	if len(doc) >= vminit.ConfigMax {
		return h, fmt.Errorf("%s backend: sandbox config of %d bytes is too large", b.cfg.Name, len(doc))
	}
	padded := make([]byte, (len(doc)/4096+1)*4096)
	copy(padded, doc)
	if err := os.WriteFile(cfgImg, padded, 0o600); err != nil {
		return h, err
	}
	layers, err := json.Marshal(images)
	if err != nil {
		return h, err
	}
	h = sandbox.Handle{ID: spec.ID, Backend: b.cfg.Name, Data: map[string]string{
		"dir": dir, "accel": accel, "machine": b.cfg.Machine,
		"mem": strconv.FormatInt(mem, 10), "cpus": strconv.Itoa(cpus), "layers": string(layers),
		// A snapshot restores only into the same devices: VMs made before
		// the balloon had none, and keep none.
		"balloon": "1",
		// Its QEMU's CPU limit and class (cgroup.go).
		"millicpu": strconv.FormatInt(max(spec.Resources.MilliCPU, 0), 10),
	}}
	if spec.Resources.BestEffort {
		h.Data["qos"] = "be"
	}
	for k, v := range netData {
		h.Data[k] = v
	}
	if upperDisk {
		h.Data["disk"] = strconv.FormatInt(spec.Resources.DiskBytes, 10)
	}
	h.Data["layer_devices"] = LayersBlk
	if pmem != nil {
		doc, err := json.Marshal(pmem)
		if err != nil {
			return h, err
		}
		h.Data["pmem"], h.Data["pmem_pad"], h.Data["layer_devices"] = string(doc), b.pad, LayersPmem
	}
	if system {
		if h.Data["image"], err = b.makeOverlay(ctx, dir, spec.Resources.DiskBytes); err != nil {
			return h, err
		}
	}
	start := time.Now()
	if key, ok := b.templateKey(h); ok {
		if state := b.tpl.get(key); state != "" {
			h.Data["boot"] = BootTemplate
			nh, err := b.createFromTemplate(ctx, h, state)
			if err == nil {
				b.log.Debug("vm restored from its template", "sandbox_id", spec.ID, "template", key, "took", time.Since(start))
				return nh, nil
			}
			if ctx.Err() != nil {
				return h, err // the create's end, not the template's fault
			}
			b.log.Warn("vm template failed: the sandbox boots", "sandbox_id", spec.ID, "template", key, "err", err)
			b.tpl.drop(key, err.Error())
			start = time.Now()
			// The failed QEMU's watcher (start) may still read its map.
			h.Data = maps.Clone(h.Data)
		} else {
			// Its template after this boot, which it would slow.
			defer func() {
				if err == nil {
					b.makeTemplateLater(key, h)
				}
			}()
		}
	}
	h.Data["boot"] = BootCold
	h, exited, err := b.start(h)
	if err != nil {
		return h, err
	}
	defer func() {
		if err != nil {
			b.Delete(context.Background(), h)
		}
	}()
	qmpSock := filepath.Join(dir, "qmp.sock")
	stopConsole := make(chan struct{})
	bootConsole := consoleDuringBoot(qmpSock, stopConsole, exited)
	err = b.waitAgent(ctx, h, exited)
	close(stopConsole)
	if err != nil {
		return h, fmt.Errorf("%s backend: boot (%s): %w%s", b.cfg.Name, accel, err, b.console(qmpSock, dir, exited, bootConsole()))
	}
	b.log.Debug("vm booted", "sandbox_id", spec.ID, "accel", accel, "took", time.Since(start))
	return h, nil
}

// qemuArgs is the QEMU command line of the VM of h (made by Create, whose
// handle records the sandbox's memory, CPUs and layer images): the same
// for its boot and for a restore from a snapshot.
func (b *Backend) qemuArgs(h sandbox.Handle) ([]string, error) {
	dir := h.Data["dir"]
	mem, err1 := strconv.ParseInt(h.Data["mem"], 10, 64)
	cpus, err2 := strconv.Atoi(h.Data["cpus"])
	var images []string
	err3 := json.Unmarshal([]byte(h.Data["layers"]), &images)
	if dir == "" || err1 != nil || err2 != nil || err3 != nil || mem <= 0 || cpus <= 0 || len(images) == 0 || len(images) > MaxLayers {
		return nil, fmt.Errorf("%s backend: sandbox %s: its handle does not describe a VM", b.cfg.Name, h.ID)
	}
	accel := h.Data["accel"]
	if accel != "kvm" && accel != "tcg" {
		return nil, fmt.Errorf("%s backend: sandbox %s: accel %q", b.cfg.Name, h.ID, accel)
	}
	pmem, err := handlePmem(h, images)
	if err != nil {
		return nil, fmt.Errorf("%s backend: sandbox %s: %w", b.cfg.Name, h.ID, err)
	}
	extra := ""
	if h.Data["template"] == "1" {
		extra = vminit.EnvTemplate + "=1" // a template's guest (template.go)
	}
	args := b.baseArgs(accel, mem, cpus, extra, pmem, images, h.Data["pmem_pad"])
	args = append(args,
		"-chardev", "ringbuf,id=con,size=65536", "-serial", "chardev:con",
		"-qmp", "unix:"+qemuEscape(filepath.Join(dir, "qmp.sock"))+",server=on,wait=off",
		"-pidfile", filepath.Join(dir, "qemu.pid"),
		"-device", b.dev("virtio-serial")+",max_ports=2",
		"-chardev", agentChardev(dir),
		"-device", "virtserialport,chardev=agent,name="+vminit.PortName,
		"-drive", "if=none,id=cfg,format=raw,readonly=on,file="+qemuEscape(filepath.Join(dir, configImage)),
		"-device", b.dev("virtio-blk")+",drive=cfg,serial="+vminit.ConfigSerial,
	)
	if h.Data["disk"] != "" {
		// The writable layer's ext4 image (disk.go): freed blocks are
		// punched out of the host's file (discard).
		args = append(args,
			"-drive", "if=none,id=upper,format=raw,discard=unmap,file.locking=off"+b.throttle()+",file="+qemuEscape(filepath.Join(dir, upperImage)),
			"-device", b.dev("virtio-blk")+",drive=upper,serial="+vminit.UpperSerial)
	}
	args = append(args, systemDisk(b, h)...)
	args = append(args, b.netArgs(h)...)
	if h.Data["balloon"] == "1" {
		// Free page reporting: the guest's kernel hands the pages it
		// frees (in 2 MiB blocks, a few seconds after) back to QEMU, which
		// discards them, so a VM's host memory follows what its guest
		// uses instead of only ever growing (TestVMFreePageReporting).
		args = append(args, "-device", b.dev("virtio-balloon")+",free-page-reporting=on")
	}
	for i, img := range images {
		if pmem != nil {
			break // memory (baseArgs)
		}
		id := "l" + strconv.Itoa(i)
		args = append(args,
			"-drive", "if=none,id="+id+",format=raw,readonly=on,file.locking=off"+b.throttle()+",file="+qemuEscape(img),
			"-device", b.dev("virtio-blk")+",drive="+id+",serial="+vminit.LayerSerialPrefix+strconv.Itoa(i))
	}
	// A compromised QEMU may not spawn, elevate or change resource
	// controls (QEMU's seccomp filter).
	args = append(args, "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny")
	return args, nil
}

// throttle is the -drive options that put a drive in the VM's I/O
// throttling group ("" when the node bounds no disk I/O). Each VM is a
// QEMU of its own, so one group name serves all.
func (b *Backend) throttle() string {
	if b.cfg.DiskIOPS <= 0 && b.cfg.DiskBPS <= 0 {
		return ""
	}
	opt := ",throttling.group=vm"
	if b.cfg.DiskIOPS > 0 {
		opt += ",throttling.iops-total=" + strconv.FormatInt(b.cfg.DiskIOPS, 10)
	}
	if b.cfg.DiskBPS > 0 {
		opt += ",throttling.bps-total=" + strconv.FormatInt(b.cfg.DiskBPS, 10)
	}
	return opt
}

// start starts the QEMU of h (its qemuArgs and extra ones) and returns h
// with its pid; exited is closed when it has exited.
func (b *Backend) start(h sandbox.Handle, extra ...string) (sandbox.Handle, <-chan struct{}, error) {
	args, err := b.qemuArgs(h)
	if err != nil {
		return h, nil, err
	}
	args = append(args, extra...)
	logf, err := os.OpenFile(filepath.Join(h.Data["dir"], "qemu.log"), os.O_CREATE|os.O_WRONLY|os.O_TRUNC|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return h, nil, err
	}
	cmd := exec.Command(b.cfg.QEMU, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// Its own session: the VM outlives the node process (Recover).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	err = cmd.Start()
	logf.Close()
	if err != nil {
		return h, nil, fmt.Errorf("start qemu: %w", err)
	}
	exited := make(chan struct{})
	go func() {
		cmd.Wait()
		// How it ended (a signal leaves nothing in its log): the boot's
		// error quotes the log (console).
		if f, err := os.OpenFile(filepath.Join(h.Data["dir"], "qemu.log"), os.O_WRONLY|os.O_APPEND|unix.O_NOFOLLOW, 0); err == nil {
			fmt.Fprintf(f, "[shoal: qemu ended: %v]\n", cmd.ProcessState)
			f.Close()
		}
		close(exited)
	}()
	if err := b.enterCgroup(h, cmd.Process.Pid); err != nil {
		// Unbounded, it does not run.
		cmd.Process.Kill()
		<-exited
		return h, nil, err
	}
	return withPid(h, cmd.Process.Pid), exited, nil
}

// waitAgent pings the guest's agent until it answers, QEMU exits or ctx
// ends. One attempt waits up to 10 s: the handshake repeats its sync
// record until the guest answers, so a booting guest needs one; a
// shorter bound made a boot past it begin two sessions (the first
// attempt's records still queued in the channel), ~50 ms of TCG each.
func (b *Backend) waitAgent(ctx context.Context, h sandbox.Handle, exited <-chan struct{}) error {
	c := agent.NewClientDialer("sandbox "+h.ID, b.AgentDial(h))
	for {
		pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		_, err := c.Ping(pctx)
		fast := pctx.Err() == nil // before cancel, after which it never is
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-exited:
			return errors.New("qemu exited before the agent answered")
		case <-ctx.Done():
			return fmt.Errorf("the agent did not answer: %w", ctx.Err())
		default:
		}
		if fast { // failed fast (QEMU has not opened the channel yet): do not spin
			select {
			case <-time.After(20 * time.Millisecond):
			case <-exited:
			case <-ctx.Done():
			}
		}
	}
}

// console returns the end of the guest's console (a bounded ring in QEMU;
// earlier: what consoleDuringBoot read of it before) and of QEMU's own
// log, for a boot error.
func (b *Backend) console(qmpSock, dir string, exited <-chan struct{}, earlier string) string {
	var out string
	select {
	case <-exited:
	default:
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		var s string
		if err := qmp(ctx, qmpSock, "ringbuf-read", map[string]any{"device": "con", "size": 4096, "format": "utf8"}, &s); err == nil {
			earlier += s
		}
		cancel()
	}
	if strings.TrimSpace(earlier) != "" {
		out += "; console: " + lastLines(earlier, 8)
	}
	if f, err := os.Open(filepath.Join(dir, "qemu.log")); err == nil {
		buf := make([]byte, 2048)
		n, _ := f.Read(buf)
		f.Close()
		if n > 0 {
			out += "; qemu: " + strings.TrimSpace(string(buf[:n]))
		}
	}
	return out
}

// consoleDuringBoot reads the guest's console ring (QMP ringbuf-read,
// which empties it) every 250 ms until stop or QEMU's exit, and returns a
// function giving what it read (its last 8 KiB). A guest that powers off
// while it boots (its init failed, or died: QEMU then exits with status 0)
// takes the ring with its QEMU; its last words (the agent's boot error, a
// Go panic) are then the boot error's cause.
func consoleDuringBoot(sock string, stop, exited <-chan struct{}) func() string {
	var mu sync.Mutex
	var got []byte
	go func() {
		t := time.NewTicker(250 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-exited:
				return
			case <-t.C:
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			var s string
			err := qmp(ctx, sock, "ringbuf-read", map[string]any{"device": "con", "size": 65536, "format": "utf8"}, &s)
			cancel()
			if err == nil && s != "" {
				mu.Lock()
				got = append(got, s...)
				if len(got) > 8<<10 {
					got = got[len(got)-8<<10:]
				}
				mu.Unlock()
			}
		}
	}()
	return func() string {
		mu.Lock()
		defer mu.Unlock()
		return string(got)
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}

// baseEnv is every sandbox process's environment before Spec.Env, as in a
// container.
var baseEnv = []string{
	"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
	"HOME=/root",
	"TERM=xterm",
	"LANG=C.UTF-8",
}

func guestEnv(spec sandbox.Spec) []string {
	env := append([]string(nil), baseEnv...)
	seen := map[string]int{}
	for i, kv := range env {
		k, _, _ := strings.Cut(kv, "=")
		seen[k] = i
	}
	for _, kv := range append(append([]string(nil), spec.Env...), "SHOAL_SANDBOX_ID="+spec.ID) {
		k, _, _ := strings.Cut(kv, "=")
		if i, ok := seen[k]; ok {
			env[i] = kv
			continue
		}
		seen[k] = len(env)
		env = append(env, kv)
	}
	return env
}

func hostname(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return id
}

// startTime returns a process's start time (field 22 of /proc/PID/stat),
// which tells it from a later process given the same pid.
func startTime(pid int) (string, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return "", err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return "", errors.New("bad stat")
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 20 {
		return "", errors.New("bad stat")
	}
	return f[19], nil
}

// process returns the pid of h's QEMU if it still runs (0 if not). A
// handle persisted before its create finished (the node crashed in the
// middle) has no pid: QEMU's pidfile names it (pidfileProcess).
func process(h sandbox.Handle) int {
	if h.Data["pid"] == "" && h.Data["dir"] != "" {
		return pidfileProcess(h.Data["dir"])
	}
	pid, err := strconv.Atoi(h.Data["pid"])
	if err != nil || pid <= 0 {
		return 0
	}
	st, err := startTime(pid)
	if err != nil || st != h.Data["pid_start"] || ended(pid) {
		return 0
	}
	return pid
}

// pidfileProcess returns the pid of the QEMU that the pidfile in a
// sandbox's directory names, if it still runs and its command line names
// that directory's agent channel (0 if not).
func pidfileProcess(dir string) int {
	b, err := os.ReadFile(filepath.Join(dir, "qemu.pid"))
	if err != nil {
		return 0
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 || ended(pid) {
		return 0
	}
	cl, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	if err != nil || !strings.Contains(string(cl), agentChardev(dir)) {
		return 0
	}
	return pid
}

// withPid returns a copy of h naming the QEMU process pid.
func withPid(h sandbox.Handle, pid int) sandbox.Handle {
	st, _ := startTime(pid)
	h.Data = maps.Clone(h.Data)
	h.Data["pid"], h.Data["pid_start"] = strconv.Itoa(pid), st
	return h
}

// Alive implements sandbox.Prober: its QEMU runs, or it is paused (its
// snapshot is there).
func (b *Backend) Alive(h sandbox.Handle) (bool, error) {
	if process(h) != 0 {
		return true, nil
	}
	return paused(h), nil
}

// Recover implements sandbox.Backend: a VM whose QEMU still runs is
// running (its agent channel is re-dialed on the next request), unless it
// was paused in place (its mark is there: paused); a VM with a snapshot
// and no QEMU is paused; one whose resume started a QEMU whose handle the
// node did not persist is running (the node knows it paused it, and its
// next resume adopts that QEMU). A QEMU whose snapshot is complete but
// which a pause did not kill yet (the node died in the middle, and so
// still has it running) continues.
func (b *Backend) Recover(ctx context.Context, h sandbox.Handle) (sandbox.Status, error) {
	if egress.Has(h.Data) {
		if b.cfg.Egress == nil {
			return "", fmt.Errorf("recover sandbox %s: it has network egress, which is disabled on this node (serve --egress-subnet)", h.ID)
		}
		if err := b.cfg.Egress.Recover(h.ID, h.Data); err != nil {
			return "", fmt.Errorf("recover sandbox %s: network egress: %w", h.ID, err)
		}
	}
	if process(h) != 0 {
		if stoppedInPlace(h) {
			return sandbox.StatusPaused, nil
		}
		if paused(h) {
			if err := qmp(ctx, filepath.Join(h.Data["dir"], "qmp.sock"), "cont", nil, nil); err != nil {
				return sandbox.StatusStopped, fmt.Errorf("continue a VM after an interrupted pause: %w", err)
			}
			os.Remove(filepath.Join(h.Data["dir"], stateFile))
		}
		return sandbox.StatusRunning, nil
	}
	if paused(h) {
		return sandbox.StatusPaused, nil
	}
	if h.Data["pid"] != "" && h.Data["dir"] != "" && pidfileProcess(h.Data["dir"]) != 0 {
		// A QEMU a resume started, whose handle the node did not persist
		// (it died): the sandbox is still paused for the node, and its
		// next Resume adopts that QEMU.
		return sandbox.StatusRunning, nil
	}
	return sandbox.StatusStopped, nil
}

// Delete implements sandbox.Backend: it kills QEMU and waits until it is
// gone. The node removes the sandbox's directory.
func (b *Backend) Delete(ctx context.Context, h sandbox.Handle) error {
	b.mu.Lock()
	m := b.muxes[h.ID]
	delete(b.muxes, h.ID)
	delete(b.working, h.ID)
	b.mu.Unlock()
	if m != nil {
		m.close()
	}
	if err := kill(ctx, process(h)); err != nil {
		return err
	}
	// A QEMU that a resume started before the node died (its handle was
	// not persisted): the pidfile in the sandbox's directory names it.
	if h.Data["pid"] != "" && h.Data["dir"] != "" {
		if err := kill(ctx, pidfileProcess(h.Data["dir"])); err != nil {
			return err
		}
	}
	if b.cfg.Egress != nil {
		if err := b.cfg.Egress.Detach(h.ID, h.Data); err != nil {
			return err
		}
	}
	if err := b.removeCgroup(h); err != nil {
		return err
	}
	return removeOverlay(h)
}

// kill kills the QEMU of pid (none if 0) and waits until it is gone.
func kill(ctx context.Context, pid int) error {
	if pid == 0 {
		return nil
	}
	// A pidfd pins the process: the kill cannot reach another one that
	// took the number, and it polls readable once QEMU has exited. (The
	// handle's own checks cannot say that: an exiting QEMU has no command
	// line for a while before it is a zombie.)
	st, err := startTime(pid)
	if err != nil {
		return nil
	}
	fd, err := unix.PidfdOpen(pid, 0)
	if errors.Is(err, unix.ESRCH) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("open qemu %d: %w", pid, err)
	}
	defer unix.Close(fd)
	if now, err := startTime(pid); err != nil || now != st {
		return nil // it ended before the fd pinned it
	}
	if err := unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0); err != nil && !errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("kill qemu %d: %w", pid, err)
	}
	for {
		n, err := unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, 20)
		if n > 0 {
			return nil
		}
		if err != nil && !errors.Is(err, unix.EINTR) {
			return fmt.Errorf("wait for qemu %d: %w", pid, err)
		}
		if ctx.Err() != nil {
			return fmt.Errorf("qemu %d did not exit: %w", pid, ctx.Err())
		}
	}
}

// ended tells whether a process has ended: a zombie, or dead (the state
// it shows while its parent reaps it, before its /proc entry goes away).
func ended(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return true
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i >= 0 && len(s) > i+2 && strings.IndexByte("ZXx", s[i+2]) >= 0
}

// WritableLayer implements sandbox.Committer: a VM's writable layer is in
// the guest, exported by its agent (commit.go).
func (b *Backend) WritableLayer(h sandbox.Handle) (sandbox.WritableLayer, error) {
	return sandbox.WritableLayer{Export: b.exportUpper(h)}, nil
}

// agentPipe names the agent channel's FIFOs in the sandbox's directory
// (with .in and .out).
const agentPipe = "agent"

// agentChardev is the QEMU chardev of the agent channel of the VM whose
// sandbox directory is dir (also how its command line is recognized).
func agentChardev(dir string) string {
	return "pipe,id=agent,path=" + qemuEscape(filepath.Join(dir, agentPipe))
}

// AgentDial implements sandbox.AgentDialer: streams of the one yamux
// session over the VM's agent channel, begun again when it ends.
func (b *Backend) AgentDial(h sandbox.Handle) func(ctx context.Context) (net.Conn, error) {
	path := filepath.Join(h.Data["dir"], agentPipe)
	id := h.ID
	return func(ctx context.Context) (net.Conn, error) {
		b.mu.Lock()
		m := b.muxes[id]
		if m == nil {
			m = &chanMux{path: path}
			b.muxes[id] = m
		}
		b.mu.Unlock()
		return m.open(ctx)
	}
}

// chanMux is the host end of one VM's agent channel.
type chanMux struct {
	path string
	mu   sync.Mutex     // guards sess
	sess *yamux.Session // nil or closed: dial again
}

func (m *chanMux) open(ctx context.Context) (net.Conn, error) {
	sess, err := m.session(ctx)
	if err != nil {
		return nil, err
	}
	// OpenStream waits while the guest has 256 streams it has not
	// accepted (a stuck guest): not longer than ctx.
	type result struct {
		st  *yamux.Stream
		err error
	}
	ch := make(chan result, 1)
	go func() {
		st, err := sess.OpenStream()
		ch <- result{st, err}
	}()
	select {
	case r := <-ch:
		if r.err != nil {
			m.drop(sess)
			return nil, r.err
		}
		return closingStream{r.st}, nil
	case <-ctx.Done():
		go func() {
			if r := <-ch; r.st != nil {
				r.st.Close()
			}
		}()
		return nil, ctx.Err()
	}
}

// closingStream is a stream whose Close also ends its pending reads, as a
// socket's does (a yamux stream's Close only half-closes it, and a reader
// would wait for the guest): the agent client ends a call whose context is
// done by closing its connection.
type closingStream struct{ *yamux.Stream }

func (s closingStream) Close() error {
	s.Stream.SetReadDeadline(time.Now())
	return s.Stream.Close()
}

// CloseWrite ends the host's direction only (the stream's FIN): the guest
// reads to its end and may go on writing (a TCP half-close, passed on by
// port forwarding).
func (s closingStream) CloseWrite() error { return s.Stream.Close() }

// session returns the live session, dialing the VM's socket for a new one
// when there is none.
func (m *chanMux) session(ctx context.Context) (*yamux.Session, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.sess != nil && !m.sess.IsClosed() {
		return m.sess, nil
	}
	c, err := openPipes(m.path)
	if err != nil {
		return nil, err
	}
	lc, err := vminit.DialLink(ctx, c)
	if err != nil {
		c.Close()
		return nil, err
	}
	s, err := yamux.Client(lc, vminit.MuxConfig())
	if err != nil {
		c.Close()
		return nil, err
	}
	m.sess = s
	return s, nil
}

// pipes is the host's end of the agent channel: QEMU reads PATH.in and
// writes PATH.out.
type pipes struct{ in, out *os.File }

// openPipes opens the channel's FIFOs without waiting: QEMU holds both
// open for as long as it runs (with neither, the VM is gone).
func openPipes(path string) (*pipes, error) {
	out, err := os.OpenFile(path+".out", os.O_RDONLY|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("agent channel: %w", err)
	}
	in, err := os.OpenFile(path+".in", os.O_WRONLY|unix.O_NONBLOCK, 0)
	if err != nil {
		out.Close()
		if errors.Is(err, unix.ENXIO) {
			return nil, fmt.Errorf("agent channel: QEMU is not running: %w", err)
		}
		return nil, fmt.Errorf("agent channel: %w", err)
	}
	return &pipes{in: in, out: out}, nil
}

func (p *pipes) Read(b []byte) (int, error)  { return p.out.Read(b) }
func (p *pipes) Write(b []byte) (int, error) { return p.in.Write(b) }

func (p *pipes) SetDeadline(t time.Time) error {
	return errors.Join(p.in.SetDeadline(t), p.out.SetDeadline(t))
}

func (p *pipes) Close() error { return errors.Join(p.in.Close(), p.out.Close()) }

// drop closes sess if it is still the current session.
func (m *chanMux) drop(sess *yamux.Session) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.sess == sess {
		m.sess.Close()
		m.sess = nil
	}
}

func (m *chanMux) close() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.sess != nil {
		m.sess.Close()
		m.sess = nil
	}
}

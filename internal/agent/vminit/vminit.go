// Package vminit is the guest agent's VM boot mode: when shoal-agent is the
// init of a VM's initramfs (the microvm backend's guests), it loads the
// kernel modules the initramfs carries, mounts each read-only layer from
// its virtio-blk device (or its persistent memory device, with DAX: pmem.go),
// stacks them under a writable upper (a tmpfs, or the
// ext4 disk of a disk limit) with
// overlayfs in the same order as a container's root, switches root to that
// overlay and serves the agent protocol on the VM's virtio-serial port,
// many streams multiplexed over the one port (yamux). For a full system
// (the fullvm backend) the system's tree is the lowest layer and the agent
// executes the system's init instead, which starts it again as a service
// (system.go).
//
// The host describes the sandbox in a small JSON document (Config) on a
// read-only virtio-blk device of its own, serial "shoal-cfg"; layer devices
// are found by their serial numbers, never by the order in which the kernel
// happened to probe them.
package vminit

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/hashicorp/yamux"
	"golang.org/x/sys/unix"
)

// Names shared by the host (the microvm backend) and the guest.
const (
	// EnvVM is set (to "1") on the kernel command line: unknown name=value
	// parameters reach init as environment variables.
	EnvVM = "SHOAL_VM"
	// EnvProbe asks the guest to print ProbeOK on the console and power
	// off: the host's test that an accelerator boots a guest.
	EnvProbe     = "SHOAL_VM_PROBE"
	ProbeOK      = "shoal-vm-probe-ok"
	ConfigSerial = "shoal-cfg"
	// LayerSerialPrefix + the layer's index (0 = top) is each layer
	// device's serial.
	LayerSerialPrefix = "shoal-l"
	// UpperSerial is the serial of the writable layer's disk, if it has one.
	UpperSerial = "shoal-upper"
	// RootSerial is the serial of a full system's disk (Config.System).
	RootSerial = "shoal-root"
	// PortName is the name of the agent's virtio-serial port.
	PortName = "shoal.agent"
	// ModulesDir holds the kernel modules in the initramfs, and the file
	// "order" in it their names in load order; "order.pmem" lists those
	// a guest with pmem layers loads after them (pmem.go), "order.net"
	// those a guest with network egress loads (net.go), "order.pci" the
	// virtio PCI transport, which only a guest with virtio devices on PCI
	// (q35; a microvm's are virtio-mmio) loads.
	ModulesDir = "/lib/shoal/modules"
	PmemOrder  = "order.pmem"
	NetOrder   = "order.net"
	PCIOrder   = "order.pci"
	// ConfigMax bounds the config document.
	ConfigMax = 1 << 20
)

// Config is what the host tells the guest about its sandbox.
type Config struct {
	ID string `json:"id"`
	// Layers is the number of layer devices, top (index 0) to base.
	Layers int `json:"layers"`
	// UpperBytes sizes the tmpfs holding the writable layer (0: half the
	// guest's memory, tmpfs's default).
	UpperBytes int64 `json:"upper_bytes,omitempty"`
	// UpperDisk: the writable layer is on the ext4 device whose serial is
	// UpperSerial (a disk limit), not a tmpfs.
	UpperDisk bool `json:"upper_disk,omitempty"`
	// Env is every command's environment.
	Env      []string `json:"env,omitempty"`
	Hostname string   `json:"hostname,omitempty"`
	// System: a full system (the fullvm backend, system.go): the disk
	// whose serial is RootSerial holds the system's tree under the
	// layers, and the writable layer unless UpperDisk; the agent then
	// starts the system's own init and serves as its service.
	System bool `json:"system,omitempty"`
	// PmemAddrs, if set, has one guest-physical address per layer (top
	// first): each layer is the persistent memory region that starts
	// there, not a virtio-blk device (pmem.go).
	PmemAddrs []uint64 `json:"pmem_addrs,omitempty"`
	// Net, if set, is the guest's link for network egress (net.go);
	// without it the guest has only loopback.
	Net *Net `json:"net,omitempty"`
	// Seed is SeedLen random bytes of the host's, mixed into the guest
	// kernel's random generator at boot (template.go: a restored
	// template's guest would otherwise draw what its other clones draw).
	Seed []byte `json:"seed,omitempty"`
	// Pids bounds the tasks of the sandbox's commands together: pids.max
	// of the guest's group CommandsCgroup (cgroup.go; 0: no bound).
	Pids int64 `json:"pids,omitempty"`

	// Upper is the overlay's upper directory, opened by Boot before the
	// root switch (after it, no path reaches it) and before any workload
	// runs: the agent exports it for a commit (agent.Config.Upper).
	Upper *os.File `json:"-"`
	// Commands is the commands' cgroup, which Boot makes and opens
	// (CommandsCgroup; a full system's service makes its own:
	// ServiceCgroup), and CommandsPath its path in the hierarchy: every
	// command is born in it (agent.Config.CommandsCgroup).
	Commands     *os.File `json:"-"`
	CommandsPath string   `json:"-"`
}

// Active reports whether this process is the init of a Shoal VM.
func Active() bool {
	return os.Getpid() == 1 && os.Getenv(EnvVM) == "1"
}

// Boot prepares the guest (modules, mounts, the root switch) and returns
// the sandbox's config and a listener of agent streams on the VM's port.
// In probe mode it prints ProbeOK and powers the VM off instead.
func Boot() (*Config, net.Listener, error) {
	os.Unsetenv(EnvVM)
	probe := os.Getenv(EnvProbe) == "1"
	os.Unsetenv(EnvProbe)
	template := os.Getenv(EnvTemplate) == "1"
	os.Unsetenv(EnvTemplate)
	for _, m := range []struct{ src, dst, typ string }{
		{"devtmpfs", "/dev", "devtmpfs"}, {"proc", "/proc", "proc"}, {"sysfs", "/sys", "sysfs"},
	} {
		os.MkdirAll(m.dst, 0o755)
		if err := unix.Mount(m.src, m.dst, m.typ, unix.MS_NOSUID|unix.MS_NOEXEC, ""); err != nil && !errors.Is(err, unix.EBUSY) {
			return nil, nil, fmt.Errorf("mount %s: %w", m.dst, err)
		}
	}
	if probe {
		if f, err := os.OpenFile("/dev/console", os.O_WRONLY, 0); err == nil {
			fmt.Fprintln(f, ProbeOK)
			f.Sync()
			f.Close()
		}
		unix.Sync()
		unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF)
		select {}
	}
	var skip string
	if template {
		skip = TemplateDeferred
	}
	if err := loadModules("order", skip); err != nil {
		return nil, nil, err
	}
	var port *os.File // the agent port, opened before the snapshot (template)
	if template {
		var err error
		if port, err = waitRestore(); err != nil {
			return nil, nil, err
		}
		// Restored, with the sandbox's devices.
		if err := loadModule(TemplateDeferred); err != nil {
			port.Close()
			return nil, nil, err
		}
	}
	cfg, l, err := boot(port)
	if err != nil && port != nil {
		port.Close()
	}
	return cfg, l, err
}

// boot is the rest of Boot, after the modules every guest loads; port,
// if not nil, is the agent port, opened and unread.
func boot(port *os.File) (*Config, net.Listener, error) {
	if virtioOnPCI() {
		// Its devices appear (and their drivers bind) as it loads.
		if err := loadModules(PCIOrder, ""); err != nil {
			return nil, nil, err
		}
	}
	cfg, err := readConfig()
	if err != nil {
		return nil, nil, err
	}
	if err := reseed(cfg.Seed); err != nil {
		return nil, nil, err
	}
	if len(cfg.PmemAddrs) > 0 {
		if err := loadModules(PmemOrder, ""); err != nil {
			return nil, nil, err
		}
	}
	if cfg.Net != nil {
		if err := setUpNet(cfg.Net); err != nil {
			return nil, nil, err
		}
	}
	if err := mountRoot(cfg); err != nil {
		return nil, nil, err
	}
	if cfg.System {
		return nil, nil, startSystem(cfg) // returns only on failure
	}
	if cfg.Hostname != "" {
		unix.Sethostname([]byte(cfg.Hostname))
	}
	if cfg.Commands, err = commandsCgroup(cfg.Pids); err != nil {
		return nil, nil, err
	}
	cfg.CommandsPath = CommandsCgroupPath
	l, err := listenPort(port)
	if err != nil {
		return nil, nil, err
	}
	return cfg, l, nil
}

// Fatal reports a boot failure on the console and powers the VM off: the
// host sees its QEMU exit, with the reason in the console log.
func Fatal(err error) {
	if f, ferr := os.OpenFile("/dev/console", os.O_WRONLY, 0); ferr == nil {
		fmt.Fprintf(f, "shoal-agent: vm boot: %v\n", err)
		f.Close()
	}
	// The host reads the console while the guest boots, every 250 ms
	// (the ring goes with QEMU): let it read this before the power-off.
	time.Sleep(time.Second)
	unix.Sync()
	unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF)
	select {}
}

// virtioOnPCI tells whether a virtio device (vendor 0x1af4) is on the
// guest's PCI bus, which the kernel has enumerated before init runs. Not
// loading the PCI transport where none is saves a microvm's boot three
// modules (~80 ms under TCG).
func virtioOnPCI() bool {
	vendors, _ := filepath.Glob("/sys/bus/pci/devices/*/vendor")
	for _, v := range vendors {
		if b, err := os.ReadFile(v); err == nil && strings.TrimSpace(string(b)) == "0x1af4" {
			return true
		}
	}
	return false
}

// loadModules loads the modules that ModulesDir/list names, but skip.
func loadModules(list, skip string) error {
	order, err := os.ReadFile(filepath.Join(ModulesDir, list))
	if errors.Is(err, os.ErrNotExist) {
		return nil // a kernel with everything built in
	}
	if err != nil {
		return err
	}
	for _, name := range strings.Fields(string(order)) {
		if name == skip {
			continue
		}
		if err := loadModule(name); err != nil {
			return err
		}
	}
	return nil
}

// loadModule loads ModulesDir/name.
func loadModule(name string) error {
	if strings.ContainsAny(name, "/") {
		return fmt.Errorf("module %q: not a file name", name)
	}
	f, err := os.Open(filepath.Join(ModulesDir, name))
	if err != nil {
		return fmt.Errorf("module %s: %w", name, err)
	}
	err = unix.FinitModule(int(f.Fd()), "", 0)
	f.Close()
	if err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("load module %s: %w", name, err)
	}
	return nil
}

// blockBySerial waits (bounded) until the virtio-blk devices with the given
// serials exist and returns their /dev paths.
func blockBySerial(serials []string) (map[string]string, error) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		found := map[string]string{}
		ents, _ := os.ReadDir("/sys/block")
		for _, e := range ents {
			b, err := os.ReadFile(filepath.Join("/sys/block", e.Name(), "serial"))
			if err != nil {
				continue
			}
			found[strings.TrimSpace(string(b))] = "/dev/" + e.Name()
		}
		missing := ""
		for _, s := range serials {
			if _, ok := found[s]; !ok {
				missing = s
				break
			}
			if !deviceReady(found[s]) {
				missing = s
				break
			}
		}
		if missing == "" {
			return found, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("no block device with serial %q", missing)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// deviceReady tells whether a block device can be opened. Its node and
// its /sys/block entry appear before the kernel has finished adding the
// disk, and an open (a mount) in between fails with ENXIO (seen with
// nd_pmem, whose namespaces are probed asynchronously: "/dev/pmem0: Can't
// open blockdev").
func deviceReady(path string) bool {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return false
	}
	unix.Close(fd)
	return true
}

func readConfig() (*Config, error) {
	devs, err := blockBySerial([]string{ConfigSerial})
	if err != nil {
		return nil, err
	}
	f, err := os.Open(devs[ConfigSerial])
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, ConfigMax))
	if err != nil {
		return nil, fmt.Errorf("read config: %w", err)
	}
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	var cfg Config
	if err := json.Unmarshal(b, &cfg); err != nil {
		return nil, fmt.Errorf("decode config: %w", err)
	}
	if cfg.Layers < 1 || cfg.Layers > 128 {
		return nil, fmt.Errorf("config: %d layers", cfg.Layers)
	}
	if len(cfg.PmemAddrs) != 0 && len(cfg.PmemAddrs) != cfg.Layers {
		return nil, fmt.Errorf("config: %d pmem addresses for %d layers", len(cfg.PmemAddrs), cfg.Layers)
	}
	return &cfg, nil
}

// mountRoot mounts the layers and the overlay at /newroot and makes it the
// root, moving /dev, /proc and /sys into it.
func mountRoot(cfg *Config) error {
	devs, err := layerDevices(cfg)
	if err != nil {
		return err
	}
	lower := make([]string, cfg.Layers)
	for i, dev := range devs {
		dir := fmt.Sprintf("/layers/%d", i)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		opts, err := mountLayer(dev, dir, len(cfg.PmemAddrs) > 0)
		if err != nil {
			return fmt.Errorf("mount layer %d (%s): %w", i, dev, err)
		}
		kmsg(fmt.Sprintf("shoal-agent: layer %d: %s (erofs, %s)", i, dev, opts))
		lower[i] = dir
	}
	os.MkdirAll("/rw", 0o755)
	if cfg.System {
		sys, err := mountSystem(cfg)
		if err != nil {
			return err
		}
		lower = append(lower, sys)
	}
	if cfg.UpperDisk {
		dev, err := blockBySerial([]string{UpperSerial})
		if err != nil {
			return err
		}
		if err := unix.Mount(dev[UpperSerial], "/rw", "ext4", unix.MS_NODEV, "discard"); err != nil {
			return fmt.Errorf("mount writable layer (%s): %w", dev[UpperSerial], err)
		}
	} else if cfg.System {
		// On the system's disk: its copy-on-write overlay on the host.
		if err := unix.Mount(systemRW, "/rw", "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("mount writable layer: %w", err)
		}
	} else {
		opts := "mode=0755"
		if cfg.UpperBytes > 0 {
			opts += fmt.Sprintf(",size=%d", cfg.UpperBytes)
		}
		if err := unix.Mount("tmpfs", "/rw", "tmpfs", 0, opts); err != nil {
			return fmt.Errorf("mount writable layer: %w", err)
		}
	}
	for _, d := range []string{"/rw/upper", "/rw/work", "/newroot"} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	ovl := "lowerdir=" + strings.Join(lower, ":") + ",upperdir=/rw/upper,workdir=/rw/work"
	if err := unix.Mount("overlay", "/newroot", "overlay", 0, ovl); err != nil {
		return fmt.Errorf("mount overlay: %w", err)
	}
	up, err := os.OpenFile("/rw/upper", os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return fmt.Errorf("open the writable layer: %w", err)
	}
	cfg.Upper = up
	for _, d := range []string{"dev", "proc", "sys"} {
		os.MkdirAll(filepath.Join("/newroot", d), 0o755)
	}
	// A /tmp for a root without one; one the layers have is left as it
	// is (a chmod would copy it up into the writable layer, and so into
	// a commit, where a container's has nothing).
	madeTmp := os.Mkdir("/newroot/tmp", 0o755) == nil
	for _, d := range []string{"/dev", "/proc", "/sys"} {
		if err := unix.Mount(d, "/newroot"+d, "", unix.MS_MOVE, ""); err != nil {
			return fmt.Errorf("move %s: %w", d, err)
		}
	}
	if err := os.Chdir("/newroot"); err != nil {
		return err
	}
	if err := unix.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
		return fmt.Errorf("move root: %w", err)
	}
	if err := unix.Chroot("."); err != nil {
		return fmt.Errorf("chroot: %w", err)
	}
	if err := os.Chdir("/"); err != nil {
		return err
	}
	os.MkdirAll("/dev/pts", 0o755)
	os.MkdirAll("/dev/shm", 0o1777)
	unix.Mount("devpts", "/dev/pts", "devpts", unix.MS_NOSUID|unix.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620")
	unix.Mount("shm", "/dev/shm", "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=1777")
	if _, err := os.Lstat("/dev/ptmx"); err == nil {
		os.Remove("/dev/ptmx")
	}
	os.Symlink("pts/ptmx", "/dev/ptmx")
	if madeTmp {
		unix.Chmod("/tmp", 0o1777) // os.Chmod would drop the sticky bit (os.ModeSticky is not 01000)
	}
	return nil
}

// findPort returns the /dev path of the virtio-serial port named PortName.
func findPort() (string, error) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		ents, _ := os.ReadDir("/sys/class/virtio-ports")
		for _, e := range ents {
			b, err := os.ReadFile(filepath.Join("/sys/class/virtio-ports", e.Name(), "name"))
			if err == nil && strings.TrimSpace(string(b)) == PortName {
				p := "/dev/" + e.Name()
				if _, err := os.Stat(p); err == nil {
					return p, nil
				}
			}
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("no virtio-serial port named %s", PortName)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// MuxConfig is the yamux configuration of both ends of the agent channel:
// no keep-alive (the channel ends when QEMU or the host process does, and
// a stopped VM must not be declared dead), nothing logged.
func MuxConfig() *yamux.Config {
	c := yamux.DefaultConfig()
	c.EnableKeepAlive = false
	c.LogOutput = io.Discard
	c.ConnectionWriteTimeout = 30 * time.Second
	return c
}

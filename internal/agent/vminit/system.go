package vminit

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A full system (the fullvm backend): the VM has one more disk, serial
// RootSerial, an ext4 file system (the node's copy-on-write qcow2 overlay
// over a base image built once per node) that holds:
//
//	/rootfs   the system's tree: Debian with systemd, udev, dbus
//	/rw       the sandbox's writable layer (upper and work), unless the
//	          create asked for a disk of its own (Config.UpperDisk)
//
// The agent, as the init of the initramfs, mounts the sandbox's layers over
// /rootfs (the system is the lowest layer: the sandbox's base and its
// workspaces and toolkits win), switches root to the overlay as it does
// for a microVM, then puts itself and the sandbox's config in /run/shoal (a
// tmpfs that systemd keeps) and executes the system's init, systemd. The
// image's shoal-agent.service runs RunAgent with --vm-service: it serves
// the usual protocol on the VM's port (Service). So the base image does not
// carry the agent, and a new agent needs no new image.

// Paths of a full system.
const (
	// SystemTree is the system's tree on its disk.
	SystemTree = "rootfs"
	// RunDir holds, in the running system, the agent (RunAgent) and the
	// sandbox's config (RunConfig).
	RunDir    = "/run/shoal"
	RunAgent  = RunDir + "/shoal-agent"
	RunConfig = RunDir + "/config.json"
	// RunUpper: the writable layer's upper directory, bound there by the
	// initramfs's agent from the descriptor it opened before the root
	// switch (Config.Upper), for the service's exports (a commit).
	RunUpper = RunDir + "/upper"
	// SystemInit is the system's init.
	SystemInit = "/sbin/init"
	// sysroot is where the initramfs mounts the system's disk.
	sysroot  = "/sysroot"
	systemRW = sysroot + "/rw"
)

// mountSystem mounts the system's disk and returns its tree, the lowest
// layer of the sandbox's root.
func mountSystem(cfg *Config) (string, error) {
	devs, err := blockBySerial([]string{RootSerial})
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(sysroot, 0o755); err != nil {
		return "", err
	}
	// noinit_itable: no background zeroing of the inode tables that
	// growing adds (the host's overlay reads zeros where nothing was
	// written).
	if err := unix.Mount(devs[RootSerial], sysroot, "ext4", unix.MS_NODEV, "discard,noinit_itable"); err != nil {
		return "", fmt.Errorf("mount the system disk (%s): %w", devs[RootSerial], err)
	}
	if err := growFS(devs[RootSerial], sysroot); err != nil {
		return "", err
	}
	tree := filepath.Join(sysroot, SystemTree)
	if fi, err := os.Stat(filepath.Join(tree, "sbin")); err != nil || !fi.IsDir() {
		return "", fmt.Errorf("the system disk has no system tree in /%s", SystemTree)
	}
	if !cfg.UpperDisk {
		if err := os.MkdirAll(systemRW, 0o755); err != nil {
			return "", err
		}
	}
	return tree, nil
}

// ext4IocResizeFS is EXT4_IOC_RESIZE_FS, _IOW('f', 16, __u64).
const ext4IocResizeFS = 0x40086610

// growFS grows the ext4 file system mounted at dir to the size of its
// device dev (the host made the device larger than the image by the
// sandbox's disk size); a file system as large as its device stays as it is.
func growFS(dev, dir string) error {
	d, err := os.Open(dev)
	if err != nil {
		return err
	}
	size, err := unix.IoctlGetUint64(int(d.Fd()), unix.BLKGETSIZE64)
	d.Close()
	if err != nil {
		return fmt.Errorf("size of %s: %w", dev, err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return err
	}
	if st.Bsize <= 0 {
		return fmt.Errorf("%s: block size %d", dir, st.Bsize)
	}
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer f.Close()
	blocks := size / uint64(st.Bsize)
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), ext4IocResizeFS, uintptr(unsafe.Pointer(&blocks))); e != 0 {
		return fmt.Errorf("grow the system disk's file system to %d blocks: %w", blocks, e)
	}
	return nil
}

// startSystem runs in the new root: it prepares /run/shoal and the
// sandbox's identity (host name, machine ID) and executes the system's
// init. It returns only when that fails.
func startSystem(cfg *Config) error {
	// systemd keeps a /run that is mounted already.
	if err := unix.Mount("tmpfs", "/run", "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0755,size=20%"); err != nil {
		return fmt.Errorf("mount /run: %w", err)
	}
	if err := os.MkdirAll(RunDir, 0o700); err != nil {
		return err
	}
	if err := copyFile("/proc/self/exe", RunAgent, 0o700); err != nil {
		return fmt.Errorf("install the agent: %w", err)
	}
	doc, err := json.Marshal(cfg)
	if err != nil {
		return err
	}
	if err := os.WriteFile(RunConfig, doc, 0o600); err != nil {
		return err
	}
	// The service's cgroup subtree is the service's to divide (cgroup.go).
	if err := os.MkdirAll(serviceDropInDir, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(serviceDropInDir+"/shoal.conf", []byte(serviceDropIn), 0o644); err != nil {
		return err
	}
	// The upper for the service: systemd closes what it inherits, so a
	// bind of the directory opened before the root switch (not a path
	// looked up now, in a tree the layers made).
	if cfg.Upper != nil {
		if err := os.Mkdir(RunUpper, 0o700); err != nil {
			return err
		}
		src := fmt.Sprintf("/proc/self/fd/%d", cfg.Upper.Fd())
		if err := unix.Mount(src, RunUpper, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind the writable layer for the service: %w", err)
		}
		cfg.Upper.Close()
		cfg.Upper = nil
	}
	if cfg.Hostname != "" {
		unix.Sethostname([]byte(cfg.Hostname))
		writeEtc("hostname", cfg.Hostname+"\n")
	}
	// A machine ID of its own per sandbox (journald, D-Bus), the same
	// across its boots.
	sum := sha256.Sum256([]byte("shoal-machine-id " + cfg.ID))
	writeEtc("machine-id", hex.EncodeToString(sum[:16])+"\n")
	env := []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "TERM=linux"}
	err = unix.Exec(SystemInit, []string{SystemInit}, env)
	return fmt.Errorf("execute %s: %w", SystemInit, err)
}

// writeEtc replaces a file of /etc (never following a symlink the layers
// put there: the guest's own files, but a boot must not write elsewhere).
func writeEtc(name, content string) {
	root, err := os.OpenRoot("/etc")
	if err != nil {
		return
	}
	defer root.Close()
	root.Remove(name)
	f, err := root.OpenFile(name, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
	if err != nil {
		return
	}
	f.WriteString(content)
	f.Close()
}

func copyFile(src, dst string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY|unix.O_NOFOLLOW, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// Service is the agent as the system's service (shoal-agent.service, run
// with --vm-service): it reads the sandbox's config that the initramfs left
// in RunConfig and returns a listener of agent streams on the VM's port.
func Service() (*Config, net.Listener, error) {
	if os.Getpid() == 1 {
		return nil, nil, errors.New("--vm-service: not as a VM's init")
	}
	b, err := os.ReadFile(RunConfig)
	if err != nil {
		return nil, nil, fmt.Errorf("the sandbox's config: %w", err)
	}
	var cfg Config
	if err := json.Unmarshal(b, &cfg); err != nil {
		return nil, nil, fmt.Errorf("decode %s: %w", RunConfig, err)
	}
	// The writable layer for exports, as the initramfs left it (root's
	// only, in /run: the system's processes could unmount or cover it, as
	// they can change the writable layer itself: a commit takes what the
	// guest sends, checked by the host).
	if up, err := os.OpenFile(RunUpper, os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0); err == nil {
		cfg.Upper = up
	}
	l, err := listenPort(nil)
	if err != nil {
		return nil, nil, err
	}
	return &cfg, l, nil
}

package microvm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/agent/vminit"
)

// The fullvm backend's base image: a full Debian system (systemd, udev,
// D-Bus) that debootstrap installs from Debian's archive once per node,
// in an ext4 file system (the system's tree under /rootfs, see
// internal/agent/vminit/system.go) in a qcow2 file. Each sandbox's disk is
// a qcow2 overlay backed by it (copy-on-write: the base is shared, read
// only, by every VM of the node). The image does not carry the agent (the
// initramfs puts it in /run at each boot), only its unit: a new agent needs
// no new image. Images are named by a digest of what they are built from
// and ImageLink names the newest: a rebuild never changes an image that
// running sandboxes' overlays are backed by.

// ImageLink is the name, in an image directory, of the symlink to its
// current image.
const ImageLink = "fullvm.qcow2"

// imageVersion changes when BuildImage's configuration of the tree does.
const imageVersion = "4"

// DefaultImagePackages are installed over debootstrap's minbase.
var DefaultImagePackages = []string{"systemd", "systemd-sysv", "udev", "dbus", "procps"}

// ImageSpec describes a base image.
type ImageSpec struct {
	Dir      string   // where it goes (DefaultKernelDir if empty)
	Suite    string   // Debian suite (default bookworm)
	Mirror   string   // Debian mirror (default http://deb.debian.org/debian)
	Packages []string // installed over minbase (default DefaultImagePackages)
	// FreeBytes is its file system's free space (default 256 MiB); each
	// sandbox's disk grows it by its disk size (fullvm.go).
	FreeBytes int64
	Logger    *slog.Logger
}

func (s *ImageSpec) defaults() {
	if s.Dir == "" {
		s.Dir = DefaultKernelDir
	}
	if s.Suite == "" {
		s.Suite = "bookworm"
	}
	if s.Mirror == "" {
		s.Mirror = "http://deb.debian.org/debian"
	}
	if len(s.Packages) == 0 {
		s.Packages = DefaultImagePackages
	}
	if s.FreeBytes <= 0 {
		s.FreeBytes = 256 << 20
	}
	if s.Logger == nil {
		s.Logger = slog.New(slog.DiscardHandler)
	}
}

// ImageNeeds reports what building an image needs and this host lacks, or "".
func ImageNeeds() string {
	for _, bin := range []string{"debootstrap", "mkfs.ext4", "qemu-img"} {
		if _, err := exec.LookPath(bin); err != nil {
			return "needs " + bin + " (apt-get install debootstrap e2fsprogs qemu-utils)"
		}
	}
	return ""
}

// BuildImage returns the image the spec describes, building it if its
// directory has none, and points the directory's ImageLink at it.
// Builds of one directory are serialized (a lock file).
func BuildImage(ctx context.Context, spec ImageSpec) (string, error) {
	spec.defaults()
	for _, p := range spec.Packages {
		if p == "" || strings.ContainsAny(p, ", \t\n") || strings.HasPrefix(p, "-") {
			return "", fmt.Errorf("package %q: not a package name", p)
		}
	}
	if need := ImageNeeds(); need != "" {
		return "", errors.New(need)
	}
	sum := sha256.Sum256([]byte(strings.Join(append([]string{imageVersion, spec.Suite, spec.Mirror, strconv.FormatInt(spec.FreeBytes, 10)}, spec.Packages...), " ")))
	key := hex.EncodeToString(sum[:6])
	out := filepath.Join(spec.Dir, "fullvm-"+key+".qcow2")
	if err := os.MkdirAll(spec.Dir, 0o755); err != nil {
		return "", err
	}
	lock, err := os.OpenFile(filepath.Join(spec.Dir, ".fullvm-build.lock"), os.O_CREATE|os.O_RDWR|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return "", err
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return "", err
	}
	if _, err := os.Stat(out); err != nil {
		start := time.Now()
		if err := buildImage(ctx, spec, key, out); err != nil {
			return "", err
		}
		fi, _ := os.Stat(out)
		spec.Logger.Info("fullvm image built", "image", out, "took", time.Since(start).Round(time.Second), "bytes", fi.Size())
	}
	link := filepath.Join(spec.Dir, ImageLink)
	if cur, err := os.Readlink(link); err != nil || cur != filepath.Base(out) {
		tmp := link + ".tmp"
		os.Remove(tmp)
		if err := os.Symlink(filepath.Base(out), tmp); err != nil {
			return "", err
		}
		if err := os.Rename(tmp, link); err != nil {
			return "", err
		}
	}
	return out, nil
}

func buildImage(ctx context.Context, spec ImageSpec, key, out string) (err error) {
	work := filepath.Join(spec.Dir, ".fullvm-build-"+key)
	clean := func() {
		// debootstrap mounts these in the target while it configures.
		for _, m := range []string{"proc", "sys", "dev/pts"} {
			unix.Unmount(filepath.Join(work, "stage", vminit.SystemTree, m), unix.MNT_DETACH)
		}
		os.RemoveAll(work)
	}
	clean()
	defer clean()
	tree := filepath.Join(work, "stage", vminit.SystemTree)
	if err := os.MkdirAll(tree, 0o755); err != nil {
		return err
	}
	log := spec.Logger
	start := time.Now()
	args := []string{"--variant=minbase", "--include=" + strings.Join(spec.Packages, ","), spec.Suite, tree, spec.Mirror}
	if err := runLogged(ctx, "debootstrap", args...); err != nil {
		return err
	}
	log.Info("fullvm image: debootstrap done", "took", time.Since(start).Round(time.Second))
	if err := configureSystem(tree); err != nil {
		return fmt.Errorf("configure the system: %w", err)
	}
	if err := os.MkdirAll(filepath.Join(work, "stage", "rw"), 0o755); err != nil {
		return err
	}
	used, err := treeBytes(filepath.Join(work, "stage"))
	if err != nil {
		return err
	}
	size := (used*5/4 + spec.FreeBytes + 1<<20 - 1) &^ (1<<20 - 1)
	raw := filepath.Join(work, "root.raw")
	if err := runLogged(ctx, "mkfs.ext4", "-q", "-F", "-L", "shoal-root", "-m", "0", "-E", "root_owner=0:0", "-d", filepath.Join(work, "stage"), raw, strconv.FormatInt(size>>10, 10)+"k"); err != nil {
		return err
	}
	tmp := out + ".tmp"
	os.Remove(tmp)
	if err := runLogged(ctx, "qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, tmp); err != nil {
		os.Remove(tmp)
		return err
	}
	if err := os.Chmod(tmp, 0o444); err != nil {
		return err
	}
	return os.Rename(tmp, out)
}

// agentUnit is the agent's systemd unit: started once the basic system is
// up (after sysinit: udev, tmpfiles, journald; the sockets, D-Bus's among
// them), restarted if it ever ends.
const agentUnit = `[Unit]
Description=Shoal guest agent (exec, files, ports for the host)
ConditionPathExists=` + vminit.RunAgent + `

[Service]
ExecStart=` + vminit.RunAgent + ` --vm-service
Restart=always
RestartSec=200ms

[Install]
WantedBy=multi-user.target
`

// configureSystem makes the debootstrapped tree boot fast as a sandbox:
// the agent's unit enabled, no getty, no timers of a long-lived machine,
// a journal in RAM, no identity of its own (the initramfs gives each
// sandbox its host name and machine ID).
func configureSystem(tree string) error {
	etc := filepath.Join(tree, "etc")
	sys := filepath.Join(etc, "systemd", "system")
	if err := os.WriteFile(filepath.Join(sys, "shoal-agent.service"), []byte(agentUnit), 0o644); err != nil {
		return err
	}
	for _, d := range []string{"multi-user.target.wants", "getty.target.wants", "timers.target.wants", "sysinit.target.wants"} {
		os.MkdirAll(filepath.Join(sys, d), 0o755)
	}
	if err := os.Symlink("../shoal-agent.service", filepath.Join(sys, "multi-user.target.wants", "shoal-agent.service")); err != nil {
		return err
	}
	// Enabled by the packages' scripts, useless in a sandbox.
	for _, w := range []string{"getty.target.wants/getty@tty1.service", "multi-user.target.wants/e2scrub_reap.service",
		"sysinit.target.wants/systemd-pstore.service"} {
		os.Remove(filepath.Join(sys, w))
	}
	if ents, err := os.ReadDir(filepath.Join(sys, "timers.target.wants")); err == nil {
		for _, e := range ents {
			os.Remove(filepath.Join(sys, "timers.target.wants", e.Name()))
		}
	}
	// Masked: consoles (the serial console is the host's boot log) and
	// units for long-lived machines.
	for _, u := range []string{"getty.target", "serial-getty@ttyS0.service", "getty@tty1.service",
		"apt-daily.timer", "apt-daily-upgrade.timer", "dpkg-db-backup.timer", "e2scrub_all.timer", "fstrim.timer",
		"systemd-pstore.service", "e2scrub_reap.service", "systemd-timesyncd.service", "systemd-networkd-wait-online.service",
		// Nothing to remount (the root is the initramfs's overlay, no
		// fstab); no seed to carry from one boot to the next (the kernel
		// seeds itself).
		"systemd-remount-fs.service", "systemd-random-seed.service",
		// A journal in RAM has nothing to flush; no utmp records. Under
		// TCG every process systemd starts costs the one vCPU a sandbox
		// usually has (measured: these two were on the agent's critical
		// chain, ~3.5 s).
		"systemd-journal-flush.service", "systemd-update-utmp.service",
		// Debug and trace file systems, huge pages, and modprobe of
		// modules the image does not carry (only the initramfs has the
		// few the boot needs).
		"sys-kernel-debug.mount", "sys-kernel-tracing.mount", "dev-hugepages.mount",
		"modprobe@configfs.service", "modprobe@drm.service", "modprobe@efi_pstore.service", "modprobe@fuse.service", "modprobe@loop.service"} {
		p := filepath.Join(sys, u)
		os.Remove(p)
		if err := os.Symlink("/dev/null", p); err != nil {
			return err
		}
	}
	os.Remove(filepath.Join(sys, "default.target"))
	if err := os.Symlink("/lib/systemd/system/multi-user.target", filepath.Join(sys, "default.target")); err != nil {
		return err
	}
	jd := filepath.Join(etc, "systemd", "journald.conf.d")
	if err := os.MkdirAll(jd, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(jd, "shoal.conf"), []byte("[Journal]\nStorage=volatile\nRuntimeMaxUse=16M\n"), 0o644); err != nil {
		return err
	}
	os.Remove(filepath.Join(etc, "hostname"))
	if err := os.WriteFile(filepath.Join(etc, "machine-id"), nil, 0o444); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(etc, "fstab"), []byte("# the root is assembled by shoal-agent in the initramfs\n"), 0o644); err != nil {
		return err
	}
	// Up to date: the units of ConditionNeedsUpdate= (systemd-sysusers
	// among them) run only when a layer's /usr is newer than the image.
	for _, d := range []string{"etc", "var"} {
		if err := os.WriteFile(filepath.Join(tree, d, ".updated"), []byte("# written by shoal vm image build (see man:systemd-update-done.service(8))\n"), 0o644); err != nil {
			return err
		}
	}
	for _, g := range []string{"var/cache/apt/archives/*.deb", "var/lib/apt/lists/*_*", "var/log/*.log"} {
		files, _ := filepath.Glob(filepath.Join(tree, g))
		for _, f := range files {
			os.Remove(f)
		}
	}
	return nil
}

// treeBytes is the space a tree's files take.
func treeBytes(dir string) (int64, error) {
	var n int64
	err := filepath.WalkDir(dir, func(_ string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			n += st.Blocks * 512
		}
		return nil
	})
	return n, err
}

// runLogged runs a build step, its output in the error when it fails.
func runLogged(ctx context.Context, name string, args ...string) error {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
	var out strings.Builder
	cmd.Stdout = &limitedWriter{w: &out, n: 1 << 20}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Run(); err != nil {
		s := out.String()
		if len(s) > 2000 {
			s = s[len(s)-2000:]
		}
		return fmt.Errorf("%s: %w: %s", name, err, strings.TrimSpace(s))
	}
	return nil
}

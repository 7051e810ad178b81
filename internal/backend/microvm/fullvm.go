package microvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/shoal-sandbox/shoal/internal/agent/vminit"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// A full system (Config.Image; the fullvm backend): the VM boots the same
// kernel and initramfs as a microVM, on a q35 PC, with one more disk, its
// root: a qcow2 overlay (rootOverlay in the sandbox's directory) backed by
// the node's base image (image.go), which the guest sees as an ext4 file
// system holding a Debian system. The agent in the initramfs stacks the
// sandbox's layers over that system, the writable layer on the overlay
// (or on the create's disk), and executes systemd; systemd starts the
// agent again as shoal-agent.service, which serves the host as a microVM's
// agent does (internal/agent/vminit/system.go). Pause and resume are a
// microVM's: the overlay stays in the sandbox's directory, the snapshot
// holds RAM and devices. Delete removes the overlay.
//
// The guest's writes reach the host's disk through QEMU's qcow2 driver
// only: the host never mounts or reads the guest's file system. The
// overlay's virtual size is the image's plus the create's disk size
// (DefaultSystemDisk without one), and the guest's agent grows the file
// system to it before anything else writes: a guest writes at most that
// much more than the image holds (its file system's free space, the disk
// size and a little: ImageSpec.FreeBytes), and the host's file holds at
// most that much (plus qcow2's metadata).

// rootOverlay is a full system's disk in its sandbox's directory.
const rootOverlay = "root.qcow2"

// checkImage reports why Image cannot be booted (nil if it can, or if the
// backend runs no full system).
func (c *Config) checkImage() error {
	if c.Image == "" {
		return nil
	}
	if c.Machine != MachineQ35 {
		return fmt.Errorf("a full system's image boots on the %s machine only", MachineQ35)
	}
	if _, err := os.Stat(c.Image); err != nil {
		return fmt.Errorf("no full-system image (run `shoal vm image build`): %w", err)
	}
	if _, err := exec.LookPath("qemu-img"); err != nil {
		return fmt.Errorf("no qemu-img (apt-get install qemu-utils): %w", err)
	}
	return nil
}

// DefaultSystemDisk is what a full system without a disk size may write
// (a node without disk limits).
const DefaultSystemDisk = 4 << 30

// makeOverlay makes the sandbox's root disk in dir, backed by the current
// image and diskBytes (DefaultSystemDisk if 0) larger than it (the guest
// grows its file system to the disk at boot), and returns that image's
// path (the link resolved: a rebuild does not change the backing file of
// this sandbox).
func (b *Backend) makeOverlay(ctx context.Context, dir string, diskBytes int64) (string, error) {
	base, err := filepath.EvalSymlinks(b.cfg.Image)
	if err != nil {
		return "", fmt.Errorf("%s backend: image: %w", b.cfg.Name, err)
	}
	if base, err = filepath.Abs(base); err != nil {
		return "", err
	}
	info, err := exec.CommandContext(ctx, "qemu-img", "info", "--output=json", "-U", base).Output()
	if err != nil {
		return "", fmt.Errorf("%s backend: image %s: %w", b.cfg.Name, base, err)
	}
	var vi struct {
		Size int64 `json:"virtual-size"`
	}
	if err := json.Unmarshal(info, &vi); err != nil || vi.Size <= 0 {
		return "", fmt.Errorf("%s backend: image %s: no virtual size (%v)", b.cfg.Name, base, err)
	}
	if diskBytes <= 0 {
		diskBytes = DefaultSystemDisk
	}
	size := (vi.Size + diskBytes + 1<<20 - 1) &^ (1<<20 - 1)
	out, err := exec.CommandContext(ctx, "qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", base,
		filepath.Join(dir, rootOverlay), strconv.FormatInt(size, 10)).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("%s backend: root overlay: %w: %s", b.cfg.Name, err, strings.TrimSpace(string(out)))
	}
	return base, nil
}

// systemDisk is the QEMU arguments of h's root disk (none for a microVM).
func systemDisk(b *Backend, h sandbox.Handle) []string {
	if h.Data["image"] == "" {
		return nil
	}
	// The backing file is named in the overlay's header, which qemu-img
	// wrote (the guest writes data clusters only); it is opened read-only
	// and shared by every VM of the node.
	return []string{
		"-drive", "if=none,id=root,format=qcow2,discard=unmap" + b.throttle() + ",file=" + qemuEscape(filepath.Join(h.Data["dir"], rootOverlay)),
		"-device", b.dev("virtio-blk") + ",drive=root,serial=" + vminit.RootSerial,
	}
}

// removeOverlay removes h's root disk, if it has one (after its QEMU is
// gone).
func removeOverlay(h sandbox.Handle) error {
	if h.Data["dir"] == "" {
		return nil
	}
	if err := os.Remove(filepath.Join(h.Data["dir"], rootOverlay)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove the root overlay: %w", err)
	}
	return nil
}

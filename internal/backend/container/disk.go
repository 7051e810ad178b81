package container

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"github.com/shoal-sandbox/shoal/internal/diskimg"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// A sandbox's disk: when the spec gives Resources.DiskBytes and the backend
// has disk images (Config.DiskDir), its overlay upper and work directories
// live on an ext4 image of that size of its own (diskimg), mounted at
// Spec.Dir/disk; the sandbox gets ENOSPC when it is full, and the host's
// disk holds at most that much for it. Otherwise they are plain
// directories in Spec.Dir, as large as the host's disk lets them be.
const (
	diskImageName = "disk.img"
	diskMountName = "disk"
)

// initDisks sets up disk images for New: templates in dir, checked by
// mounting one. On a host that cannot (no loop devices, no ext4,
// no mkfs.ext4) it says why and the backend runs without disk limits.
func (b *Backend) initDisks(ctx context.Context, dir string) {
	if dir == "" {
		b.diskMode = "off (not configured)"
		return
	}
	m, err := diskimg.NewMaker(filepath.Join(dir, "templates"))
	if err == nil {
		err = m.Check(ctx, dir)
	}
	if err != nil {
		b.diskMode = "off: " + err.Error()
		b.log.Error("container backend: sandboxes get NO disk limit: their writable layers can fill the host's disk", "err", err)
		return
	}
	b.disks = m
	b.diskMode = "ext4 image per sandbox on a loop device"
}

// DiskLimits reports whether the backend bounds each sandbox's writable
// layer, and how (or why not).
func (b *Backend) DiskLimits() (bool, string) { return b.disks != nil, b.diskMode }

// writableLayer makes the upper and work directories of a sandbox whose
// state directory is dir, on a disk image of its own when spec asks for a
// size, and registers their removal with undo. premade, if not empty, is a
// directory holding a disk of that size made ahead (premakeDisk): the
// layer goes there.
func (b *Backend) writableLayer(ctx context.Context, spec sandbox.Spec, dir, premade string, undo *undoStack) (upper, work string, err error) {
	size := spec.Resources.DiskBytes
	if size < 0 {
		return "", "", fmt.Errorf("negative disk size %d", size)
	}
	if premade != "" {
		undo.push("remove disk", func() error { return removeDisk(premade) })
		mnt := filepath.Join(premade, diskMountName)
		return filepath.Join(mnt, upperDir), filepath.Join(mnt, workDir), nil
	}
	if size == 0 || b.disks == nil {
		if size > 0 {
			return "", "", fmt.Errorf("a disk limit: %w on this node (%s)", sandbox.ErrUnsupported, b.diskMode)
		}
		upper, work = filepath.Join(dir, upperDir), filepath.Join(dir, workDir)
		undo.push("remove writable layer", func() error { return removeAll(upper, work) })
		return upper, work, nil
	}
	undo.push("remove disk", func() error { return removeDisk(dir) })
	return b.makeDisk(ctx, dir, size)
}

// makeDisk makes a disk image of size in dir, mounts it at dir/disk and
// makes the upper and work directories on it. The caller removes it
// (removeDisk) on failure.
func (b *Backend) makeDisk(ctx context.Context, dir string, size int64) (upper, work string, err error) {
	img, mnt := filepath.Join(dir, diskImageName), filepath.Join(dir, diskMountName)
	if err := b.disks.Make(ctx, img, size); err != nil {
		return "", "", err
	}
	if err := os.Mkdir(mnt, 0o700); err != nil {
		return "", "", fmt.Errorf("disk mount point: %w", err)
	}
	if err := diskimg.Mount(img, mnt); err != nil {
		return "", "", err
	}
	upper, work = filepath.Join(mnt, upperDir), filepath.Join(mnt, workDir)
	for _, d := range []string{upper, work} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return "", "", fmt.Errorf("writable layer: %w", err)
		}
	}
	return upper, work, nil
}

// premakeDisk gives a waiting pool container a disk of the size most
// sandboxes ask (Config.PremadeDisk, the node's default), made and mounted
// now, off the create path: a claim of that size takes it (the image copy,
// loop attach and mount cost 15–50 ms on a loaded 2-core host, against a
// claim's 2–9 ms). Failing is not fatal: the claim makes one.
func (b *Backend) premakeDisk(ctx context.Context, m *member) {
	if b.disks == nil || b.premadeDisk <= 0 {
		return
	}
	upper, _, err := b.makeDisk(ctx, m.dir, b.premadeDisk)
	if err == nil && m.idmap != nil {
		err = chownToRoot(upper, m.idmap)
	}
	if err != nil {
		b.log.Warn("pool container: no disk made ahead", "runc_id", m.id, "err", err)
		if err := removeDisk(m.dir); err != nil {
			b.log.Error("pool container: remove its disk", "runc_id", m.id, "err", err)
		}
		return
	}
	m.disk = b.premadeDisk
}

// removeDisk unmounts and removes a sandbox's disk image, if it has one.
func removeDisk(dir string) error {
	mnt := filepath.Join(dir, diskMountName)
	if err := diskimg.Unmount(mnt); err != nil {
		return err
	}
	var errs []error
	for _, p := range []string{mnt, filepath.Join(dir, diskImageName)} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// handleData adds what a handle says of the writable layer: where the
// upper directory is (the node commits it) and the disk's size.
func handleData(data map[string]string, spec sandbox.Spec, upper string) map[string]string {
	data["upper"] = upper
	if spec.Resources.DiskBytes > 0 {
		data["disk_bytes"] = strconv.FormatInt(spec.Resources.DiskBytes, 10)
	}
	return data
}

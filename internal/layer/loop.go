package layer

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// loopDev is a read-only loop device over a file, set to detach itself
// when its last user (the EROFS mount) goes.
type loopDev struct {
	path string
	f    *os.File
}

// Close drops this process's handle; the device stays while mounted.
func (d *loopDev) Close() { d.f.Close() }

// attachLoop sets up a free loop device over backing, read-only with
// autoclear. Used for images on a FUSE file, which the kernel's
// file-backed EROFS mount refuses ("block device required").
// Loop device tuning for lazy images (see attachLoop).
var (
	// loopReadaheadKB is the readahead of a loop device over a lazy image:
	// what EROFS reads beyond a miss. The kernel's default for a loop
	// device (2.5 MiB here) fetched 5-10x what a workload read.
	loopReadaheadKB = 16
	// loopDirectIO opens the FUSE file O_DIRECT (no second page cache of
	// the image, no FUSE readahead). Off: with it, every page EROFS's cache
	// dropped (sandboxes' memory limits reclaim it) was read through the
	// FUSE server again, and bench lazy's workloads ran 5x slower; the FUSE
	// file's own readahead is bounded by the mount's max_readahead instead.
	loopDirectIO = false
)

const (
	blkRASet        = 0x1262 // BLKRASET: readahead in 512-byte sectors
	loFlagsDirectIO = 16     // LO_FLAGS_DIRECT_IO
	loopChangeFD    = 0x4C06 // LOOP_CHANGE_FD
)

func attachLoop(backing string) (*loopDev, error) {
	bf, err := os.Open(backing)
	if err != nil {
		return nil, fmt.Errorf("loop device: %w", err)
	}
	defer bf.Close()
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("loop device: %w", err)
	}
	defer ctl.Close()
	for range 16 { // another process may take the free device first
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return nil, fmt.Errorf("loop device: get free: %w", err)
		}
		path := fmt.Sprintf("/dev/loop%d", n)
		f, err := os.OpenFile(path, os.O_RDONLY, 0)
		if err != nil {
			return nil, fmt.Errorf("loop device: %w", err)
		}
		cfg := unix.LoopConfig{Fd: uint32(bf.Fd())}
		cfg.Info.Flags = unix.LO_FLAGS_READ_ONLY | unix.LO_FLAGS_AUTOCLEAR
		if loopDirectIO {
			cfg.Info.Flags |= loFlagsDirectIO
		}
		if err := unix.IoctlLoopConfigure(int(f.Fd()), &cfg); err != nil {
			f.Close()
			if errors.Is(err, unix.EBUSY) {
				continue
			}
			return nil, fmt.Errorf("loop device %s: configure: %w", path, err)
		}
		if err := unix.IoctlSetInt(int(f.Fd()), blkRASet, loopReadaheadKB*2); err != nil {
			f.Close()
			return nil, fmt.Errorf("loop device %s: set readahead: %w", path, err)
		}
		return &loopDev{path: path, f: f}, nil
	}
	return nil, errors.New("loop device: every free device was taken by someone else")
}

// repointLoop takes over the EROFS mount at dir left by an earlier
// process: if its top mount is EROFS on a loop device whose backing file
// was a lazy file of the image hexd, the device is turned to file (the
// same image served by this process's loader; LOOP_CHANGE_FD, allowed for
// read-only devices and a file of the same size) and returned. It returns
// nil, nil when dir is no such mount.
func repointLoop(dir, file, hexd string) (*loopDev, error) {
	mounts, err := readMountinfo()
	if err != nil {
		return nil, err
	}
	var top *mountEntry
	for i := range mounts {
		if mounts[i].point == dir {
			top = &mounts[i]
		}
	}
	if top == nil || top.fstype != "erofs" || !strings.HasPrefix(top.source, "/dev/loop") {
		return nil, nil
	}
	name := strings.TrimPrefix(top.source, "/dev/")
	b, err := os.ReadFile(filepath.Join("/sys/block", name, "loop", "backing_file"))
	if err != nil {
		return nil, nil
	}
	backing := strings.TrimSuffix(strings.TrimSpace(string(b)), " (deleted)")
	if filepath.Base(backing) != hexd {
		return nil, nil
	}
	f, err := os.OpenFile(top.source, os.O_RDONLY, 0)
	if err != nil {
		return nil, fmt.Errorf("loop device %s: %w", top.source, err)
	}
	bf, err := os.Open(file)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("loop device %s: %w", top.source, err)
	}
	defer bf.Close()
	if err := unix.IoctlSetInt(int(f.Fd()), loopChangeFD, int(bf.Fd())); err != nil {
		f.Close()
		return nil, fmt.Errorf("loop device %s: change backing file: %w", top.source, err)
	}
	return &loopDev{path: top.source, f: f}, nil
}

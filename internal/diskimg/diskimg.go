// Package diskimg gives a sandbox's writable layer a file system of its own
// with a fixed size and number of inodes: a sparse ext4 image file on the
// node's disk, attached to a loop device and mounted where the backend
// keeps the sandbox's overlay upper and work directories. A sandbox that
// fills it gets ENOSPC (blocks or inodes) from its own file system; the
// host's disk holds at most the image's size for it, whatever it writes.
//
// Why not project quotas (docker's --storage-opt size): they need
// CONFIG_QFMT_V2 for ext4 or CONFIG_XFS_QUOTA, which kernels built for small
// VMs (like the development machine's) leave out, while ext4 on a loop
// device works on every kernel with loop support. Making an image costs no
// mkfs per sandbox: one template image is formatted (mkfs.ext4) per size and
// inode count the first time it is asked for, and each sandbox's image is a
// sparse copy of the template's few hundred KiB of metadata.
//
// The image lives in the sandbox's own directory (the node's, never visible
// to the workload); the host never reads the workload's files inside it.
// Mounts are made with the loop device in autoclear mode: unmounting the
// file system (Unmount detaches it lazily, so a pooled sandbox's overlay
// that still holds it in a dying mount namespace is no obstacle) releases
// the loop device, and removing the image file then frees its blocks.
package diskimg

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Bounds of an image.
const (
	MinBytes = 16 << 20 // ext4 with 4 KiB blocks needs a few MiB of its own
	// MaxBytes is ext4's limit with 4 KiB blocks and 32-bit block numbers
	// (16 TiB), which mkfs picks for images this size; far above any disk.
	MaxBytes = 16 << 40
	// BytesPerInode derives an image's inode count from its size (mkfs's
	// -i): one inode per 8 KiB, at least MinInodes.
	BytesPerInode = 8 << 10
	MinInodes     = 1024
	blockSize     = 4096
)

// Inodes is the inode count of an image of size bytes.
func Inodes(size int64) int64 {
	return max(size/BytesPerInode, MinInodes)
}

// Maker makes images from templates kept in one directory. Safe for
// concurrent use.
type Maker struct {
	dir  string // templates: <size>-<inodes>.img
	mkfs string // mkfs.ext4's path

	mu        sync.Mutex
	templates map[string]*sync.Once // by file name; Once formats it
	errs      map[string]error
}

// NewMaker returns a Maker whose templates live in dir (created if needed).
// It fails when mkfs.ext4 is not installed or the kernel cannot mount ext4
// from a loop device: Check tells why.
func NewMaker(dir string) (*Maker, error) {
	mkfs, err := exec.LookPath("mkfs.ext4")
	if err != nil {
		return nil, fmt.Errorf("disk images: mkfs.ext4 not found (Debian: e2fsprogs): %w", err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("disk images: %w", err)
	}
	return &Maker{dir: dir, mkfs: mkfs, templates: map[string]*sync.Once{}, errs: map[string]error{}}, nil
}

// Check makes, mounts and removes a small image under dir: it tells whether
// this host can give sandboxes disk images at all.
func (m *Maker) Check(ctx context.Context, dir string) error {
	img := filepath.Join(dir, "check.img")
	mnt := filepath.Join(dir, "check.mnt")
	defer os.Remove(img)
	defer os.Remove(mnt)
	if err := m.Make(ctx, img, MinBytes); err != nil {
		return err
	}
	if err := os.Mkdir(mnt, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	if err := Mount(img, mnt); err != nil {
		return err
	}
	return Unmount(mnt)
}

// Make creates the image file path (which must not exist) of size bytes.
func (m *Maker) Make(ctx context.Context, path string, size int64) error {
	if size < MinBytes || size > MaxBytes {
		return fmt.Errorf("disk image size %d bytes out of range [%d, %d]", size, int64(MinBytes), int64(MaxBytes))
	}
	size = size / blockSize * blockSize
	tmpl, err := m.template(ctx, size)
	if err != nil {
		return err
	}
	if err := copySparse(tmpl, path, size); err != nil {
		os.Remove(path)
		return fmt.Errorf("disk image %s: %w", path, err)
	}
	return nil
}

// template returns the path of the formatted template of that size, made
// on first use (concurrent callers wait for the one formatting it).
func (m *Maker) template(ctx context.Context, size int64) (string, error) {
	inodes := Inodes(size)
	name := strconv.FormatInt(size, 10) + "-" + strconv.FormatInt(inodes, 10) + ".img"
	path := filepath.Join(m.dir, name)
	m.mu.Lock()
	once := m.templates[name]
	if once == nil {
		once = new(sync.Once)
		m.templates[name] = once
	}
	m.mu.Unlock()
	once.Do(func() {
		err := m.format(ctx, path, size, inodes)
		m.mu.Lock()
		if err != nil {
			// Not kept: the next Make tries again.
			delete(m.templates, name)
		}
		m.errs[name] = err
		m.mu.Unlock()
	})
	m.mu.Lock()
	err := m.errs[name]
	m.mu.Unlock()
	return path, err
}

// format makes the template image at path, unless a valid one is there
// (from an earlier process: written to a temporary name, then renamed).
func (m *Maker) format(ctx context.Context, path string, size, inodes int64) error {
	if fi, err := os.Stat(path); err == nil && fi.Size() == size {
		return nil
	}
	tmp := path + ".tmp"
	os.Remove(tmp)
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("disk image template: %w", err)
	}
	err = f.Truncate(size)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("disk image template: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	// No journal (the upper dies with its sandbox and is mounted volatile),
	// no reserved blocks (the sandbox gets the whole size), no resize
	// inode, lazy inode tables: a few hundred KiB of metadata whatever the
	// size. The root is root's, 0755, as overlayfs wants an upper's parent.
	cmd := exec.CommandContext(ctx, m.mkfs, "-q", "-F", "-t", "ext4",
		"-b", strconv.Itoa(blockSize), "-N", strconv.FormatInt(inodes, 10), "-m", "0",
		"-O", "^has_journal,^resize_inode",
		"-E", "lazy_itable_init=1,nodiscard,root_owner=0:0",
		"-L", "shoal-upper", tmp)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("disk image template: mkfs.ext4: %w: %s", err, bytes.TrimSpace(out.Bytes()))
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("disk image template: %w", err)
	}
	return nil
}

// copySparse copies the data extents of src into a new sparse file dst of
// the given size, in the kernel (copy_file_range) where it can: a template's
// data is ~150 KiB, and a user-space buffer for it was most of a pool
// member's disk (a 256 KiB zeroed allocation each time).
func copySparse(src, dst string, size int64) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	if err := out.Truncate(size); err != nil {
		out.Close()
		return err
	}
	ifd := int(in.Fd())
	var off int64
	for off < size {
		data, err := unix.Seek(ifd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // no data past off
		}
		if err != nil {
			out.Close()
			return fmt.Errorf("seek data: %w", err)
		}
		hole, err := unix.Seek(ifd, data, unix.SEEK_HOLE)
		if err != nil {
			out.Close()
			return fmt.Errorf("seek hole: %w", err)
		}
		hole = min(hole, size)
		if err := copyRange(in, out, data, hole-data); err != nil {
			out.Close()
			return err
		}
		off = hole
	}
	return out.Close()
}

// copyRange copies n bytes at off of in to the same offset of out: by
// copy_file_range, else (a kernel or file system without it) through a
// buffer.
func copyRange(in, out *os.File, off, n int64) error {
	inOff, outOff := off, off
	for n > 0 {
		w, err := unix.CopyFileRange(int(in.Fd()), &inOff, int(out.Fd()), &outOff, int(min(n, 1<<30)), 0)
		if err != nil {
			if errors.Is(err, unix.EXDEV) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.EINVAL) {
				_, err = io.CopyBuffer(io.NewOffsetWriter(out, inOff), io.NewSectionReader(in, inOff, n), make([]byte, 256<<10))
			}
			return err
		}
		if w == 0 {
			return fmt.Errorf("copy %s: %w", in.Name(), io.ErrUnexpectedEOF)
		}
		n -= int64(w)
	}
	return nil
}

// Mount attaches the image to a free loop device (autoclear, direct I/O)
// and mounts its ext4 file system at target.
func Mount(image, target string) error {
	f, err := os.OpenFile(image, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("mount disk image: %w", err)
	}
	defer f.Close()
	loop, err := attach(f)
	if err != nil {
		return fmt.Errorf("mount disk image %s: %w", image, err)
	}
	defer loop.Close() // autoclear: the mount holds the device from here on
	dev := loop.Name()
	if err := unix.Mount(dev, target, "ext4", unix.MS_NOATIME, ""); err != nil {
		return fmt.Errorf("mount disk image %s (%s) at %s: %w", image, dev, target, err)
	}
	return nil
}

// attach binds f to a free loop device and returns the device, open.
func attach(f *os.File) (*os.File, error) {
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer ctl.Close()
	cfg := unix.LoopConfig{Fd: uint32(f.Fd()), Size: blockSize}
	cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR | unix.LO_FLAGS_DIRECT_IO
	// Another process may take the device that GET_FREE named before we
	// configure it (EBUSY): ask again.
	for try := 0; ; try++ {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return nil, fmt.Errorf("find a free loop device: %w", err)
		}
		dev, err := os.OpenFile("/dev/loop"+strconv.Itoa(n), os.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			if errors.Is(err, os.ErrNotExist) && try < 100 {
				continue // the node is being created (udev-less hosts have it at once)
			}
			return nil, err
		}
		err = unix.IoctlLoopConfigure(int(dev.Fd()), &cfg)
		if err == nil {
			return dev, nil
		}
		dev.Close()
		if !errors.Is(err, unix.EBUSY) || try >= 100 {
			return nil, fmt.Errorf("configure loop device %d: %w", n, err)
		}
	}
}

// Unmount detaches the file system mounted at target (lazily: whatever
// still holds it lets go later, and the loop device with it). Nothing
// mounted there is not an error.
func Unmount(target string) error {
	err := unix.Unmount(target, unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW)
	if err == nil || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
		return nil
	}
	return fmt.Errorf("unmount disk image at %s: %w", target, err)
}

// IsMounted reports whether an ext4 file system is mounted at target
// (the root of a mount).
func IsMounted(target string) bool {
	var stx unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, target, unix.AT_SYMLINK_NOFOLLOW|unix.AT_NO_AUTOMOUNT, 0, &stx); err != nil {
		return false
	}
	if stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		return false
	}
	var fs unix.Statfs_t
	return unix.Statfs(target, &fs) == nil && fs.Type == unix.EXT4_SUPER_MAGIC
}

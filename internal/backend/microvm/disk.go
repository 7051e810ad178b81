package microvm

import (
	"path/filepath"

	"github.com/shoal-sandbox/shoal/internal/diskimg"
)

// A VM's disk limit: a create with Resources.DiskBytes gets its writable
// layer on an ext4 image of that size in its directory (a sparse copy of a
// template formatted once per size, as containers' disks are), attached as
// a read-write virtio-blk device that the guest mounts, with discard, where
// it would otherwise use a tmpfs in its RAM. A guest that fills it gets
// ENOSPC from its own file system; the host's disk holds at most the
// image's size for it, and the guest's RAM none of its files. The host
// never mounts or reads the image: a hostile guest's file system is parsed
// by the guest's kernel only.

// upperImage is the writable layer's image in the sandbox's directory.
const upperImage = "upper.img"

func (b *Backend) initDisks() {
	m, err := diskimg.NewMaker(filepath.Join(b.cfg.StateDir, b.cfg.Name+"-disk-templates"))
	if err != nil {
		b.diskMode = err.Error()
		return
	}
	b.disks, b.diskMode = m, "ext4 image per VM as a virtio-blk device"
}

// DiskLimits implements sandbox.DiskLimiter.
func (b *Backend) DiskLimits() (bool, string) {
	if b.cfg.Image != "" {
		return true, "the root overlay (qcow2) grown by the disk's size"
	}
	return b.disks != nil, b.diskMode
}

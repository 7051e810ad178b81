package container

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// isOverlayMount reports whether path is the root of an overlay mount.
func isOverlayMount(path string) (bool, error) {
	var stx unix.Statx_t
	err := unix.Statx(unix.AT_FDCWD, path, unix.AT_SYMLINK_NOFOLLOW|unix.AT_NO_AUTOMOUNT, unix.STATX_TYPE, &stx)
	if errors.Is(err, unix.ENOENT) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("stat %s: %w", path, err)
	}
	if stx.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		return false, fmt.Errorf("stat %s: kernel does not report mount roots", path)
	}
	if stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		return false, nil
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(path, &fs); err != nil {
		return false, fmt.Errorf("statfs %s: %w", path, err)
	}
	return fs.Type == unix.OVERLAYFS_SUPER_MAGIC, nil
}

package layer

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// maxLowers is overlayfs's limit on stacked lower layers (OVL_MAX_STACK).
const maxLowers = 500

// Compose mounts an overlayfs at target whose lower layers are lowers (top
// first: a file in lowers[0] hides the same path in lowers[1:]) and whose
// writable layer is upper, with work as its scratch directory (upper and
// work on the same file system). target, upper and work are created if
// missing. Each lower is passed as its own "lowerdir+" parameter of the new
// mount API (Linux >= 6.8), so there is no limit on the length of their
// paths together. The mount is made in the caller's mount namespace; undo
// it with Unmount.
//
// volatile skips every sync of the upper: for a sandbox's private upper that
// dies with it, this saves a syncfs of the whole host file system on each
// unmount (3-5 ms, hundreds of ms on a busy disk) and makes sync(1) in a
// sandbox free. The price: the upper can never be mounted again after a
// host crash (the kernel refuses a workdir used volatile).
func Compose(target string, lowers []string, upper, work string, volatile bool) error {
	if err := compose(target, lowers, upper, work, volatile); err != nil {
		return fmt.Errorf("compose %s: %w", target, err)
	}
	return nil
}

// ComposeMapped is Compose with every lower seen through an idmapped mount
// of usernsFD's mapping (see ComposeFDMapped).
func ComposeMapped(target string, lowers []string, usernsFD int, upper, work string, volatile bool) error {
	if err := composeMapped(target, lowers, usernsFD, upper, work, volatile); err != nil {
		return fmt.Errorf("compose %s: %w", target, err)
	}
	return nil
}

func compose(target string, lowers []string, upper, work string, volatile bool) error {
	return composeMapped(target, lowers, -1, upper, work, volatile)
}

func composeMapped(target string, lowers []string, usernsFD int, upper, work string, volatile bool) error {
	mfd, err := overlayFD(lowers, usernsFD, upper, work, volatile)
	if err != nil {
		return err
	}
	defer unix.Close(mfd)
	if err := os.MkdirAll(target, 0o755); err != nil {
		return err
	}
	if err := unix.MoveMount(mfd, "", unix.AT_FDCWD, target, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("move mount: %w", err)
	}
	return nil
}

// ComposeFD is Compose without the target: it returns the overlay as a
// detached mount (an fsmount file descriptor, close-on-exec) that is not
// attached anywhere in the caller's mount namespace. Its holder can attach
// it with move_mount(2), in another mount namespace too: the container
// backend passes it to a pre-started sandbox, whose agent makes it its
// root. The mount disappears when the last descriptor to it is closed and
// it is attached nowhere, or when the mount namespace it was attached in
// goes away. The caller closes the descriptor.
func ComposeFD(lowers []string, upper, work string, volatile bool) (int, error) {
	return ComposeFDMapped(lowers, -1, upper, work, volatile)
}

// ComposeFDMapped is ComposeFD with every lower seen through an idmapped
// mount (mount_setattr MOUNT_ATTR_IDMAP) of the mapping of the user
// namespace usernsFD: a file owned by id u in a layer appears owned by the
// host id u maps to, so that a sandbox in a user namespace of that mapping
// sees its layers' files with their own owners (root's as its root). The
// idmapped mounts are private clones of the layers' mounts (open_tree
// OPEN_TREE_CLONE), handed to overlayfs as descriptors and attached
// nowhere: the layers' shared mounts are unchanged. The upper is not
// idmapped: what the sandbox writes is stored with host ids of its range.
// usernsFD < 0 is ComposeFD.
func ComposeFDMapped(lowers []string, usernsFD int, upper, work string, volatile bool) (int, error) {
	fd, err := overlayFD(lowers, usernsFD, upper, work, volatile)
	if err != nil {
		return -1, fmt.Errorf("compose overlay: %w", err)
	}
	return fd, nil
}

// idmappedClone returns a detached clone of the mount at path, idmapped by
// the mapping of the user namespace usernsFD.
func idmappedClone(path string, usernsFD int) (int, error) {
	fd, err := unix.OpenTree(unix.AT_FDCWD, path, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("clone mount %s: %w", path, err)
	}
	attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_IDMAP, Userns_fd: uint64(usernsFD)}
	if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, &attr); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("idmap mount %s: %w", path, err)
	}
	return fd, nil
}

// overlayFD creates the overlay of Compose as a detached mount.
func overlayFD(lowers []string, usernsFD int, upper, work string, volatile bool) (int, error) {
	if len(lowers) == 0 || len(lowers) > maxLowers {
		return -1, fmt.Errorf("%d lower layers: want 1 to %d", len(lowers), maxLowers)
	}
	for _, d := range []string{upper, work} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return -1, err
		}
	}
	fsfd, err := unix.Fsopen("overlay", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("fsopen overlay: %w", err)
	}
	defer unix.Close(fsfd)
	// Each directory is given as /proc/self/fd/N of an O_PATH descriptor
	// rather than by its host path: overlayfs shows its options as they were
	// given in /proc/self/mountinfo, which the sandbox can read, and host
	// paths (the node's data directory, layer digests, the sandbox's own
	// directory) are none of its business. The kernel resolves the magic
	// link at fsconfig, so the descriptors can be closed once the overlay
	// exists.
	set := func(key, dir string) error {
		fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("overlay %s=%s: %w", key, dir, err)
		}
		defer unix.Close(fd)
		if err := unix.FsconfigSetString(fsfd, key, "/proc/self/fd/"+strconv.Itoa(fd)); err != nil {
			return fmt.Errorf("overlay %s=%s: %w%s", key, dir, err, fsMessages(fsfd))
		}
		return nil
	}
	for _, l := range lowers {
		if usernsFD < 0 {
			if err := set("lowerdir+", l); err != nil {
				return -1, err
			}
			continue
		}
		lfd, err := idmappedClone(l, usernsFD)
		if err != nil {
			return -1, fmt.Errorf("overlay lowerdir+=%s: %w", l, err)
		}
		// overlayfs clones the layer's mount privately when the overlay is
		// created: ours must live until then (closing the last descriptor
		// of a detached mount unmounts it).
		defer unix.Close(lfd)
		if err := unix.FsconfigSetFd(fsfd, "lowerdir+", lfd); err != nil {
			return -1, fmt.Errorf("overlay lowerdir+=%s (idmapped): %w%s", l, err, fsMessages(fsfd))
		}
	}
	if err := set("upperdir", upper); err != nil {
		return -1, err
	}
	if err := set("workdir", work); err != nil {
		return -1, err
	}
	if volatile {
		if err := unix.FsconfigSetFlag(fsfd, "volatile"); err != nil {
			return -1, fmt.Errorf("overlay volatile: %w%s", err, fsMessages(fsfd))
		}
	}
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return -1, fmt.Errorf("create overlay: %w%s", err, fsMessages(fsfd))
	}
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("fsmount overlay: %w%s", err, fsMessages(fsfd))
	}
	return mfd, nil
}

// fsMessages returns the kernel's messages queued on a file system context
// (why fsconfig refused a parameter), formatted to append to an error.
func fsMessages(fsfd int) string {
	var msgs []string
	buf := make([]byte, 4096)
	for range 16 {
		n, err := unix.Read(fsfd, buf)
		if err != nil || n <= 0 {
			break
		}
		msgs = append(msgs, strings.TrimSpace(string(buf[:n])))
	}
	if len(msgs) == 0 {
		return ""
	}
	return " (" + strings.Join(msgs, "; ") + ")"
}

// Unmount unmounts the overlay root at target (detaching it if busy). It
// returns nil if target is not mounted or does not exist, so it may be
// called again after a failure.
func Unmount(target string) error {
	return unmountAll(target)
}

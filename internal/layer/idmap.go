package layer

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
)

// ProbeIDMapped checks that this kernel composes a sandbox root the way
// ComposeFDMapped does: an EROFS layer mounted from its file, cloned and
// idmapped by the mapping of the user namespace usernsFD, handed to
// overlayfs as a descriptor, with a file of the layer then owned by the
// mapped id. It works in a scratch directory below dir, removed after.
// The error says which step the kernel refused.
func ProbeIDMapped(dir string, usernsFD int, hostUID uint32) error {
	tmp, err := os.MkdirTemp(dir, "idmap-probe-")
	if err != nil {
		return fmt.Errorf("idmap probe: %w", err)
	}
	defer os.RemoveAll(tmp)
	tree := filepath.Join(tmp, "tree")
	img := filepath.Join(tmp, "probe.erofs")
	mnt := filepath.Join(tmp, "layer")
	for _, d := range []string{tree, mnt} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return fmt.Errorf("idmap probe: %w", err)
		}
	}
	if err := os.WriteFile(filepath.Join(tree, "f"), nil, 0o644); err != nil {
		return fmt.Errorf("idmap probe: %w", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if out, err := exec.CommandContext(ctx, "mkfs.erofs", "-T0", "--quiet", img, tree).CombinedOutput(); err != nil {
		return fmt.Errorf("idmap probe: mkfs.erofs: %w: %s", err, out)
	}
	if err := unix.Mount(img, mnt, "erofs", layerMountFlags, ""); err != nil {
		return fmt.Errorf("idmap probe: mount erofs: %w", err)
	}
	defer unix.Unmount(mnt, unix.MNT_DETACH)
	mfd, err := ComposeFDMapped([]string{mnt}, usernsFD, filepath.Join(tmp, "upper"), filepath.Join(tmp, "work"), true)
	if err != nil {
		return fmt.Errorf("idmap probe: %w", err)
	}
	defer unix.Close(mfd)
	var st unix.Stat_t
	if err := unix.Fstatat(mfd, "f", &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("idmap probe: stat: %w", err)
	}
	if st.Uid != hostUID {
		return fmt.Errorf("idmap probe: a layer file owned by 0 appears owned by %d through the idmapped overlay, want %d", st.Uid, hostUID)
	}
	return nil
}

package layer

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/procfs"
)

const layerMountFlags = unix.MS_RDONLY | unix.MS_NODEV | unix.MS_NOSUID

// Acquire returns the read-only mount of the image with this digest,
// mounting it on first use at DATA/layers/mnt/<first 16 hex of the digest>
// (file-backed EROFS, no loop device). Each Acquire must be paired with one
// Release. If the directory already holds an EROFS mount of this image (left
// by an earlier process, e.g. a node agent killed and restarted) it is
// adopted, not mounted again. An unknown digest wraps ErrNotFound.
func (s *Store) Acquire(digest string) (mountPath string, err error) {
	img := s.ImagePath(digest)
	if img == "" {
		return "", fmt.Errorf("acquire layer: %w", validateDigest(digest))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.touchLocked(digest)
	if m := s.mounts[digest]; m != nil {
		m.refs++
		return m.path, nil
	}
	dir := filepath.Join(s.mnt, digest[len("sha256:"):][:16])
	for other, m := range s.mounts {
		if m.path == dir {
			return "", fmt.Errorf("acquire layer %s: mount point %s is taken by %s", digest, dir, other)
		}
	}
	var release func()
	if _, err := os.Stat(img); err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			return "", fmt.Errorf("acquire layer %s: %w", digest, err)
		}
		// Not on this node: from the layer store.
		var repointed bool
		if img, release, repointed, err = s.remoteImage(digest, dir); err != nil {
			return "", fmt.Errorf("acquire layer %s: %w", digest, err)
		}
		if release != nil && !repointed {
			// A loop device is new each time: what an earlier process
			// left here was served by its FUSE server, now gone.
			if err := unmountAll(dir); err != nil {
				release()
				return "", fmt.Errorf("acquire layer %s: %w", digest, err)
			}
		}
	}

	adopted, err := adoptable(dir, img)
	if err != nil {
		if release != nil {
			release()
		}
		return "", fmt.Errorf("acquire layer %s: %w", digest, err)
	}
	if adopted {
		s.log.Info("layer mount adopted", "digest", digest, "path", dir)
	} else {
		if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
			return "", fmt.Errorf("acquire layer %s: %w", digest, err)
		}
		if err := unix.Mount(img, dir, "erofs", layerMountFlags, ""); err != nil {
			os.Remove(dir)
			if release != nil {
				release()
			}
			return "", fmt.Errorf("acquire layer %s: mount %s: %w", digest, img, err)
		}
		s.log.Debug("layer mounted", "digest", digest, "path", dir, "source", img)
	}
	s.mounts[digest] = &mount{path: dir, refs: 1, release: release}
	return dir, nil
}

// adoptable reports whether dir is already an EROFS mount of img. It
// returns an error if dir is some other mount.
func adoptable(dir, img string) (bool, error) {
	if _, err := os.Lstat(dir); errors.Is(err, fs.ErrNotExist) {
		return false, nil // the common case: no need to read mountinfo
	}
	mounts, err := readMountinfo()
	if err != nil {
		return false, err
	}
	var top *mountEntry
	for i := range mounts {
		if mounts[i].point == dir {
			top = &mounts[i] // the last one listed is on top
		}
	}
	switch {
	case top == nil:
		return false, nil
	case top.fstype == "erofs" && top.source == img:
		return true, nil
	}
	return false, fmt.Errorf("%s is already a %s mount of %s", dir, top.fstype, top.source)
}

// Release drops one reference taken by Acquire. The last one unmounts the
// image (lazily if it is still busy) and removes its mount point.
func (s *Store) Release(digest string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	m := s.mounts[digest]
	if m == nil {
		return fmt.Errorf("release layer %s: not acquired", digest)
	}
	m.refs--
	if m.refs > 0 {
		return nil
	}
	delete(s.mounts, digest)
	err := unmountDir(m.path)
	if m.release != nil {
		m.release()
	}
	s.touchLocked(digest)
	s.trimCacheLocked("")
	if err != nil {
		return fmt.Errorf("release layer %s: %w", digest, err)
	}
	s.log.Debug("layer unmounted", "digest", digest, "path", m.path)
	return nil
}

// Refs returns the number of unreleased Acquires of digest.
func (s *Store) Refs(digest string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if m := s.mounts[digest]; m != nil {
		return m.refs
	}
	return 0
}

// Sweep unmounts and removes every mount point under DATA/layers/mnt that
// no Acquire of this Store holds. A node calls it once after recovery, when
// it has acquired the layers of every live sandbox.
func (s *Store) Sweep() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	live := make(map[string]bool, len(s.mounts))
	for _, m := range s.mounts {
		live[m.path] = true
	}
	stale := make(map[string]bool)
	mounts, err := readMountinfo()
	if err != nil {
		return fmt.Errorf("sweep layer mounts: %w", err)
	}
	for _, m := range mounts {
		if filepath.Dir(m.point) == s.mnt && !live[m.point] {
			stale[m.point] = true
		}
	}
	dirs, err := os.ReadDir(s.mnt)
	if err != nil {
		return fmt.Errorf("sweep layer mounts: %w", err)
	}
	for _, d := range dirs {
		if p := filepath.Join(s.mnt, d.Name()); !live[p] {
			stale[p] = true
		}
	}
	var errs []error
	for p := range stale {
		if err := unmountDir(p); err != nil {
			errs = append(errs, err)
			continue
		}
		s.log.Info("stale layer mount removed", "path", p)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("sweep layer mounts: %w", err)
	}
	return nil
}

// unmountDir unmounts everything mounted on dir (lazily when busy) and
// removes it.
func unmountDir(dir string) error {
	if err := unmountAll(dir); err != nil {
		return err
	}
	if err := os.Remove(dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// unmountAll unmounts every mount stacked on target; it returns nil if
// there is none. A busy mount is detached (MNT_DETACH): it disappears from
// the tree now and is freed when its last user goes.
func unmountAll(target string) error {
	for range 64 { // mounts stacked on one point; bounded against surprises
		err := unix.Unmount(target, 0)
		if errors.Is(err, unix.EBUSY) {
			err = unix.Unmount(target, unix.MNT_DETACH)
		}
		switch {
		case err == nil:
			continue
		case errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOENT):
			return nil // not (or no longer) a mount point
		default:
			return fmt.Errorf("unmount %s: %w", target, err)
		}
	}
	return fmt.Errorf("unmount %s: still mounted after 64 unmounts", target)
}

// mountEntry is one line of /proc/self/mountinfo.
type mountEntry struct {
	point, fstype, source string
}

func readMountinfo() ([]mountEntry, error) {
	mounts, err := procfs.Mountinfo("self")
	if err != nil {
		return nil, err
	}
	ms := make([]mountEntry, len(mounts))
	for i, m := range mounts {
		ms[i] = mountEntry{point: m.Point, fstype: m.FSType, source: m.Source}
	}
	return ms, nil
}

// Package debroot makes root file system trees for the tests from Debian's
// own packages: apt-get downloads the packages with their dependencies (as
// for an empty system), dpkg-deb extracts them into one tree (merged /usr,
// as debootstrap makes it), and the tree is cached under $SHOAL_TEST_CACHE
// (default /var/cache/shoal-test), keyed by its name, version and package
// list, so only the first run pays the download and the extraction.
// Maintainer scripts are not run: a test that needs what they would have
// made (users, PAM configuration) writes it in Finish.
package debroot

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// Tree describes a tree.
type Tree struct {
	Name     string   // a short name, part of the cache directory's name
	Version  string   // change it when Finish changes
	Packages []string // installed with their dependencies
	// Finish, if not nil, completes the extracted tree (root is its
	// directory) before it is cached. /etc/passwd and /etc/group hold
	// root and nobody when it is called.
	Finish func(root string) error
}

// Needs reports why trees cannot be made here, or "".
func Needs() string {
	for _, bin := range []string{"apt-get", "dpkg-deb"} {
		if _, err := exec.LookPath(bin); err != nil {
			return "needs " + bin + " installed"
		}
	}
	return ""
}

// Make returns the tree's directory, making it if it is not cached.
func Make(t Tree) (string, error) {
	cache := os.Getenv("SHOAL_TEST_CACHE")
	if cache == "" {
		cache = "/var/cache/shoal-test"
	}
	sum := sha256.Sum256([]byte(t.Version + " " + strings.Join(t.Packages, " ")))
	key := hex.EncodeToString(sum[:6])
	root := filepath.Join(cache, t.Name+"-root-"+key)
	if _, err := os.Stat(filepath.Join(root, ".complete")); err == nil {
		return root, nil
	}
	debs := filepath.Join(cache, t.Name+"-debs-"+key)
	os.RemoveAll(debs)
	if err := os.MkdirAll(filepath.Join(debs, "partial"), 0o755); err != nil {
		return "", err
	}
	defer os.RemoveAll(debs)
	status := filepath.Join(debs, "status") // an empty system: every dependency is downloaded
	if err := os.WriteFile(status, nil, 0o644); err != nil {
		return "", err
	}
	args := []string{"-q", "-o", "Dir::State::status=" + status, "-o", "Dir::Cache::archives=" + debs,
		"-o", "Debug::NoLocking=1", "install", "-y", "--download-only", "--no-install-recommends"}
	if out, err := exec.Command("apt-get", append(args, t.Packages...)...).CombinedOutput(); err != nil {
		return "", fmt.Errorf("apt-get download: %v: %s", err, tail(out))
	}
	files, _ := filepath.Glob(filepath.Join(debs, "*.deb"))
	if len(files) == 0 {
		return "", errors.New("apt-get downloaded nothing (run apt-get update?)")
	}
	tmp := root + ".tmp"
	os.RemoveAll(tmp)
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		return "", err
	}
	for _, f := range files {
		if out, err := exec.Command("dpkg-deb", "-x", f, tmp).CombinedOutput(); err != nil {
			return "", fmt.Errorf("dpkg-deb -x %s: %v: %s", filepath.Base(f), err, out)
		}
	}
	// Merged /usr, as debootstrap makes it: /bin, /lib ... are symlinks.
	for _, d := range []string{"bin", "sbin", "lib", "lib32", "lib64", "libx32"} {
		p := filepath.Join(tmp, d)
		if fi, err := os.Lstat(p); err == nil && fi.IsDir() {
			if out, err := exec.Command("cp", "-a", p+"/.", filepath.Join(tmp, "usr", d)+"/").CombinedOutput(); err != nil {
				return "", fmt.Errorf("merge /%s: %v: %s", d, err, out)
			}
			os.RemoveAll(p)
		}
		if _, err := os.Stat(filepath.Join(tmp, "usr", d)); err == nil {
			os.Symlink("usr/"+d, p)
		}
	}
	for _, d := range []string{"usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale"} {
		os.RemoveAll(filepath.Join(tmp, d))
	}
	for _, d := range []string{"etc", "root", "proc", "sys", "dev", "run", "var/tmp", "tmp"} {
		os.MkdirAll(filepath.Join(tmp, d), 0o755)
	}
	os.Chmod(filepath.Join(tmp, "tmp"), 0o1777|os.ModeSticky)
	os.Chmod(filepath.Join(tmp, "var/tmp"), 0o1777|os.ModeSticky)
	os.WriteFile(filepath.Join(tmp, "etc/passwd"), []byte("root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"), 0o644)
	os.WriteFile(filepath.Join(tmp, "etc/group"), []byte("root:x:0:\nnogroup:x:65534:\n"), 0o644)
	if t.Finish != nil {
		if err := t.Finish(tmp); err != nil {
			return "", fmt.Errorf("finish the %s tree: %w", t.Name, err)
		}
	}
	if err := os.WriteFile(filepath.Join(tmp, ".complete"), nil, 0o644); err != nil {
		return "", err
	}
	os.RemoveAll(root)
	if err := os.Rename(tmp, root); err != nil {
		return "", err
	}
	return root, nil
}

func tail(b []byte) string {
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}

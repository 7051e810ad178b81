package layer

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// richTree makes a tree with what a faithful upload must carry: a symlink
// (absolute, pointing out of the tree), a hard link, a setuid file, other
// owners, an empty directory with odd permissions, and extended
// attributes (user.* when the file system takes them, and a file
// capability). It returns the tree and whether xattrs were set.
func richTree(t *testing.T, dir string) (string, bool) {
	t.Helper()
	writeTree(t, dir, map[string]string{"bin/tool": "#!/bin/sh\necho hi\n", "etc/conf": "a=1\n", "data/big": strings.Repeat("0123456789", 50000)})
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.Symlink("/etc/passwd", filepath.Join(dir, "etc/passwd-link")))
	must(os.Symlink("../bin/tool", filepath.Join(dir, "etc/tool-link")))
	must(os.Link(filepath.Join(dir, "bin/tool"), filepath.Join(dir, "bin/tool-hardlink")))
	must(unix.Chmod(filepath.Join(dir, "bin/tool"), 0o4755))
	must(os.Mkdir(filepath.Join(dir, "empty"), 0o700))
	must(unix.Chmod(filepath.Join(dir, "empty"), 0o1733))
	must(os.Mkdir(filepath.Join(dir, "shared"), 0o700))
	must(unix.Chmod(filepath.Join(dir, "shared"), 0o2775))
	must(os.Lchown(filepath.Join(dir, "etc/conf"), 1234, 5678))
	must(os.Lchown(filepath.Join(dir, "etc/tool-link"), 99, 98))
	must(os.Chown(filepath.Join(dir, "data"), 1000, 1000))
	must(os.Chmod(dir, 0o751))
	xattrs := unix.Setxattr(filepath.Join(dir, "etc/conf"), "user.shoal", []byte("v\x00\x01"), 0) == nil
	if xattrs {
		must(unix.Setxattr(filepath.Join(dir, "data"), "user.dir", []byte("d"), 0))
	}
	// cap_net_bind_service=ep, as setcap writes it (VFS_CAP_REVISION_2).
	capv := []byte{0x01, 0x00, 0x00, 0x02, 0x00, 0x04, 0x00, 0x00, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
	if err := unix.Setxattr(filepath.Join(dir, "bin/tool-cap"), "security.capability", capv, 0); err != nil {
		must(os.WriteFile(filepath.Join(dir, "bin/tool-cap"), []byte("cap"), 0o755))
		if err := unix.Setxattr(filepath.Join(dir, "bin/tool-cap"), "security.capability", capv, 0); err != nil {
			t.Logf("no file capability: %v", err)
		}
	}
	return dir, xattrs
}

// upload tars dir with the Go SDK's writer (the CLI's) and builds it
// through BuildUpload, as the upload endpoint does.
func upload(t *testing.T, e *testEnv, dir string, o BuildOptions) (Layer, error) {
	t.Helper()
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(shoal.WriteTar(pw, dir)) }()
	defer pr.Close()
	return e.store.BuildUpload(context.Background(), pr, DefaultUploadMax, o)
}

// TestUploadSameDigestAsDir: a directory uploaded as a tar gives the very
// image a build from the directory itself gives.
func TestUploadSameDigestAsDir(t *testing.T) {
	e := newEnv(t)
	tree, xattrs := richTree(t, filepath.Join(t.TempDir(), "tree"))
	if !xattrs {
		t.Log("the temp file system takes no user.* xattrs: checked without them")
	}
	for _, c := range []string{"", "lz4hc"} {
		fromDir, err := e.store.Build(context.Background(), BuildOptions{Kind: KindToolkit, Name: "same", Version: "dir" + c, Source: tree, Compression: c})
		if err != nil {
			t.Fatal(err)
		}
		up, err := upload(t, e, tree, BuildOptions{Kind: KindToolkit, Name: "same", Version: "up" + c, Source: "upload of tree", Compression: c})
		if err != nil {
			t.Fatal(err)
		}
		if up.Digest != fromDir.Digest {
			t.Errorf("compression %q: upload gives %s, the directory %s", c, up.Digest, fromDir.Digest)
		}
		if !strings.Contains(up.Source, "upload of tree") {
			t.Errorf("source recorded as %q", up.Source)
		}
	}
	// And the image holds what was uploaded: mount it and compare.
	l, err := e.store.Resolve("same:up")
	if err != nil {
		t.Fatal(err)
	}
	m, err := e.store.Acquire(l.Digest)
	if err != nil {
		t.Fatal(err)
	}
	defer e.store.Release(l.Digest)
	var st unix.Stat_t
	if err := unix.Lstat(filepath.Join(m, "bin/tool"), &st); err != nil || st.Mode&0o7777 != 0o4755 || st.Nlink != 2 {
		t.Errorf("bin/tool: mode %o nlink %d (%v), want 4755 and 2 links", st.Mode&0o7777, st.Nlink, err)
	}
	if err := unix.Lstat(filepath.Join(m, "etc/conf"), &st); err != nil || st.Uid != 1234 || st.Gid != 5678 {
		t.Errorf("etc/conf: owner %d:%d (%v), want 1234:5678", st.Uid, st.Gid, err)
	}
	if target, err := os.Readlink(filepath.Join(m, "etc/passwd-link")); target != "/etc/passwd" {
		t.Errorf("etc/passwd-link -> %q (%v)", target, err)
	}
	if xattrs {
		buf := make([]byte, 16)
		n, err := unix.Lgetxattr(filepath.Join(m, "etc/conf"), "user.shoal", buf)
		if err != nil {
			t.Errorf("etc/conf user.shoal: %v", err)
		} else if !bytes.Equal(buf[:n], []byte("v\x00\x01")) {
			t.Errorf("etc/conf user.shoal = %q", buf[:n])
		}
	}
}

func TestBuildRoots(t *testing.T) {
	e := newEnv(t)
	base := t.TempDir()
	root := writeTree(t, filepath.Join(base, "root"), map[string]string{"ok/a": "1"})
	outside := writeTree(t, filepath.Join(base, "outside"), map[string]string{"secret": "s"})
	os.Symlink("/etc", filepath.Join(root, "etc-link"))
	os.Symlink(outside, filepath.Join(root, "out-link"))
	os.Symlink("ok", filepath.Join(root, "in-link"))
	os.Symlink(filepath.Join(root, "ok"), filepath.Join(base, "link-into-root"))
	os.Mkdir(filepath.Join(root, "special"), 0o755)
	unix.Mkfifo(filepath.Join(root, "special/fifo"), 0o644)
	roots, err := NewBuildRoots([]string{root})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		path string
		want error // nil: allowed
	}{
		{filepath.Join(root, "ok"), nil},
		{filepath.Join(root, "in-link"), nil},
		{filepath.Join(base, "link-into-root"), nil}, // resolved, it is inside
		{filepath.Join(root, "ok/a"), nil},           // a file: not a tar, refused by the build, not by the roots
		{"/etc", ErrOutsideBuildRoots},
		{filepath.Join(root, "etc-link"), ErrOutsideBuildRoots},
		{filepath.Join(root, "out-link"), ErrOutsideBuildRoots},
		{filepath.Join(root, "ok/../../outside"), ErrOutsideBuildRoots},
		{outside, ErrOutsideBuildRoots},
		{filepath.Join(root, "special/fifo"), errdefs.ErrInvalidArgument},
		{filepath.Join(root, "nosuch"), errdefs.ErrNotFound},
		{"relative", errdefs.ErrInvalidArgument},
	} {
		f, err := roots.Open(tc.path)
		if tc.want == nil {
			if err != nil {
				t.Errorf("%s: %v", tc.path, err)
				continue
			}
			_, err = e.store.Build(context.Background(), BuildOptions{Kind: KindToolkit, Name: "roots", Version: "1", Source: tc.path, Opened: f})
			f.Close()
			if strings.HasSuffix(tc.path, "/a") {
				if err == nil || !strings.Contains(err.Error(), "not a tar archive") {
					t.Errorf("build %s: %v, want not a tar archive", tc.path, err)
				}
			} else if err != nil {
				t.Errorf("build %s: %v", tc.path, err)
			}
			continue
		}
		if err == nil {
			f.Close()
			t.Errorf("%s: opened, want %v", tc.path, tc.want)
			continue
		}
		if !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.path, err, tc.want)
		}
		if tc.want == ErrOutsideBuildRoots && (!errors.Is(err, errdefs.ErrPermissionDenied) || !strings.Contains(err.Error(), "--build-root")) {
			t.Errorf("%s: %v: want permission denied naming --build-root", tc.path, err)
		}
	}
	// No roots: nothing is allowed.
	if _, err := (&BuildRoots{}).Open(filepath.Join(root, "ok")); !errors.Is(err, ErrOutsideBuildRoots) || !strings.Contains(err.Error(), "none is configured") {
		t.Errorf("no roots: %v", err)
	}
}

// TestBuildOpenedOnce: the build reads the directory that was opened, even
// if its path is swapped for a symlink out of the root afterwards.
func TestBuildOpenedOnce(t *testing.T) {
	e := newEnv(t)
	base := t.TempDir()
	root := writeTree(t, filepath.Join(base, "root"), map[string]string{"src/good": "good"})
	writeTree(t, filepath.Join(base, "outside"), map[string]string{"secret": "s"})
	roots, err := NewBuildRoots([]string{root})
	if err != nil {
		t.Fatal(err)
	}
	f, err := roots.Open(filepath.Join(root, "src"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := os.Rename(filepath.Join(root, "src"), filepath.Join(root, "moved")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(base, "outside"), filepath.Join(root, "src")); err != nil {
		t.Fatal(err)
	}
	l, err := e.store.Build(context.Background(), BuildOptions{Kind: KindToolkit, Name: "once", Version: "1", Source: filepath.Join(root, "src"), Opened: f})
	if err != nil {
		t.Fatal(err)
	}
	m, err := e.store.Acquire(l.Digest)
	if err != nil {
		t.Fatal(err)
	}
	defer e.store.Release(l.Digest)
	if _, err := os.Stat(filepath.Join(m, "good")); err != nil {
		t.Errorf("the opened directory was not built: %v", err)
	}
	if _, err := os.Stat(filepath.Join(m, "secret")); err == nil {
		t.Error("the build followed the swapped path out of the root")
	}
}

// failingReader returns n bytes of a tar, then an error: a client gone.
type failingReader struct {
	r io.Reader
	n int
}

func (f *failingReader) Read(p []byte) (int, error) {
	if f.n <= 0 {
		return 0, errors.New("connection reset by peer")
	}
	p = p[:min(len(p), f.n)]
	n, err := f.r.Read(p)
	f.n -= n
	return n, err
}

func TestBuildUploadBounds(t *testing.T) {
	e := newEnv(t)
	tarball := tarBytes(t, file("a", strings.Repeat("x", 100000)))
	tmpEmpty := func(t *testing.T) {
		t.Helper()
		ents, err := os.ReadDir(e.store.tmp)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range ents {
			t.Errorf("left in the store's tmp: %s", d.Name())
		}
	}
	o := BuildOptions{Kind: KindToolkit, Name: "up", Version: "1"}
	_, err := e.store.BuildUpload(context.Background(), bytes.NewReader(tarball), int64(len(tarball))-1, o)
	if !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "--build-upload-max") {
		t.Errorf("over the bound: %v", err)
	}
	tmpEmpty(t)
	_, err = e.store.BuildUpload(context.Background(), &failingReader{bytes.NewReader(tarball), 5000}, DefaultUploadMax, o)
	if err == nil || !strings.Contains(err.Error(), "connection reset") {
		t.Errorf("client gone: %v", err)
	}
	tmpEmpty(t)
	_, err = e.store.BuildUpload(context.Background(), bytes.NewReader([]byte("junk")), DefaultUploadMax, o)
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "not a tar archive") || strings.Contains(err.Error(), "/proc/") {
		t.Errorf("junk: %v", err)
	}
	tmpEmpty(t)
	// Bad options are refused before anything is read.
	r := &failingReader{bytes.NewReader(tarball), 0}
	if _, err := e.store.BuildUpload(context.Background(), r, DefaultUploadMax, BuildOptions{Kind: "rootfs", Name: "up", Version: "1"}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("bad kind: %v", err)
	}
	l, err := e.store.BuildUpload(context.Background(), bytes.NewReader(tarball), int64(len(tarball)), o)
	if err != nil {
		t.Fatal(err)
	}
	if l.Source != "tar upload" {
		t.Errorf("source %q", l.Source)
	}
	tmpEmpty(t)
}

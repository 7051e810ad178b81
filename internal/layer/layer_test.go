package layer

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.etcd.io/bbolt"
	"golang.org/x/sys/unix"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// needRoot skips tests that mount file systems or build images.
func needRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts EROFS images and overlayfs")
	}
	if _, err := exec.LookPath("mkfs.erofs"); err != nil {
		t.Skip("needs root: and mkfs.erofs (erofs-utils), which is not installed")
	}
}

// testEnv is a Store over a fresh data directory; anything mounted under it
// is unmounted when the test ends.
type testEnv struct {
	root  string // test's temp dir
	dir   string // the Store's directory
	db    *bbolt.DB
	store *Store
}

func newEnv(t testing.TB) *testEnv {
	t.Helper()
	needRoot(t)
	root := t.TempDir()
	// Registered after TempDir, so it runs before the directory is removed.
	t.Cleanup(func() { unmountUnder(t, root) })
	db, err := bbolt.Open(filepath.Join(root, "db"), 0o600, &bbolt.Options{Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	e := &testEnv{root: root, dir: filepath.Join(root, "layers"), db: db}
	e.store = e.open(t)
	return e
}

// open opens another Store over the same directory and database, as a
// restarted process would.
func (e *testEnv) open(t testing.TB) *Store {
	t.Helper()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	if testing.Verbose() {
		log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	s, err := Open(e.dir, e.db, log)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func unmountUnder(t testing.TB, root string) {
	ms, err := readMountinfo()
	if err != nil {
		t.Error(err)
		return
	}
	for _, m := range slices.Backward(ms) { // newest (top) first
		if strings.HasPrefix(m.point, root+"/") {
			if err := unix.Unmount(m.point, unix.MNT_DETACH); err != nil {
				t.Errorf("cleanup: unmount %s: %v", m.point, err)
			}
		}
	}
}

// mountCount returns how many mounts are stacked on dir.
func mountCount(t testing.TB, dir string) int {
	t.Helper()
	ms, err := readMountinfo()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, m := range ms {
		if m.point == dir {
			n++
		}
	}
	return n
}

// writeTree creates files (path -> content) under dir.
func writeTree(t testing.TB, dir string, files map[string]string) string {
	t.Helper()
	for p, content := range files {
		p = filepath.Join(dir, p)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

type tarEntry struct {
	hdr  tar.Header
	body string
}

func file(name, body string) tarEntry {
	return tarEntry{tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644}, body}
}
func dir(name string) tarEntry {
	return tarEntry{tar.Header{Typeflag: tar.TypeDir, Name: name, Mode: 0o755}, ""}
}
func symlink(name, target string) tarEntry {
	return tarEntry{tar.Header{Typeflag: tar.TypeSymlink, Name: name, Linkname: target, Mode: 0o777}, ""}
}
func hardlink(name, target string) tarEntry {
	return tarEntry{tar.Header{Typeflag: tar.TypeLink, Name: name, Linkname: target}, ""}
}

// writeTar writes a tar file (gzip-compressed if its name says so).
func writeTar(t testing.TB, path string, entries ...tarEntry) string {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := e.hdr
		h.Size = int64(len(e.body))
		h.ModTime = time.Unix(1700000000, 0)
		h.Format = tar.FormatPAX
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatal(err)
		}
		if _, err := io.WriteString(tw, e.body); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	data := buf.Bytes()
	if strings.HasSuffix(path, "gz") {
		var zbuf bytes.Buffer
		zw := gzip.NewWriter(&zbuf)
		zw.Write(data)
		zw.Close()
		data = zbuf.Bytes()
	}
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func (e *testEnv) build(t testing.TB, name, version, source string) Layer {
	t.Helper()
	l, err := e.store.Build(context.Background(), BuildOptions{Kind: KindBase, Name: name, Version: version, Source: source})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func readFile(t testing.TB, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestParseKind(t *testing.T) {
	for _, s := range []string{"base", "workspace", "toolkit"} {
		if k, err := ParseKind(s); err != nil || string(k) != s {
			t.Errorf("ParseKind(%q) = %q, %v", s, k, err)
		}
	}
	_, err := ParseKind("Base")
	if err == nil || !strings.Contains(err.Error(), "base, workspace, toolkit") {
		t.Errorf("ParseKind(Base) error = %v, want one listing the kinds", err)
	}
}

func TestBuild(t *testing.T) {
	e := newEnv(t)
	src := t.TempDir()
	hostFile := filepath.Join(t.TempDir(), "host-secret")

	tests := []struct {
		name    string
		opts    BuildOptions
		source  func(t *testing.T) string // overrides opts.Source
		wantErr string                    // substring; "" means success
		errIs   error
		check   func(t *testing.T, mnt string)
	}{{
		name: "dir",
		source: func(t *testing.T) string {
			d := writeTree(t, filepath.Join(src, "dir"), map[string]string{"etc/os-release": "shoal", "bin/x": "x"})
			os.Symlink("/etc/os-release", filepath.Join(d, "abs"))
			os.Chown(filepath.Join(d, "bin/x"), 1234, 5678)
			os.Chmod(filepath.Join(d, "bin/x"), os.ModeSetuid|0o755)
			return d
		},
		check: func(t *testing.T, mnt string) {
			if got := readFile(t, filepath.Join(mnt, "etc/os-release")); got != "shoal" {
				t.Errorf("etc/os-release = %q", got)
			}
			if got, _ := os.Readlink(filepath.Join(mnt, "abs")); got != "/etc/os-release" {
				t.Errorf("abs -> %q", got)
			}
			fi, err := os.Lstat(filepath.Join(mnt, "bin/x"))
			if err != nil {
				t.Fatal(err)
			}
			st := fi.Sys().(*syscall.Stat_t)
			if fi.Mode()&os.ModeSetuid == 0 || fi.Mode().Perm() != 0o755 || st.Uid != 1234 || st.Gid != 5678 {
				t.Errorf("bin/x: mode %v uid %d gid %d, want -rwsr-xr-x 1234 5678", fi.Mode(), st.Uid, st.Gid)
			}
		},
	}, {
		name: "dir lz4hc",
		opts: BuildOptions{Compression: "lz4hc"},
		source: func(t *testing.T) string {
			return writeTree(t, filepath.Join(src, "lz4"), map[string]string{"big": strings.Repeat("shoal ", 100000)})
		},
		check: func(t *testing.T, mnt string) {
			if got := readFile(t, filepath.Join(mnt, "big")); got != strings.Repeat("shoal ", 100000) {
				t.Errorf("big: %d bytes", len(got))
			}
		},
	}, {
		name: "tar.gz",
		source: func(t *testing.T) string {
			x := file("usr/bin/tool", "#!/bin/sh\n")
			x.hdr.Mode, x.hdr.Uid, x.hdr.Gid = 0o4750, 1000, 1001
			x.hdr.PAXRecords = map[string]string{"SCHILY.xattr.user.shoal": "yes"}
			return writeTar(t, filepath.Join(src, "a.tar.gz"),
				dir("./"), dir("usr/"), x,
				file("/etc/hostname", "box"), // a leading "/" is dropped, as tar does
				hardlink("usr/bin/tool2", "usr/bin/tool"),
				file("deep/implied/parents", "p"),
				dir("ro/"), file("ro/f", "f"), // directory metadata applied last
			)
		},
		check: func(t *testing.T, mnt string) {
			fi, err := os.Lstat(filepath.Join(mnt, "usr/bin/tool"))
			if err != nil {
				t.Fatal(err)
			}
			st := fi.Sys().(*syscall.Stat_t)
			if fi.Mode()&os.ModeSetuid == 0 || fi.Mode().Perm() != 0o750 || st.Uid != 1000 || st.Gid != 1001 {
				t.Errorf("usr/bin/tool: mode %v uid %d gid %d", fi.Mode(), st.Uid, st.Gid)
			}
			fi2, err := os.Lstat(filepath.Join(mnt, "usr/bin/tool2"))
			if err != nil || fi2.Sys().(*syscall.Stat_t).Ino != st.Ino {
				t.Errorf("usr/bin/tool2 is not a hard link of usr/bin/tool: %v", err)
			}
			buf := make([]byte, 16)
			if n, err := unix.Getxattr(filepath.Join(mnt, "usr/bin/tool"), "user.shoal", buf); err != nil || string(buf[:n]) != "yes" {
				t.Errorf("xattr user.shoal = %q, %v", buf[:max(n, 0)], err)
			}
			for p, want := range map[string]string{"etc/hostname": "box", "deep/implied/parents": "p", "ro/f": "f"} {
				if got := readFile(t, filepath.Join(mnt, p)); got != want {
					t.Errorf("%s = %q, want %q", p, got, want)
				}
			}
		},
	}, {
		name: "tar absolute symlink kept, not followed",
		source: func(t *testing.T) string {
			return writeTar(t, filepath.Join(src, "abs.tar"),
				symlink("secret", hostFile), // then overwritten: must replace the link, not write through it
				file("secret", "mine"),
				symlink("passwd", "/etc/passwd"),
				symlink("rel", "../../../../etc"),
			)
		},
		check: func(t *testing.T, mnt string) {
			if got, _ := os.Readlink(filepath.Join(mnt, "passwd")); got != "/etc/passwd" {
				t.Errorf("passwd -> %q, want /etc/passwd", got)
			}
			if got, _ := os.Readlink(filepath.Join(mnt, "rel")); got != "../../../../etc" {
				t.Errorf("rel -> %q", got)
			}
			if got := readFile(t, filepath.Join(mnt, "secret")); got != "mine" {
				t.Errorf("secret = %q", got)
			}
			if _, err := os.Lstat(hostFile); err == nil {
				t.Errorf("extraction wrote %s through a symlink", hostFile)
			}
		},
	}, {
		name: "tar write through absolute symlink refused",
		source: func(t *testing.T) string {
			return writeTar(t, filepath.Join(src, "through.tar"),
				symlink("etc", filepath.Dir(hostFile)), file("etc/host-secret", "pwned"))
		},
		wantErr: `parent "etc" is not a directory (a symlink)`,
	}, {
		name: "tar write through relative symlink refused",
		source: func(t *testing.T) string {
			return writeTar(t, filepath.Join(src, "through-rel.tar"),
				dir("a/"), symlink("b", "a"), file("b/f", "x"))
		},
		wantErr: `parent "b" is not a directory (a symlink)`,
	}, {
		name: "tar ../ escape refused",
		source: func(t *testing.T) string {
			return writeTar(t, filepath.Join(src, "escape.tar"), file("ok", "1"), file("a/../../evil", "x"))
		},
		wantErr: `"a/../../evil" escapes the root`,
	}, {
		name: "tar hard link outside refused",
		source: func(t *testing.T) string {
			return writeTar(t, filepath.Join(src, "hl-out.tar"), hardlink("pw", "../../etc/passwd"))
		},
		wantErr: "escapes the root",
	}, {
		name: "tar hard link to later entry refused",
		source: func(t *testing.T) string {
			return writeTar(t, filepath.Join(src, "hl-later.tar"), hardlink("a", "b"), file("b", "x"))
		},
		wantErr: `hard link to "b", which is not an earlier file`,
	}, {
		name: "tar device node refused",
		source: func(t *testing.T) string {
			return writeTar(t, filepath.Join(src, "dev.tgz"),
				tarEntry{tar.Header{Typeflag: tar.TypeChar, Name: "usr/dev/null", Mode: 0o666, Devmajor: 1, Devminor: 3}, ""})
		},
		wantErr: "usr/dev/null is a character device: device nodes and fifos are not allowed",
	}, {
		name: "tar fifo refused",
		source: func(t *testing.T) string {
			return writeTar(t, filepath.Join(src, "fifo.tar"),
				tarEntry{tar.Header{Typeflag: tar.TypeFifo, Name: "p", Mode: 0o666}, ""})
		},
		wantErr: "fifo: device nodes and fifos are not allowed",
	}, {
		name: "dir with device node refused",
		source: func(t *testing.T) string {
			d := writeTree(t, filepath.Join(src, "devdir"), map[string]string{"ok": "1"})
			if err := unix.Mknod(filepath.Join(d, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))); err != nil {
				t.Fatal(err)
			}
			return d
		},
		wantErr: "null is a character device: device nodes, fifos and sockets are not allowed",
	}, {
		name: "symlink to a dir with a device node refused",
		source: func(t *testing.T) string {
			d := writeTree(t, filepath.Join(src, "devdir2"), map[string]string{"ok": "1"})
			if err := unix.Mknod(filepath.Join(d, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))); err != nil {
				t.Fatal(err)
			}
			link := filepath.Join(src, "devlink")
			os.Symlink(d, link)
			return link
		},
		wantErr: "null is a character device",
	}, {
		name: "dir with fifo refused",
		source: func(t *testing.T) string {
			d := writeTree(t, filepath.Join(src, "fifodir"), map[string]string{"ok": "1"})
			if err := unix.Mkfifo(filepath.Join(d, "p"), 0o644); err != nil {
				t.Fatal(err)
			}
			return d
		},
		wantErr: "p is a fifo",
	}, {
		name:    "source missing",
		opts:    BuildOptions{Source: filepath.Join(src, "nope")},
		wantErr: "no such file",
	}, {
		name: "source not a tarball",
		source: func(t *testing.T) string {
			return writeTree(t, filepath.Join(src, "zip"), map[string]string{"a.zip": "x"}) + "/a.zip"
		},
		wantErr: "not a tar archive (plain, gzip or zstd compressed)",
	}, {
		name:    "bad name",
		opts:    BuildOptions{Name: "Python"},
		wantErr: `layer name "Python"`,
		errIs:   ErrInvalidRef,
	}, {
		name:    "bad version",
		opts:    BuildOptions{Version: "-1"},
		wantErr: `layer version "-1"`,
		errIs:   ErrInvalidRef,
	}, {
		name:    "bad kind",
		opts:    BuildOptions{Kind: "tools"},
		wantErr: "valid kinds are base, workspace, toolkit",
	}, {
		name:    "bad compression",
		opts:    BuildOptions{Compression: "zstd"},
		wantErr: "valid are none, plain, lz4, lz4hc",
	}}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := tt.opts
			if o.Kind == "" {
				o.Kind = KindBase
			}
			if o.Name == "" {
				o.Name = "test"
			}
			if o.Version == "" {
				o.Version = fmt.Sprint(i)
			}
			if tt.source != nil {
				o.Source = tt.source(t)
			}
			var progress bytes.Buffer
			o.Progress = func(p Progress) {
				if p.Message != "" {
					fmt.Fprintln(&progress, p.Message)
				}
			}
			l, err := e.store.Build(context.Background(), o)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("Build error = %v, want one containing %q", err, tt.wantErr)
				}
				if tt.errIs != nil && !errors.Is(err, tt.errIs) {
					t.Errorf("Build error = %v, want errors.Is %v", err, tt.errIs)
				}
				if !strings.HasPrefix(err.Error(), "build layer "+o.Name+":"+o.Version+": ") {
					t.Errorf("Build error %q does not say which layer", err)
				}
				if _, err := e.store.Resolve(o.Name + ":" + o.Version); err == nil {
					t.Errorf("failed build left a tag behind: %v", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("progress:\n%s", progress.String())
			for _, stage := range []string{"building erofs (", "done in "} {
				if !strings.Contains(progress.String(), stage) {
					t.Errorf("progress lacks %q", stage)
				}
			}
			fi, err := os.Stat(e.store.ImagePath(l.Digest))
			if err != nil || fi.Size() != l.Size {
				t.Errorf("image %s: %v, size %d want %d", l.Digest, err, fi.Size(), l.Size)
			}
			mnt, err := e.store.Acquire(l.Digest)
			if err != nil {
				t.Fatal(err)
			}
			defer e.store.Release(l.Digest)
			tt.check(t, mnt)
		})
	}
	tmp, _ := os.ReadDir(filepath.Join(e.dir, "tmp"))
	if len(tmp) != 0 {
		t.Errorf("builds left %d entries in tmp/", len(tmp))
	}
}

func TestBuildDeterministic(t *testing.T) {
	e := newEnv(t)
	src := t.TempDir()
	tree := writeTree(t, filepath.Join(src, "tree"), map[string]string{"a": "1", "b/c": "2", "b/d/e": strings.Repeat("x", 10000)})
	tarball := writeTar(t, filepath.Join(src, "t.tar.gz"), dir("b/"), file("a", "1"), file("b/c", "2"))
	for _, tt := range []struct {
		source, compression string
	}{{tree, ""}, {tree, "lz4"}, {tarball, "none"}, {tarball, "lz4hc"}} {
		t.Run(filepath.Base(tt.source)+"/"+tt.compression, func(t *testing.T) {
			var digests []string
			for i := range 2 {
				if i == 1 { // a new mtime must not change the image
					os.Chtimes(tt.source, time.Now(), time.Now().Add(time.Hour))
				}
				l, err := e.store.Build(context.Background(), BuildOptions{
					Kind: KindWorkspace, Name: "det", Version: fmt.Sprint(i), Source: tt.source, Compression: tt.compression,
				})
				if err != nil {
					t.Fatal(err)
				}
				digests = append(digests, l.Digest)
			}
			if digests[0] != digests[1] {
				t.Errorf("two builds of the same source: %s != %s", digests[0], digests[1])
			}
		})
	}
}

// Compression "plain" stores every file's data in whole blocks (EROFS's
// FLAT_PLAIN layout, which DAX reads in place: a microVM's pmem layers),
// where "none" packs a file's tail into its inode (FLAT_INLINE).
func TestBuildPlain(t *testing.T) {
	if _, err := exec.LookPath("dump.erofs"); err != nil {
		t.Skip("needs dump.erofs (erofs-utils) to read an inode's layout")
	}
	e := newEnv(t)
	tree := writeTree(t, filepath.Join(t.TempDir(), "tree"), map[string]string{"f": strings.Repeat("x", 5000)})
	for c, want := range map[string]string{"none": "Layout: 2", "plain": "Layout: 0"} {
		l, err := e.store.Build(context.Background(), BuildOptions{Kind: KindToolkit, Name: "plain", Version: c, Source: tree, Compression: c})
		if err != nil {
			t.Fatal(err)
		}
		if l.Compression != c {
			t.Errorf("compression %q recorded as %q", c, l.Compression)
		}
		out, err := exec.Command("dump.erofs", "--path=/f", e.store.ImagePath(l.Digest)).CombinedOutput()
		if err != nil {
			t.Fatalf("dump.erofs: %v: %s", err, out)
		}
		if !strings.Contains(string(out), want) {
			t.Errorf("compression %s: /f's inode %q, want %q", c, out, want)
		}
	}
}

func TestResolve(t *testing.T) {
	e := newEnv(t)
	l := e.build(t, "python", "3.11", writeTree(t, t.TempDir(), map[string]string{"py": "3.11"}))
	hex := strings.TrimPrefix(l.Digest, "sha256:")
	for _, tt := range []struct {
		ref     string
		errIs   error
		wantErr string
	}{
		{ref: "python:3.11"},
		{ref: "python@" + l.Digest},
		{ref: l.Digest},
		{ref: "python", errIs: ErrInvalidRef, wantErr: "give name:version"},
		{ref: "Python:3.11", errIs: ErrInvalidRef, wantErr: `layer name "Python"`},
		{ref: "python:", errIs: ErrInvalidRef, wantErr: `layer version ""`},
		{ref: "sha256:" + hex[:10], errIs: ErrInvalidRef, wantErr: "want sha256:<64 lowercase hex>"},
		{ref: "python@sha256:" + strings.ToUpper(hex), errIs: ErrInvalidRef},
		{ref: "python:3.12", errIs: ErrNotFound, wantErr: "python:3.12"},
		{ref: "ruby@" + l.Digest, errIs: ErrNotFound, wantErr: "ruby@sha256:"},
		{ref: "sha256:" + strings.Repeat("0", 64), errIs: ErrNotFound},
	} {
		t.Run(tt.ref, func(t *testing.T) {
			got, err := e.store.Resolve(tt.ref)
			if tt.errIs == nil {
				if err != nil || got != l {
					t.Errorf("Resolve = %+v, %v; want %+v", got, err, l)
				}
				return
			}
			if !errors.Is(err, tt.errIs) || !strings.Contains(fmt.Sprint(err), tt.wantErr) {
				t.Errorf("Resolve error = %v, want %v containing %q", err, tt.errIs, tt.wantErr)
			}
		})
	}
	if p := e.store.ImagePath("sha256:../../etc/passwd"); p != "" {
		t.Errorf("ImagePath of a bad digest = %q, want \"\"", p)
	}
}

func TestTagMoves(t *testing.T) {
	e := newEnv(t)
	src := t.TempDir()
	v1 := e.build(t, "repo", "main", writeTree(t, filepath.Join(src, "1"), map[string]string{"f": "one"}))
	again := e.build(t, "repo", "main", filepath.Join(src, "1"))
	if again != v1 {
		t.Errorf("rebuilding the same content changed the layer: %+v -> %+v", v1, again)
	}
	mnt, err := e.store.Acquire(v1.Digest) // a sandbox still uses the old one
	if err != nil {
		t.Fatal(err)
	}
	defer e.store.Release(v1.Digest)
	v2 := e.build(t, "repo", "main", writeTree(t, filepath.Join(src, "2"), map[string]string{"f": "two"}))
	if v2.Digest == v1.Digest {
		t.Fatal("different content, same digest")
	}
	if got, err := e.store.Resolve("repo:main"); err != nil || got.Digest != v2.Digest {
		t.Errorf("tag points at %s (%v), want %s", got.Digest, err, v2.Digest)
	}
	if got, err := e.store.Resolve("repo@" + v1.Digest); err != nil || got.Digest != v1.Digest {
		t.Errorf("old layer by digest: %+v, %v", got, err)
	}
	if got := readFile(t, filepath.Join(mnt, "f")); got != "one" {
		t.Errorf("old mount reads %q", got)
	}
	ls, err := e.store.List()
	if err != nil || len(ls) != 1 || ls[0] != v2 {
		t.Errorf("List = %+v, %v; want just %+v", ls, err, v2)
	}
}

func TestList(t *testing.T) {
	e := newEnv(t)
	src := writeTree(t, t.TempDir(), map[string]string{"f": "x"})
	refs := []string{"a-b:1", "a:2", "a:10", "b.c:1", "a:1"}
	for _, r := range refs {
		name, version, _ := strings.Cut(r, ":")
		e.build(t, name, version, src)
	}
	ls, err := e.store.List()
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, l := range ls {
		got = append(got, l.Ref())
	}
	if want := []string{"a:1", "a:10", "a:2", "a-b:1", "b.c:1"}; !slices.Equal(got, want) {
		t.Errorf("List = %v, want %v", got, want)
	}
}

func TestAcquireRelease(t *testing.T) {
	e := newEnv(t)
	l := e.build(t, "base", "1", writeTree(t, t.TempDir(), map[string]string{"hello": "world"}))
	p1, err := e.store.Acquire(l.Digest)
	if err != nil {
		t.Fatal(err)
	}
	p2, err := e.store.Acquire(l.Digest)
	if err != nil || p2 != p1 {
		t.Fatalf("second Acquire = %q, %v; want %q", p2, err, p1)
	}
	if want := filepath.Join(e.store.mnt, strings.TrimPrefix(l.Digest, "sha256:")[:16]); p1 != want {
		t.Errorf("mount path %s, want %s", p1, want)
	}
	if n := mountCount(t, p1); n != 1 || e.store.Refs(l.Digest) != 2 {
		t.Fatalf("after 2 Acquires: %d mounts, %d refs; want 1, 2", n, e.store.Refs(l.Digest))
	}
	if err := os.WriteFile(filepath.Join(p1, "new"), nil, 0o644); err == nil {
		t.Error("layer mount is writable")
	}
	if err := e.store.Release(l.Digest); err != nil {
		t.Fatal(err)
	}
	if n := mountCount(t, p1); n != 1 || readFile(t, filepath.Join(p1, "hello")) != "world" {
		t.Fatalf("after 1 Release: %d mounts, want 1", n)
	}
	if err := e.store.Release(l.Digest); err != nil {
		t.Fatal(err)
	}
	if n := mountCount(t, p1); n != 0 {
		t.Errorf("after last Release: %d mounts, want 0", n)
	}
	if _, err := os.Stat(p1); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("mount point left behind: %v", err)
	}
	if err := e.store.Release(l.Digest); err == nil {
		t.Error("Release without Acquire succeeded")
	}
	if _, err := e.store.Acquire("sha256:" + strings.Repeat("1", 64)); !errors.Is(err, ErrNotFound) {
		t.Errorf("Acquire of unknown digest: %v, want ErrNotFound", err)
	}
	if _, err := e.store.Acquire("sha256:nope"); !errors.Is(err, ErrInvalidRef) {
		t.Errorf("Acquire of bad digest: %v, want ErrInvalidRef", err)
	}
}

func TestAcquireConcurrent(t *testing.T) {
	e := newEnv(t)
	l := e.build(t, "base", "1", writeTree(t, t.TempDir(), map[string]string{"f": "x"}))
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 20 {
				p, err := e.store.Acquire(l.Digest)
				if err != nil {
					t.Error(err)
					return
				}
				if _, err := os.Stat(filepath.Join(p, "f")); err != nil {
					t.Error(err)
				}
				if err := e.store.Release(l.Digest); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	if n := e.store.Refs(l.Digest); n != 0 {
		t.Errorf("refs = %d, want 0", n)
	}
	if ms, _ := os.ReadDir(e.store.mnt); len(ms) != 0 {
		t.Errorf("%d mount points left", len(ms))
	}
}

func TestAdoptAfterRestart(t *testing.T) {
	e := newEnv(t)
	src := t.TempDir()
	keep := e.build(t, "keep", "1", writeTree(t, filepath.Join(src, "k"), map[string]string{"k": "k"}))
	stale := e.build(t, "stale", "1", writeTree(t, filepath.Join(src, "s"), map[string]string{"s": "s"}))
	pk, err := e.store.Acquire(keep.Digest)
	if err != nil {
		t.Fatal(err)
	}
	ps, err := e.store.Acquire(stale.Digest)
	if err != nil {
		t.Fatal(err)
	}

	// The old process dies without releasing; a new one recovers the
	// sandboxes that use keep, then sweeps.
	s2 := e.open(t)
	p, err := s2.Acquire(keep.Digest)
	if err != nil || p != pk {
		t.Fatalf("Acquire after restart = %q, %v; want %q", p, err, pk)
	}
	if n := mountCount(t, pk); n != 1 {
		t.Errorf("adopted mount stacked: %d mounts on %s", n, pk)
	}
	if err := s2.Sweep(); err != nil {
		t.Fatal(err)
	}
	if n := mountCount(t, ps); n != 0 {
		t.Errorf("Sweep left %d mounts of the unused layer", n)
	}
	if _, err := os.Stat(ps); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Sweep left the mount point: %v", err)
	}
	if got := readFile(t, filepath.Join(pk, "k")); got != "k" {
		t.Errorf("adopted mount reads %q", got)
	}
	if err := s2.Release(keep.Digest); err != nil {
		t.Fatal(err)
	}
	if n := mountCount(t, pk); n != 0 {
		t.Errorf("after Release: %d mounts", n)
	}
}

func TestCompose(t *testing.T) {
	for _, n := range []int{1, 40} {
		t.Run(fmt.Sprintf("%d lowers", n), func(t *testing.T) {
			e := newEnv(t)
			src := t.TempDir()
			var lowers []string
			for i := range n { // lowers[0] is the top
				l := e.build(t, fmt.Sprintf("l%d", i), "1", writeTree(t, filepath.Join(src, fmt.Sprint(i)), map[string]string{
					"shared":                    fmt.Sprint(i),
					fmt.Sprintf("only-%d", i):   "x",
					fmt.Sprintf("dir/in-%d", i): "y",
				}))
				p, err := e.store.Acquire(l.Digest)
				if err != nil {
					t.Fatal(err)
				}
				defer e.store.Release(l.Digest)
				lowers = append(lowers, p)
			}
			sb := filepath.Join(e.root, "sb")
			target, upper, work := filepath.Join(sb, "root"), filepath.Join(sb, "u"), filepath.Join(sb, "w")
			start := time.Now()
			if err := Compose(target, lowers, upper, work, false); err != nil {
				t.Fatal(err)
			}
			t.Logf("compose of %d lowers: %v", n, time.Since(start))
			// The sandbox reads its mountinfo: the overlay's options must
			// not show host paths (the data dir, layer mount points).
			mi, err := os.ReadFile("/proc/self/mountinfo")
			if err != nil {
				t.Fatal(err)
			}
			for _, line := range strings.Split(string(mi), "\n") {
				if !strings.Contains(line, " "+target+" ") {
					continue
				}
				_, opts, _ := strings.Cut(line, " - ")
				if strings.Contains(opts, e.root) || !strings.Contains(opts, "lowerdir+=/proc/self/fd/") {
					t.Errorf("overlay options show host paths: %s", line)
				}
			}
			if got := readFile(t, filepath.Join(target, "shared")); got != "0" {
				t.Errorf("shared = %q, want the top lower's 0", got)
			}
			for i := range n {
				for _, p := range []string{fmt.Sprintf("only-%d", i), fmt.Sprintf("dir/in-%d", i)} {
					if _, err := os.Stat(filepath.Join(target, p)); err != nil {
						t.Errorf("lower %d: %v", i, err)
					}
				}
			}
			if err := os.WriteFile(filepath.Join(target, "shared"), []byte("upper"), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(filepath.Join(target, fmt.Sprintf("only-%d", n-1))); err != nil {
				t.Fatal(err)
			}
			if got := readFile(t, filepath.Join(upper, "shared")); got != "upper" {
				t.Errorf("upper/shared = %q", got)
			}
			if got := readFile(t, filepath.Join(lowers[0], "shared")); got != "0" {
				t.Errorf("write reached the top lower: %q", got)
			}
			if _, err := os.Stat(filepath.Join(lowers[n-1], fmt.Sprintf("only-%d", n-1))); err != nil {
				t.Errorf("delete reached the bottom lower: %v", err)
			}
			if err := Unmount(target); err != nil {
				t.Fatal(err)
			}
			if c := mountCount(t, target); c != 0 {
				t.Errorf("%d mounts left on %s", c, target)
			}
			if err := Unmount(target); err != nil {
				t.Errorf("second Unmount: %v", err)
			}
			if err := Unmount(filepath.Join(sb, "missing")); err != nil {
				t.Errorf("Unmount of a missing dir: %v", err)
			}
		})
	}
	t.Run("no lowers", func(t *testing.T) {
		d := t.TempDir()
		if err := Compose(d+"/r", nil, d+"/u", d+"/w", false); err == nil || !strings.Contains(err.Error(), "want 1 to 500") {
			t.Errorf("Compose without lowers: %v", err)
		}
	})
	t.Run("missing lower", func(t *testing.T) {
		needRoot(t)
		d := t.TempDir()
		err := Compose(d+"/r", []string{d + "/nope"}, d+"/u", d+"/w", true)
		if err == nil || !strings.Contains(err.Error(), "lowerdir+") {
			t.Errorf("Compose with a missing lower: %v", err)
		}
		t.Log(err)
	})
}

func TestOpenCleansTmp(t *testing.T) {
	e := newEnv(t)
	junk := filepath.Join(e.dir, "tmp", "build-123", "root")
	if err := os.MkdirAll(junk, 0o755); err != nil {
		t.Fatal(err)
	}
	e.open(t)
	if _, err := os.Stat(filepath.Join(e.dir, "tmp", "build-123")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("tmp not cleaned: %v", err)
	}
}

// busyboxTree makes a small root file system: busybox and a symlink per
// applet.
func busyboxTree(t testing.TB, dir string) (string, int) {
	t.Helper()
	bb, err := exec.LookPath("busybox")
	if err != nil {
		t.Skip("needs busybox")
	}
	out, err := exec.Command(bb, "--list").Output()
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(bb)
	if err != nil {
		t.Fatal(err)
	}
	writeTree(t, dir, map[string]string{"bin/busybox": string(data), "etc/hostname": "box"})
	os.Chmod(filepath.Join(dir, "bin/busybox"), 0o755)
	applets := strings.Fields(string(out))
	for _, a := range applets {
		if a != "busybox" {
			os.Symlink("busybox", filepath.Join(dir, "bin", a))
		}
	}
	return dir, len(applets)
}

// BenchmarkBuildBusybox: go test -bench BuildBusybox -run '^$' ./internal/layer/
func BenchmarkBuildBusybox(b *testing.B) {
	for _, c := range []string{"none", "lz4hc"} {
		b.Run(c, func(b *testing.B) {
			e := newEnv(b)
			tree, _ := busyboxTree(b, filepath.Join(e.root, "bb"))
			var size int64
			for i := 0; b.Loop(); i++ {
				l, err := e.store.Build(context.Background(), BuildOptions{Kind: KindBase, Name: "bb", Version: fmt.Sprint(i), Source: tree, Compression: c})
				if err != nil {
					b.Fatal(err)
				}
				size = l.Size
			}
			b.ReportMetric(float64(size), "image-bytes")
		})
	}
}

// BenchmarkMount measures a first Acquire (mount) and last Release (unmount).
func BenchmarkMount(b *testing.B) {
	e := newEnv(b)
	tree, _ := busyboxTree(b, filepath.Join(e.root, "bb"))
	l := e.build(b, "bb", "1", tree)
	for b.Loop() {
		if _, err := e.store.Acquire(l.Digest); err != nil {
			b.Fatal(err)
		}
		if err := e.store.Release(l.Digest); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkCompose measures mounting and unmounting an overlay root over
// one busybox layer.
func BenchmarkCompose(b *testing.B) {
	e := newEnv(b)
	tree, _ := busyboxTree(b, filepath.Join(e.root, "bb"))
	l := e.build(b, "bb", "1", tree)
	p, err := e.store.Acquire(l.Digest)
	if err != nil {
		b.Fatal(err)
	}
	defer e.store.Release(l.Digest)
	for i := 0; b.Loop(); i++ {
		sb := filepath.Join(e.root, "sb", fmt.Sprint(i))
		if err := Compose(sb+"/r", []string{p}, sb+"/u", sb+"/w", true); err != nil {
			b.Fatal(err)
		}
		if err := Unmount(sb + "/r"); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkComposeFD measures composing a detached overlay root (what a
// pool claim hands its agent) over 1 and 4 busybox layers, plain and with
// every lower idmapped (a sandbox in a user namespace), and closing it.
func BenchmarkComposeFD(b *testing.B) {
	e := newEnv(b)
	tree, _ := busyboxTree(b, filepath.Join(e.root, "bb"))
	var lowers []string
	for i := range 4 {
		src := tree
		if i > 0 { // a layer of its own (same content, same digest, same mount)
			src = writeTree(b, b.TempDir(), map[string]string{fmt.Sprintf("opt/t%d/file", i): "x"})
		}
		l := e.build(b, "bb", fmt.Sprint(i), src)
		p, err := e.store.Acquire(l.Digest)
		if err != nil {
			b.Fatal(err)
		}
		defer e.store.Release(l.Digest)
		lowers = append(lowers, p)
	}
	ns := testUserns(b)
	seq := 0
	for _, n := range []int{1, 4} {
		for _, mapped := range []bool{false, true} {
			fd := -1
			if mapped {
				fd = ns
			}
			b.Run(fmt.Sprintf("lowers=%d/idmapped=%v", n, mapped), func(b *testing.B) {
				var ru0, ru1 unix.Rusage
				unix.Getrusage(unix.RUSAGE_SELF, &ru0)
				defer func() {
					// CPU time (this process, kernel included): steadier
					// than wall time on a loaded host.
					unix.Getrusage(unix.RUSAGE_SELF, &ru1)
					cpu := time.Duration(ru1.Utime.Nano() + ru1.Stime.Nano() - ru0.Utime.Nano() - ru0.Stime.Nano())
					b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "cpu-µs/op")
				}()
				for b.Loop() {
					seq++
					sb := filepath.Join(e.root, "sbfd", fmt.Sprint(seq))
					mfd, err := ComposeFDMapped(lowers[:n], fd, sb+"/u", sb+"/w", true)
					if err != nil {
						b.Fatal(err)
					}
					unix.Close(mfd)
				}
			})
		}
	}
}

// testUserns returns a user namespace mapping 0..65535 to 1<<30.. (a child
// blocked on a pipe is made in it, and its namespace opened).
func testUserns(t testing.TB) int {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	cmd := exec.Command("cat")
	cmd.Stdin = r
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWUSER,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: 1 << 30, Size: 65536}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: 1 << 30, Size: 65536}}}
	if err := cmd.Start(); err != nil {
		t.Skipf("no user namespace: %v", err)
	}
	r.Close()
	fd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/user", cmd.Process.Pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	w.Close()
	cmd.Wait()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// TestBuildDevNodesLeftOut: a root made by debootstrap (a directory with
// /dev/console, /dev/null... made by mknod), by docker export (a tar with
// device entries) or an image whose layer has them builds: the device nodes
// under /dev are left out with one warning line, the rest of /dev (its
// directories and symlinks) kept; a device node anywhere else is refused
// with the reason.
func TestBuildDevNodesLeftOut(t *testing.T) {
	e := newEnv(t)
	src := t.TempDir()
	nodes := []struct {
		name         string
		mode         uint32
		major, minor uint32
	}{
		{"console", unix.S_IFCHR | 0o600, 5, 1}, {"null", unix.S_IFCHR | 0o666, 1, 3}, {"zero", unix.S_IFCHR | 0o666, 1, 5},
		{"full", unix.S_IFCHR | 0o666, 1, 7}, {"random", unix.S_IFCHR | 0o666, 1, 8}, {"urandom", unix.S_IFCHR | 0o666, 1, 9},
		{"tty", unix.S_IFCHR | 0o666, 5, 0}, {"ptmx", unix.S_IFCHR | 0o666, 5, 2}, {"loop0", unix.S_IFBLK | 0o660, 7, 0},
	}
	debootstrap := func(t *testing.T, name string) string {
		d := writeTree(t, filepath.Join(src, name), map[string]string{"etc/hostname": "deb", "dev/pts/.keep": "", "dev/shm/.keep": ""})
		for _, n := range nodes {
			if err := unix.Mknod(filepath.Join(d, "dev", n.name), n.mode, int(unix.Mkdev(n.major, n.minor))); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Symlink("/proc/self/fd", filepath.Join(d, "dev/fd")); err != nil {
			t.Fatal(err)
		}
		return d
	}
	devTar := func(t *testing.T, name string, extra ...tarEntry) string {
		entries := []tarEntry{dir("etc/"), file("etc/hostname", "deb"), dir("dev/"), dir("dev/pts/"), symlink("dev/fd", "/proc/self/fd")}
		for _, n := range nodes {
			typ := byte(tar.TypeChar)
			if n.mode&unix.S_IFMT == unix.S_IFBLK {
				typ = tar.TypeBlock
			}
			entries = append(entries, tarEntry{tar.Header{Typeflag: typ, Name: "./dev/" + n.name, Mode: int64(n.mode & 0o7777), Devmajor: int64(n.major), Devminor: int64(n.minor)}, ""})
		}
		return writeTar(t, filepath.Join(src, name), append(entries, extra...)...)
	}
	for i, tt := range []struct {
		name    string
		source  func(t *testing.T) string
		wantErr string
	}{
		{name: "debootstrap tree", source: func(t *testing.T) string { return debootstrap(t, "deb") }},
		{name: "docker export tar", source: func(t *testing.T) string { return devTar(t, "export.tar") }},
		{name: "image layer", source: func(t *testing.T) string {
			return writeLayout(t, filepath.Join(src, "oci"), map[string]v1.Image{"1": image(t, imageLayer(t,
				dir("etc/"), file("etc/hostname", "deb"), dir("dev/pts/"), symlink("dev/fd", "/proc/self/fd"),
				tarEntry{tar.Header{Typeflag: tar.TypeChar, Name: "dev/console", Mode: 0o600, Devmajor: 5, Devminor: 1}, ""}))})
		}},
		{name: "tree with a device node outside /dev", source: func(t *testing.T) string {
			d := debootstrap(t, "deb-etc")
			if err := unix.Mknod(filepath.Join(d, "etc/null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))); err != nil {
				t.Fatal(err)
			}
			return d
		}, wantErr: "etc/null is a character device: device nodes, fifos and sockets are not allowed in a layer"},
		{name: "tree with a device node in /devices", source: func(t *testing.T) string {
			d := debootstrap(t, "deb-devices")
			os.Mkdir(filepath.Join(d, "devices"), 0o755)
			if err := unix.Mknod(filepath.Join(d, "devices/sda"), unix.S_IFBLK|0o600, int(unix.Mkdev(8, 0))); err != nil {
				t.Fatal(err)
			}
			return d
		}, wantErr: "devices/sda is a block device"},
		{name: "tar with a device node outside /dev", source: func(t *testing.T) string {
			return devTar(t, "export-bad.tar", tarEntry{tar.Header{Typeflag: tar.TypeChar, Name: "usr/lib/dev/null", Mode: 0o666, Devmajor: 1, Devminor: 3}, ""})
		}, wantErr: "usr/lib/dev/null is a character device: device nodes and fifos are not allowed in a layer"},
		{name: "tar with a fifo under /dev", source: func(t *testing.T) string {
			return devTar(t, "export-fifo.tar", tarEntry{tar.Header{Typeflag: tar.TypeFifo, Name: "dev/initctl", Mode: 0o600}, ""})
		}, wantErr: "dev/initctl is a fifo"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var progress bytes.Buffer
			o := BuildOptions{Kind: KindBase, Name: "deb", Version: fmt.Sprint(i), Source: tt.source(t), Progress: func(p Progress) {
				if p.Message != "" {
					fmt.Fprintln(&progress, p.Message)
				}
			}}
			l, err := e.store.Build(context.Background(), o)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("Build error = %v, want one containing %q", err, tt.wantErr)
				}
				if !errors.Is(err, errdefs.ErrInvalidArgument) {
					t.Errorf("Build error %v is not ErrInvalidArgument", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("progress:\n%s", progress.String())
			if n := strings.Count(progress.String(), "warning: left out"); n != 1 {
				t.Errorf("progress has %d warnings about device nodes left out, want 1", n)
			}
			if !strings.Contains(progress.String(), "/dev/console") || !strings.Contains(progress.String(), "the sandbox gets its own /dev") {
				t.Errorf("the warning does not name /dev/console and why")
			}
			mnt, err := e.store.Acquire(l.Digest)
			if err != nil {
				t.Fatal(err)
			}
			defer e.store.Release(l.Digest)
			for _, n := range nodes {
				if _, err := os.Lstat(filepath.Join(mnt, "dev", n.name)); !errors.Is(err, fs.ErrNotExist) {
					t.Errorf("dev/%s in the layer: %v", n.name, err)
				}
			}
			if fi, err := os.Stat(filepath.Join(mnt, "dev/pts")); err != nil || !fi.IsDir() {
				t.Errorf("dev/pts: %v", err)
			}
			if got, _ := os.Readlink(filepath.Join(mnt, "dev/fd")); got != "/proc/self/fd" {
				t.Errorf("dev/fd -> %q", got)
			}
			if got := readFile(t, filepath.Join(mnt, "etc/hostname")); got != "deb" {
				t.Errorf("etc/hostname = %q", got)
			}
		})
	}
}

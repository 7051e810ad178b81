package layer

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// sandboxRoot composes an overlay like a sandbox's (lowers top first, a
// private upper) and returns the merged root and the upper directory.
func sandboxRoot(t *testing.T, e *testEnv, name string, lowers ...Layer) (root, upper string) {
	t.Helper()
	var dirs []string
	for _, l := range lowers {
		p, err := e.store.Acquire(l.Digest)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { e.store.Release(l.Digest) })
		dirs = append(dirs, p)
	}
	sb := filepath.Join(e.root, "sandboxes", name)
	root, upper = filepath.Join(sb, "root"), filepath.Join(sb, "upper")
	if err := Compose(root, dirs, upper, filepath.Join(sb, "work"), true); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { Unmount(root) })
	return root, upper
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// TestCommit makes changes in a sandbox-like overlay, commits its upper,
// and checks that base + the committed layer shows exactly what the
// sandbox saw: deleted files stay deleted (whiteouts), replaced directories
// show only their new content (opaque), and overlay bookkeeping stays out.
func TestCommit(t *testing.T) {
	e := newEnv(t)
	base := e.build(t, "base", "1", writeTree(t, t.TempDir(), map[string]string{
		"etc/keep": "keep", "etc/gone": "gone", "etc/edit": "old",
		"opaque/old1": "x", "opaque/sub/old2": "x",
		"tree/a/b/c": "deep", "bin/tool": "v1",
	}))
	root, upper := sandboxRoot(t, e, "sb1", base)

	// What a setup script does in a sandbox.
	must(t, os.Remove(filepath.Join(root, "etc/gone")))
	must(t, os.WriteFile(filepath.Join(root, "etc/edit"), []byte("new"), 0o600))
	must(t, os.RemoveAll(filepath.Join(root, "opaque")))
	must(t, os.MkdirAll(filepath.Join(root, "opaque/sub"), 0o750))
	must(t, os.WriteFile(filepath.Join(root, "opaque/sub/fresh"), []byte("fresh"), 0o644))
	must(t, os.RemoveAll(filepath.Join(root, "tree/a")))
	must(t, os.MkdirAll(filepath.Join(root, "repo/.git"), 0o755))
	must(t, os.WriteFile(filepath.Join(root, "repo/main.py"), []byte("print(1)"), 0o755))
	must(t, os.Link(filepath.Join(root, "repo/main.py"), filepath.Join(root, "repo/main2.py")))
	must(t, os.Symlink("/repo/main.py", filepath.Join(root, "repo/link")))
	must(t, unix.Setxattr(filepath.Join(root, "repo/main.py"), "user.shoal", []byte("yes"), 0))
	must(t, os.Chown(filepath.Join(root, "repo/main.py"), 1000, 1000))
	must(t, os.MkdirAll(filepath.Join(root, ".shoal"), 0o755)) // Shoal's own mount point
	must(t, os.WriteFile(filepath.Join(root, ".shoal/agent"), nil, 0o755))
	ln, err := net.Listen("unix", filepath.Join(root, "repo/sock"))
	must(t, err)
	defer ln.Close()

	var notes []string
	l, err := e.store.Commit(context.Background(), CommitOptions{
		Kind: KindWorkspace, Name: "ws", Version: "1", Upper: upper, Exclude: []string{"/.shoal"},
		Origin: "commit of sandbox sb1", Progress: func(p Progress) {
			if p.Message != "" {
				notes = append(notes, p.Message)
			}
		},
	})
	must(t, err)
	if l.Kind != KindWorkspace || l.Source != "commit of sandbox sb1" {
		t.Errorf("layer %+v", l)
	}
	if !strings.Contains(strings.Join(notes, "\n"), "skipping socket /repo/sock") {
		t.Errorf("no note about the socket in %q", notes)
	}

	// The image itself: whiteouts and opaque kept, overlay bookkeeping not.
	img, err := e.store.Acquire(l.Digest)
	must(t, err)
	defer e.store.Release(l.Digest)
	tree := treeOf(t, img)
	for p, want := range map[string]string{"etc/gone": "c:0:0", "tree/a": "c:0:0", "etc/edit": "f:new", "opaque/sub/fresh": "f:fresh"} {
		if tree[p] != want {
			t.Errorf("image %s = %q, want %q", p, tree[p], want)
		}
	}
	for _, p := range []string{".shoal", ".shoal/agent", "repo/sock", "etc/keep", "bin/tool"} {
		if _, ok := tree[p]; ok {
			t.Errorf("image has %s", p)
		}
	}
	if v, err := getXattr(filepath.Join(img, "opaque"), ovlOpaque); err != nil || string(v) != "y" {
		t.Errorf("opaque dir: %s = %q, %v", ovlOpaque, v, err)
	}
	if v, err := getXattr(filepath.Join(img, "opaque/sub"), ovlOpaque); err == nil {
		t.Errorf("opaque/sub (new inside an opaque dir) has %s = %q", ovlOpaque, v)
	}
	for _, p := range []string{"etc/edit", "etc", "repo/main.py", "."} {
		names, _ := listXattrs(filepath.Join(img, p))
		for _, n := range names {
			if strings.HasPrefix(n, ovlPrefix) && n != ovlOpaque {
				t.Errorf("%s keeps overlay attribute %s", p, n)
			}
		}
	}
	if v, err := getXattr(filepath.Join(img, "repo/main.py"), "user.shoal"); err != nil || string(v) != "yes" {
		t.Errorf("user xattr: %q, %v", v, err)
	}
	a, _ := os.Stat(filepath.Join(img, "repo/main.py"))
	b, _ := os.Stat(filepath.Join(img, "repo/main2.py"))
	if !os.SameFile(a, b) {
		t.Error("hard link lost")
	}
	if st := a.Sys().(*syscall.Stat_t); st.Uid != 1000 || a.Mode().Perm() != 0o755 {
		t.Errorf("repo/main.py: uid %d mode %v", st.Uid, a.Mode())
	}
	if fi, _ := os.Stat(filepath.Join(img, "opaque/sub")); fi == nil || fi.Mode().Perm() != 0o750 {
		t.Errorf("opaque/sub mode: %v", fi)
	}

	// Stacked as a lower over the same base, it reproduces the sandbox.
	root2, _ := sandboxRoot(t, e, "sb2", l, base)
	got, want := treeOf(t, root2), treeOf(t, root)
	delete(want, ".shoal")
	delete(want, ".shoal/agent")
	delete(want, "repo/sock")
	if d := diffTrees(got, want); d != "" {
		t.Errorf("base + commit differs from the sandbox:\n%s", d)
	}
	for _, p := range []string{"etc/gone", "opaque/old1", "opaque/sub/old2", "tree/a/b/c"} {
		if _, err := os.Lstat(filepath.Join(root2, p)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s is back in a sandbox from base + commit: %v", p, err)
		}
	}

	// Deterministic: committing the same upper again gives the same image.
	again, err := e.store.Commit(context.Background(), CommitOptions{Kind: KindWorkspace, Name: "ws", Version: "2", Upper: upper, Exclude: []string{"/.shoal"}})
	must(t, err)
	if again.Digest != l.Digest {
		t.Errorf("second commit of the same upper: %s != %s", again.Digest, l.Digest)
	}
}

func TestCommitRefuses(t *testing.T) {
	e := newEnv(t)
	base := e.build(t, "base", "1", writeTree(t, t.TempDir(), map[string]string{"f": "x"}))
	tests := []struct {
		name    string
		kind    Kind
		setup   func(t *testing.T, root, upper string) string // returns the upper to commit
		wantErr string
		errIs   error
	}{{
		name: "device node",
		setup: func(t *testing.T, root, upper string) string {
			must(t, unix.Mknod(filepath.Join(root, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
			return upper
		},
		wantErr: "/null: a character device (1:3): device nodes are not allowed in a layer (only overlay whiteouts, 0:0)",
		errIs:   errdefs.ErrFailedPrecondition,
	}, {
		name: "fifo",
		setup: func(t *testing.T, root, upper string) string {
			must(t, unix.Mkfifo(filepath.Join(root, "p"), 0o644))
			return upper
		},
		wantErr: "/p: a fifo",
		errIs:   errdefs.ErrFailedPrecondition,
	}, {
		name: "redirect",
		setup: func(t *testing.T, root, upper string) string {
			must(t, os.Mkdir(filepath.Join(upper, "d"), 0o755))
			must(t, unix.Setxattr(filepath.Join(upper, "d"), ovlRedirect, []byte("/x"), 0))
			return upper
		},
		wantErr: "trusted.overlay.redirect",
	}, {
		name:    "base kind",
		kind:    KindBase,
		setup:   func(t *testing.T, root, upper string) string { return upper },
		wantErr: "not a base",
		errIs:   errdefs.ErrInvalidArgument,
	}, {
		name:    "no upper",
		setup:   func(t *testing.T, root, upper string) string { return filepath.Join(upper, "missing") },
		wantErr: "no writable layer",
		errIs:   errdefs.ErrFailedPrecondition,
	}}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root, upper := sandboxRoot(t, e, fmt.Sprint("r", i), base)
			kind := tt.kind
			if kind == "" {
				kind = KindToolkit
			}
			_, err := e.store.Commit(context.Background(), CommitOptions{Kind: kind, Name: "bad", Version: fmt.Sprint(i), Upper: tt.setup(t, root, upper)})
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("Commit error = %v, want one containing %q", err, tt.wantErr)
			}
			if tt.errIs != nil && !errors.Is(err, tt.errIs) {
				t.Errorf("error %v is not %v", err, tt.errIs)
			}
			if _, err := e.store.Resolve(fmt.Sprint("bad:", i)); !errors.Is(err, ErrNotFound) {
				t.Errorf("failed commit left a tag: %v", err)
			}
		})
	}
	if tmp, _ := os.ReadDir(filepath.Join(e.dir, "tmp")); len(tmp) != 0 {
		t.Errorf("commits left %d entries in tmp/", len(tmp))
	}
}

// TestDeviceRefusedInSourcesButWhiteoutsInCommits: a directory source with
// a 0/0 character device is refused (only a commit may carry whiteouts).
func TestDeviceRefusedInSourcesButWhiteoutsInCommits(t *testing.T) {
	e := newEnv(t)
	d := writeTree(t, t.TempDir(), map[string]string{"a": "1"})
	must(t, unix.Mknod(filepath.Join(d, "wh"), unix.S_IFCHR, 0))
	_, err := e.store.Build(context.Background(), BuildOptions{Kind: KindToolkit, Name: "wh", Version: "1", Source: d})
	if err == nil || !strings.Contains(err.Error(), "wh is a character device") {
		t.Errorf("build of a dir with a whiteout: %v", err)
	}
	l, err := e.store.Commit(context.Background(), CommitOptions{Kind: KindToolkit, Name: "wh", Version: "2", Upper: d})
	must(t, err)
	if l.Files != 2 {
		t.Errorf("Files = %d", l.Files)
	}
}

// listXattrs lists the extended attributes of the file at p (not
// following a symlink).
func listXattrs(p string) ([]string, error) {
	return listXattrNames(func(buf []byte) (int, error) { return unix.Llistxattr(p, buf) })
}

// getXattr reads an extended attribute of the file at p (not following a
// symlink).
func getXattr(p, name string) ([]byte, error) {
	buf := make([]byte, 256)
	for {
		n, err := unix.Lgetxattr(p, name, buf)
		if errors.Is(err, unix.ERANGE) {
			buf = make([]byte, len(buf)*4)
			continue
		}
		if err != nil {
			return nil, err
		}
		return buf[:n], nil
	}
}

// TestCommitIDMap: the upper of a sandbox in a user namespace holds host
// ids of its range; the layer stores the sandbox's own ids, and an id
// outside the range as the overflow id the sandbox saw.
func TestCommitIDMap(t *testing.T) {
	e := newEnv(t)
	const base = 1 << 30
	upper := t.TempDir()
	for name, uid := range map[string]int{"root-file": base, "user-file": base + 1000, "host-file": 0} {
		p := filepath.Join(upper, name)
		must(t, os.WriteFile(p, []byte(name), 0o644))
		must(t, os.Lchown(p, uid, uid+7))
	}
	must(t, os.Mkdir(filepath.Join(upper, "dir"), 0o755))
	must(t, os.Lchown(filepath.Join(upper, "dir"), base+5, base+5))
	must(t, os.Symlink("root-file", filepath.Join(upper, "dir/link")))
	must(t, os.Lchown(filepath.Join(upper, "dir/link"), base+6, base+6))
	must(t, os.Lchown(upper, base, base))
	// A whiteout, made by the overlay as the host's root.
	must(t, unix.Mknod(filepath.Join(upper, "gone"), unix.S_IFCHR, 0))
	l, err := e.store.Commit(context.Background(), CommitOptions{
		Kind: KindWorkspace, Name: "mapped", Version: "1", Upper: upper,
		IDMap: &sandbox.IDMap{HostUID: base, HostGID: base, Size: 65536},
	})
	must(t, err)
	img, err := e.store.Acquire(l.Digest)
	must(t, err)
	defer e.store.Release(l.Digest)
	for name, want := range map[string][2]uint32{
		"root-file": {0, 7}, "user-file": {1000, 1007}, "host-file": {65534, 65534},
		"dir": {5, 5}, "dir/link": {6, 6}, ".": {0, 0}, "gone": {0, 0},
	} {
		var st unix.Stat_t
		must(t, unix.Lstat(filepath.Join(img, name), &st))
		if st.Uid != want[0] || st.Gid != want[1] {
			t.Errorf("%s in the layer: %d:%d, want %d:%d", name, st.Uid, st.Gid, want[0], want[1])
		}
	}
}

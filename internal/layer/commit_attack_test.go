package layer

// Tests of a commit against a hostile sandbox: one that changes its upper
// directory while the node reads it, to make the node read, write or chmod
// files of the host.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// hostCanary makes a file of the host that a sandbox must never get at: a
// 0600 file with random content, and a directory holding another.
func hostCanary(t *testing.T) (file, dir, secret string) {
	t.Helper()
	var r [16]byte
	rand.Read(r[:])
	secret = "canary-" + hex.EncodeToString(r[:])
	host := t.TempDir()
	file = filepath.Join(host, "admin.key")
	must(t, os.WriteFile(file, []byte(secret), 0o600))
	dir = filepath.Join(host, "secrets")
	must(t, os.Mkdir(dir, 0o700))
	must(t, os.WriteFile(filepath.Join(dir, "token"), []byte(secret), 0o600))
	return file, dir, secret
}

// checkCanary fails the test if the canary file's mode or content changed.
func checkCanary(t *testing.T, file, secret string) {
	t.Helper()
	fi, err := os.Lstat(file)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode() != 0o600 {
		t.Fatalf("the host's canary %s is now %v (was -rw-------)", file, fi.Mode())
	}
	if b, _ := os.ReadFile(file); string(b) != secret {
		t.Fatalf("the host's canary was written: %q", b)
	}
}

// checkNoSecret fails the test if a committed layer holds the canary's
// content anywhere.
func checkNoSecret(t *testing.T, e *testEnv, l Layer, secret string) map[string]string {
	t.Helper()
	img, err := e.store.Acquire(l.Digest)
	must(t, err)
	defer e.store.Release(l.Digest)
	tree := treeOf(t, img)
	for p, v := range tree {
		if strings.Contains(v, secret) {
			t.Fatalf("layer %s holds the host's secret in /%s (%q)", l.Ref(), p, v)
		}
	}
	return tree
}

// swapper exchanges pairs of names (renameat2 RENAME_EXCHANGE: both names
// always exist, their types flip), one pair after the other, as fast as it
// can until stopped.
func swapper(t *testing.T, pairs [][2]string) (stop func()) {
	t.Helper()
	var done atomic.Bool
	var swaps int64
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		for !done.Load() {
			for _, p := range pairs {
				if err := unix.Renameat2(unix.AT_FDCWD, p[0], unix.AT_FDCWD, p[1], unix.RENAME_EXCHANGE); err != nil {
					t.Errorf("exchange %s: %v", p[0], err)
					return
				}
				swaps++
			}
		}
	}()
	return sync.OnceFunc(func() {
		done.Store(true)
		<-finished
		t.Logf("%d swaps", swaps)
	})
}

// TestCommitSymlinkSwapRace: while commits run, the source tree keeps
// swapping regular files (mode 4777) for symlinks to a host file, and a
// directory for a symlink to a host directory. The old path-based walk
// (lstat, then open or chmod by path) copied the host's files into the
// layer and chmodded the host file 4777. Now nothing of the host is read
// or changed, and every commit works.
func TestCommitSymlinkSwapRace(t *testing.T) {
	e := newEnv(t)
	canary, canaryDir, secret := hostCanary(t)
	upper := t.TempDir()
	var pairs [][2]string
	for i := range 6 {
		f := filepath.Join(upper, fmt.Sprint("x", i))
		must(t, os.WriteFile(f, []byte("mine"), 0o644))
		must(t, unix.Chmod(f, 0o4777))
		must(t, os.Symlink(canary, f+".alt"))
		pairs = append(pairs, [2]string{f, f + ".alt"})
	}
	for i := range 3 {
		d := filepath.Join(upper, fmt.Sprint("d", i))
		writeTree(t, d, map[string]string{"own": "mine"})
		must(t, os.Symlink(canaryDir, d+".alt"))
		pairs = append(pairs, [2]string{d, d + ".alt"})
	}
	// Some bulk, so that a commit takes a while.
	bulk := map[string]string{}
	for i := range 300 {
		bulk[fmt.Sprintf("bulk/%02d/f%d", i%30, i)] = "data"
	}
	writeTree(t, upper, bulk)

	stop := swapper(t, pairs)
	defer stop()
	n := 25
	if testing.Short() {
		n = 5
	}
	for i := range n {
		l, err := e.store.Commit(context.Background(), CommitOptions{Kind: KindWorkspace, Name: "race", Version: fmt.Sprint(i), Upper: upper})
		if err != nil {
			t.Fatalf("commit %d: %v", i, err)
		}
		checkCanary(t, canary, secret)
		tree := checkNoSecret(t, e, l, secret)
		for p, v := range tree {
			if strings.HasPrefix(p, "x") && v != "f:mine" && v != "l:"+canary {
				t.Errorf("commit %d: /%s = %q", i, p, v)
			}
		}
	}
	stop()
	checkCanary(t, canary, secret)
	if fi, err := os.Stat(canaryDir); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("host directory: %v %v", fi.Mode(), err)
	}
}

// TestCommitNeverFollows: symlinks to host files, host directories,
// /dev/zero or a host fifo are kept as symlinks and never followed.
func TestCommitNeverFollows(t *testing.T) {
	e := newEnv(t)
	canary, canaryDir, secret := hostCanary(t)
	fifo := filepath.Join(t.TempDir(), "fifo")
	must(t, unix.Mkfifo(fifo, 0o600))
	upper := t.TempDir()
	links := map[string]string{"key": canary, "dir": canaryDir, "zero": "/dev/zero", "fifo": fifo, "rel": "../../../../../../" + canary}
	for name, target := range links {
		must(t, os.Symlink(target, filepath.Join(upper, name)))
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	l, err := e.store.Commit(ctx, CommitOptions{Kind: KindWorkspace, Name: "links", Version: "1", Upper: upper})
	must(t, err)
	tree := checkNoSecret(t, e, l, secret)
	for name, target := range links {
		if tree[name] != "l:"+target {
			t.Errorf("/%s = %q, want a symlink to %s", name, tree[name], target)
		}
	}
	if l.ContentBytes != 0 || l.Size > 1<<20 {
		t.Errorf("a layer of symlinks holds %d bytes of content, %d in all", l.ContentBytes, l.Size)
	}
	checkCanary(t, canary, secret)
}

// TestCommitSpecialFilesRefused: a fifo or a device node, even one swapped
// in for a regular file during the commit, is refused, and the commit
// never blocks on opening a fifo.
func TestCommitSpecialFilesRefused(t *testing.T) {
	e := newEnv(t)
	for _, tc := range []struct {
		name string
		mk   func(p string) error
		want string
	}{
		{"fifo", func(p string) error { return unix.Mkfifo(p, 0o644) }, "a fifo: fifos are not allowed in a layer"},
		{"char device", func(p string) error { return unix.Mknod(p, unix.S_IFCHR|0o666, int(unix.Mkdev(1, 5))) }, "a character device (1:5)"},
		{"block device", func(p string) error { return unix.Mknod(p, unix.S_IFBLK|0o600, int(unix.Mkdev(7, 0))) }, "a block device"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			upper := t.TempDir()
			x := filepath.Join(upper, "x")
			must(t, os.WriteFile(x, []byte("regular"), 0o644))
			must(t, tc.mk(x+".alt"))
			stop := swapper(t, [][2]string{{x, x + ".alt"}})
			defer stop()
			refused := 0
			for i := range 10 {
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				l, err := e.store.Commit(ctx, CommitOptions{Kind: KindToolkit, Name: "special", Version: fmt.Sprint(i), Upper: upper})
				cancel()
				if err == nil {
					// The walk met the file under both names (it is no
					// snapshot without a freeze): fine, if only the file
					// is in.
					tree := checkNoSecret(t, e, l, "never")
					if tree["x"] != "f:regular" || tree["x.alt"] != "f:regular" {
						t.Fatalf("commit %d: %v", i, tree)
					}
					continue
				}
				if !strings.Contains(err.Error(), tc.want) || !errors.Is(err, errdefs.ErrFailedPrecondition) {
					t.Fatalf("commit %d: %v, want a failed precondition with %q", i, err, tc.want)
				}
				refused++
			}
			if refused == 0 {
				t.Error("never refused")
			}
		})
	}
	if tmp, _ := os.ReadDir(filepath.Join(e.dir, "tmp")); len(tmp) != 0 {
		t.Errorf("commits left %d entries in tmp/", len(tmp))
	}
}

// deepTree makes a chain of n directories named name under dir (through
// descriptors: its paths may exceed PATH_MAX) with a file at the bottom.
func deepTree(t *testing.T, dir, name string, n int) {
	t.Helper()
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	must(t, err)
	for range n {
		must(t, unix.Mkdirat(fd, name, 0o755))
		next, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY, 0)
		must(t, err)
		unix.Close(fd)
		fd = next
	}
	defer unix.Close(fd)
	f, err := unix.Openat(fd, "bottom", unix.O_WRONLY|unix.O_CREAT, 0o644)
	must(t, err)
	unix.Close(f)
}

// TestCommitBounds: too deep, too long, too many entries or too many bytes
// are refused with a clear error of the right kind, before anything is
// copied; a tree just within the bounds is committed.
func TestCommitBounds(t *testing.T) {
	e := newEnv(t)
	tests := []struct {
		name  string
		setup func(t *testing.T, upper string)
		opts  CommitOptions
		want  string // "" for success
		kind  error
	}{{
		name:  "256 levels",
		setup: func(t *testing.T, upper string) { deepTree(t, upper, "d", 255) }, // + the file: 256
	}, {
		name:  "257 levels",
		setup: func(t *testing.T, upper string) { deepTree(t, upper, "d", 256) },
		want:  "more than 256 levels of directories",
		kind:  errdefs.ErrFailedPrecondition,
	}, {
		name:  "2000 levels",
		setup: func(t *testing.T, upper string) { deepTree(t, upper, "d", 2000) },
		want:  "more than 256 levels of directories",
		kind:  errdefs.ErrFailedPrecondition,
	}, {
		name:  "MaxDepth",
		setup: func(t *testing.T, upper string) { deepTree(t, upper, "d", 3) },
		opts:  CommitOptions{MaxDepth: 3},
		want:  "/d/d/d/bottom: more than 3 levels",
		kind:  errdefs.ErrFailedPrecondition,
	}, {
		name:  "path too long",
		setup: func(t *testing.T, upper string) { deepTree(t, upper, strings.Repeat("n", 250), 20) },
		want:  "too long for a layer",
		kind:  errdefs.ErrFailedPrecondition,
	}, {
		name: "MaxEntries",
		setup: func(t *testing.T, upper string) {
			writeTree(t, upper, map[string]string{"a/1": "", "a/2": "", "b/3": "", "b/4": ""}) // 6 entries
		},
		opts: CommitOptions{MaxEntries: 5},
		want: "more than 5 files and directories",
		kind: errdefs.ErrResourceExhausted,
	}, {
		name: "MaxBytes",
		setup: func(t *testing.T, upper string) {
			writeTree(t, upper, map[string]string{"a": strings.Repeat("a", 600), "b": strings.Repeat("b", 600)})
		},
		opts: CommitOptions{MaxBytes: 1000},
		want: "more than 1000 bytes",
		kind: errdefs.ErrResourceExhausted,
	}, {
		name: "hard links counted once",
		setup: func(t *testing.T, upper string) {
			writeTree(t, upper, map[string]string{"a": strings.Repeat("a", 600)})
			must(t, os.Link(filepath.Join(upper, "a"), filepath.Join(upper, "b")))
		},
		opts: CommitOptions{MaxBytes: 1000},
	}, {
		name: "sparse 1 TiB",
		setup: func(t *testing.T, upper string) {
			f, err := os.Create(filepath.Join(upper, "huge"))
			must(t, err)
			must(t, f.Truncate(1<<40))
			f.Close()
		},
		want: "more than 68719476736 bytes (64.0 GiB)",
		kind: errdefs.ErrResourceExhausted,
	}}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			upper := t.TempDir()
			tt.setup(t, upper)
			o := tt.opts
			o.Kind, o.Name, o.Version, o.Upper = KindWorkspace, "bounds", fmt.Sprint(i), upper
			var copying bool
			o.Progress = func(p Progress) { copying = copying || p.Stage == StageCopy }
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			l, err := e.store.Commit(ctx, o)
			if tt.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				if l.Files == 0 {
					t.Errorf("layer %+v", l)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) || !errors.Is(err, tt.kind) {
				t.Fatalf("Commit error = %v, want a %v containing %q", err, tt.kind, tt.want)
			}
			if copying {
				t.Error("refused only after copying began")
			}
			if len(err.Error()) > 400 {
				t.Errorf("error of %d bytes", len(err.Error()))
			}
		})
	}
	if tmp, _ := os.ReadDir(filepath.Join(e.dir, "tmp")); len(tmp) != 0 {
		t.Errorf("commits left %d entries in tmp/", len(tmp))
	}
	if _, err := e.store.Commit(context.Background(), CommitOptions{Kind: KindWorkspace, Name: "neg", Version: "1", Upper: t.TempDir(), MaxBytes: -1}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("negative bound: %v", err)
	}
}

// TestCommitFreezeHook: Freeze is called before the upper is read and its
// thaw as soon as the copy is over (before mkfs), also when the commit
// fails; a failed Freeze fails the commit before anything is read.
func TestCommitFreezeHook(t *testing.T) {
	e := newEnv(t)
	upper := writeTree(t, t.TempDir(), map[string]string{"a": "1"})
	var state []string
	freeze := func(context.Context) (func(), error) {
		state = append(state, "freeze")
		return func() { state = append(state, "thaw") }, nil
	}
	progress := func(p Progress) {
		if p.Message != "" {
			state = append(state, p.Stage)
		}
	}
	_, err := e.store.Commit(context.Background(), CommitOptions{Kind: KindWorkspace, Name: "fr", Version: "1", Upper: upper, Freeze: freeze, Progress: progress})
	must(t, err)
	if got := strings.Join(state, " "); got != "freeze copy thaw scan mkfs hash done" {
		t.Errorf("order: %s", got)
	}

	state = nil
	must(t, unix.Mkfifo(filepath.Join(upper, "p"), 0o600))
	_, err = e.store.Commit(context.Background(), CommitOptions{Kind: KindWorkspace, Name: "fr", Version: "2", Upper: upper, Freeze: freeze, Progress: progress})
	if err == nil || strings.Join(state, " ") != "freeze thaw" {
		t.Errorf("failed commit: %v, calls %q", err, state)
	}

	boom := errdefs.New(errdefs.ErrUnavailable, "cannot freeze")
	_, err = e.store.Commit(context.Background(), CommitOptions{Kind: KindWorkspace, Name: "fr", Version: "3", Upper: upper,
		Freeze: func(context.Context) (func(), error) { return nil, boom }})
	if !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("commit with a failed freeze: %v", err)
	}

	var notes []string
	must(t, os.Remove(filepath.Join(upper, "p")))
	_, err = e.store.Commit(context.Background(), CommitOptions{Kind: KindWorkspace, Name: "fr", Version: "4", Upper: upper,
		Freeze:   func(context.Context) (func(), error) { return nil, nil },
		Progress: func(p Progress) { notes = append(notes, p.Message) }})
	must(t, err)
	if !strings.Contains(strings.Join(notes, "\n"), "the sandbox cannot be frozen") {
		t.Errorf("no note that the sandbox was not frozen: %q", notes)
	}
}

package layer

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.etcd.io/bbolt"

	"github.com/shoal-sandbox/shoal/internal/layer/lazy"
	"github.com/shoal-sandbox/shoal/internal/layer/remote"
	"github.com/shoal-sandbox/shoal/internal/layer/remote/s3server/s3test"
)

// A node process for TestS3LazyRestart: run as this test binary with
// these variables, it opens the store in root, mounts the layer lazily,
// prints "mounted DIR" and waits to be killed.
const (
	envLazyNodeRoot   = "SHOAL_TEST_LAZYNODE_ROOT"
	envLazyNodeS3     = "SHOAL_TEST_LAZYNODE_S3"
	envLazyNodeDigest = "SHOAL_TEST_LAZYNODE_DIGEST"
)

func init() {
	root := os.Getenv(envLazyNodeRoot)
	if root == "" {
		return
	}
	err := func() error {
		db, err := bbolt.Open(filepath.Join(root, "db"), 0o600, &bbolt.Options{Timeout: 10 * time.Second})
		if err != nil {
			return err
		}
		s, err := Open(filepath.Join(root, "layers"), db, slog.New(slog.DiscardHandler))
		if err != nil {
			return err
		}
		st, err := lazyTestStore(os.Getenv(envLazyNodeS3))
		if err != nil {
			return err
		}
		fsys, err := lazy.Mount(filepath.Join(root, "layers", "lazy"), st, lazy.Config{CacheDir: filepath.Join(root, "cache")}, nil)
		if err != nil {
			return err
		}
		s.SetRemote(RemoteConfig{Store: st, Lazy: fsys})
		digest := os.Getenv(envLazyNodeDigest)
		if _, err := s.Resolve(digest); err != nil {
			return err
		}
		dir, err := s.Acquire(digest)
		if err != nil {
			return err
		}
		fmt.Printf("mounted %s\n", dir)
		select {}
	}()
	fmt.Fprintln(os.Stderr, "lazy node:", err)
	os.Exit(1)
}

func lazyTestStore(addr string) (remote.Store, error) {
	return remote.Open("s3://shoal/layers", remote.Options{Endpoint: "http://" + addr, AccessKey: "test", SecretKey: "test", Region: "us-east-1", PathStyle: true})
}

// TestS3LazyRestart: a node process that mounted a lazy layer is killed
// (its FUSE server dies with it) while a reader holds a file of the layer
// open, as a sandbox's processes do; the next process re-acquires the
// layer (recovery) and the reader's open file reads right again: the
// earlier mount's loop device was turned to the new loader, not replaced.
func TestS3LazyRestart(t *testing.T) {
	needLazy(t)
	srv := s3test.Start(t, t.TempDir(), "shoal", 0)
	st, err := lazyTestStore(srv.Addr)
	if err != nil {
		t.Fatal(err)
	}
	a := newEnv(t)
	a.store.SetRemote(RemoteConfig{Store: st})
	src := filepath.Join(a.root, "src")
	files := randomTree(t, src, 10, 100<<10)
	l, err := a.store.Build(t.Context(), BuildOptions{Kind: KindBase, Name: "base", Version: "1", Source: src, Compression: "none"})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := a.store.Push(t.Context(), "base:1"); err != nil {
		t.Fatal(err)
	}

	// The first node process.
	root := t.TempDir()
	t.Cleanup(func() { unmountUnder(t, root) })
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envLazyNodeRoot+"="+root, envLazyNodeS3+"="+srv.Addr, envLazyNodeDigest+"="+l.Digest)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	line := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if d, ok := strings.CutPrefix(sc.Text(), "mounted "); ok {
				line <- d
			}
		}
		close(line)
	}()
	var dir string
	select {
	case d, ok := <-line:
		if !ok {
			t.Fatal("the node process exited before mounting")
		}
		dir = d
	case <-time.After(60 * time.Second):
		t.Fatal("the node process did not mount within 60s")
	}
	// A reader (a sandbox) opens files of the layer and reads one.
	names := []string{"data/faa", "data/fae", "data/fai"}
	var fds []*os.File
	for _, n := range names {
		f, err := os.Open(filepath.Join(dir, n))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		fds = append(fds, f)
	}
	if got, err := io.ReadAll(fds[0]); err != nil || !bytes.Equal(got, files[names[0]]) {
		t.Fatalf("read before the kill: %v", err)
	}
	// The node dies: its FUSE server with it.
	cmd.Process.Kill()
	cmd.Wait()
	if _, err := fds[1].ReadAt(make([]byte, 4096), 0); err == nil {
		t.Fatal("a read of an unfetched file worked with the loader dead: the test does not test a dead loader")
	}

	// The next process over the same directories: recovery re-acquires.
	db, err := bbolt.Open(filepath.Join(root, "db"), 0o600, &bbolt.Options{Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	s2, err := Open(filepath.Join(root, "layers"), db, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	fsys, err := lazy.Mount(filepath.Join(root, "layers", "lazy"), st, lazy.Config{CacheDir: filepath.Join(root, "cache")}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fsys.Unmount() })
	s2.SetRemote(RemoteConfig{Store: st, Lazy: fsys})
	dir2, err := s2.Acquire(l.Digest)
	if err != nil {
		t.Fatal(err)
	}
	if dir2 != dir {
		t.Fatalf("re-acquired at %s, was %s", dir2, dir)
	}
	// The reader's open files read right.
	for i := 1; i < len(names); i++ {
		got, err := io.ReadAll(fds[i])
		if err != nil || !bytes.Equal(got, files[names[i]]) {
			t.Fatalf("after the restart, the open %s: %v (equal %v)", names[i], err, bytes.Equal(got, files[names[i]]))
		}
	}
	if err := s2.Release(l.Digest); err != nil {
		t.Fatal(err)
	}
}

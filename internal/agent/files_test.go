package agent

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

func tempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "agf")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// 100 MiB through WriteFile and back through ReadFile, with the heap
// sampled all along: neither side may hold the file or allocate per chunk.
// (The server runs in this process too, so this bounds both sides.)
func TestFileRoundTrip100MiB(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	c := startAgent(t)
	path := filepath.Join(tempDir(t), "sub", "big.bin")
	const size = 100 << 20

	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	var peak atomic.Uint64
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		var ms runtime.MemStats
		for {
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
			runtime.ReadMemStats(&ms)
			if ms.HeapAlloc > peak.Load() {
				peak.Store(ms.HeapAlloc)
			}
		}
	}()

	src := sha256.New()
	n, err := c.WriteFile(context.Background(), path, 0o600, io.TeeReader(io.LimitReader(rand.NewChaCha8([32]byte{7}), size), src))
	if err != nil {
		t.Fatal(err)
	}
	if n != size {
		t.Fatalf("WriteFile wrote %d bytes, want %d", n, size)
	}
	rc, fi, err := c.ReadFile(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	dst := sha256.New()
	got, err := io.Copy(dst, rc)
	rc.Close()
	if err != nil {
		t.Fatal(err)
	}
	close(stop)
	<-sampled
	var after runtime.MemStats
	runtime.ReadMemStats(&after)

	if got != size || fi.Size != size {
		t.Errorf("read %d bytes, FileInfo.Size %d, want %d", got, fi.Size, size)
	}
	if !bytes.Equal(src.Sum(nil), dst.Sum(nil)) {
		t.Errorf("sha256 differs: wrote %x, read %x", src.Sum(nil), dst.Sum(nil))
	}
	if fi.Mode.Perm() != 0o600 || fi.Name != "big.bin" || fi.IsDir {
		t.Errorf("FileInfo = %+v", fi)
	}
	allocated := after.TotalAlloc - before.TotalAlloc
	grown := int64(peak.Load()) - int64(before.HeapAlloc)
	t.Logf("200 MiB moved: %d KiB allocated in total, heap peak %+d KiB", allocated>>10, grown>>10)
	if allocated > 8<<20 {
		t.Errorf("allocated %d MiB while moving 200 MiB, want < 8 MiB", allocated>>20)
	}
	if grown > 16<<20 {
		t.Errorf("heap grew by %d MiB, want < 16 MiB", grown>>20)
	}
}

// failingReader yields n bytes, then fails (or calls fn and blocks).
type failingReader struct {
	n  int
	fn func()
}

func (r *failingReader) Read(p []byte) (int, error) {
	if r.n == 0 {
		if r.fn != nil {
			r.fn()
			time.Sleep(100 * time.Millisecond)
		}
		return 0, errors.New("source broke")
	}
	k := min(len(p), r.n)
	for i := range p[:k] {
		p[i] = 'x'
	}
	r.n -= k
	return k, nil
}

func TestWriteFileAtomic(t *testing.T) {
	c := startAgent(t)
	tests := []struct {
		name   string
		ctx    func() (context.Context, func())
		reader func(cancel func()) io.Reader
		is     error
	}{
		{
			name:   "source error",
			ctx:    func() (context.Context, func()) { return context.WithCancel(context.Background()) },
			reader: func(func()) io.Reader { return &failingReader{n: 300 << 10} },
		},
		{
			name:   "context canceled mid-stream",
			ctx:    func() (context.Context, func()) { return context.WithCancel(context.Background()) },
			reader: func(cancel func()) io.Reader { return &failingReader{n: 300 << 10, fn: cancel} },
			is:     context.Canceled,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := tempDir(t)
			path := filepath.Join(dir, "f.txt")
			if _, err := c.WriteFile(context.Background(), path, 0o644, strings.NewReader("old content")); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := tt.ctx()
			defer cancel()
			_, err := c.WriteFile(ctx, path, 0o644, tt.reader(cancel))
			if err == nil {
				t.Fatal("WriteFile succeeded, want an error")
			}
			if tt.is != nil && !errors.Is(err, tt.is) {
				t.Errorf("err = %v, want %v", err, tt.is)
			}
			// The agent removes the temp file when it sees the broken stream.
			deadline := time.Now().Add(3 * time.Second)
			for {
				ents, _ := os.ReadDir(dir)
				if len(ents) == 1 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("temp file left behind: %v", ents)
				}
				time.Sleep(10 * time.Millisecond)
			}
			if b, _ := os.ReadFile(path); string(b) != "old content" {
				t.Errorf("content = %q, want the old content", b)
			}
		})
	}
}

func TestFileOps(t *testing.T) {
	c := startAgent(t)
	ctx := context.Background()
	dir := tempDir(t)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}

	// MakeDir: nested, idempotent, refused over a file.
	nested := filepath.Join(dir, "a", "b", "c")
	must(c.MakeDir(ctx, nested, 0o750))
	must(c.MakeDir(ctx, nested, 0))
	fi, err := c.Stat(ctx, nested)
	must(err)
	if !fi.IsDir || !fi.Mode.IsDir() || fi.Name != "c" {
		t.Errorf("Stat(dir) = %+v", fi)
	}

	// WriteFile creates parents, sets the mode, overwrites.
	file := filepath.Join(dir, "x", "y", "f.txt")
	for _, content := range []string{"first version, longer", "second"} {
		n, err := c.WriteFile(ctx, file, 0o640, strings.NewReader(content))
		must(err)
		if n != int64(len(content)) {
			t.Errorf("WriteFile = %d", n)
		}
	}
	rc, fi, err := c.ReadFile(ctx, file)
	must(err)
	b, err := io.ReadAll(rc)
	rc.Close()
	must(err)
	if string(b) != "second" || fi.Size != 6 || fi.Mode != 0o640 || fi.ModTime.IsZero() {
		t.Errorf("ReadFile = %q, %+v", b, fi)
	}
	if err := os.Symlink("x/y/f.txt", filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}

	// Stat of a symlink is lstat; ReadFile follows it.
	fi, err = c.Stat(ctx, filepath.Join(dir, "link"))
	must(err)
	if fi.Symlink != "x/y/f.txt" || fi.Mode&fs.ModeSymlink == 0 || fi.IsDir {
		t.Errorf("Stat(link) = %+v", fi)
	}
	// ...resolved, with what it points to.
	if fi.Target != file || !fi.TargetOK || !fi.TargetMode.IsRegular() || fi.TargetMode.Perm() != 0o640 {
		t.Errorf("Stat(link) target = %q %v %v, want %s, a 0640 file", fi.Target, fi.TargetOK, fi.TargetMode, file)
	}
	dangling := filepath.Join(tempDir(t), "dangling")
	if err := os.Symlink("nowhere", dangling); err != nil {
		t.Fatal(err)
	}
	fi, err = c.Stat(ctx, dangling)
	must(err)
	if fi.TargetOK || fi.Target != dangling {
		t.Errorf("Stat(dangling) = %+v", fi)
	}
	rc, _, err = c.ReadFile(ctx, filepath.Join(dir, "link"))
	must(err)
	b, _ = io.ReadAll(rc)
	rc.Close()
	if string(b) != "second" {
		t.Errorf("ReadFile(link) = %q", b)
	}

	ents, err := c.ListDir(ctx, dir)
	must(err)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name)
		if e.Name == "link" && e.Symlink != "x/y/f.txt" {
			t.Errorf("ListDir link entry = %+v", e)
		}
		if e.Name == "a" && !e.IsDir {
			t.Errorf("ListDir dir entry = %+v", e)
		}
	}
	if got := strings.Join(names, ","); got != "a,link,x" {
		t.Errorf("ListDir names = %s, want a,link,x", got)
	}

	// A big directory arrives in several batches.
	big := filepath.Join(dir, "big")
	must(os.Mkdir(big, 0o755))
	for i := range 1000 {
		must(os.WriteFile(filepath.Join(big, strings.Repeat("n", 1+i%50)+strconv.Itoa(i)), nil, 0o644))
	}
	ents, err = c.ListDir(ctx, big)
	must(err)
	if len(ents) != 1000 {
		t.Errorf("ListDir(big) = %d entries, want 1000", len(ents))
	}
	for i := 1; i < len(ents); i++ {
		if ents[i-1].Name >= ents[i].Name {
			t.Fatalf("ListDir not sorted at %d: %q >= %q", i, ents[i-1].Name, ents[i].Name)
		}
	}

	errCases := []struct {
		name string
		call func() error
		is   error
	}{
		{"mkdir over file", func() error { return c.MakeDir(ctx, file, 0) }, fs.ErrExist},
		{"stat missing", func() error { _, err := c.Stat(ctx, dir+"/missing"); return err }, fs.ErrNotExist},
		{"read missing", func() error { _, _, err := c.ReadFile(ctx, dir+"/missing"); return err }, fs.ErrNotExist},
		{"read dir", func() error { _, _, err := c.ReadFile(ctx, dir); return err }, fs.ErrInvalid},
		{"read fifo", func() error {
			must(syscall.Mkfifo(dir+"/fifo", 0o644))
			_, _, err := c.ReadFile(ctx, dir+"/fifo")
			return err
		}, fs.ErrInvalid},
		{"write over dir", func() error {
			_, err := c.WriteFile(ctx, nested, 0, strings.NewReader("x"))
			return err
		}, fs.ErrInvalid},
		{"list file", func() error { _, err := c.ListDir(ctx, file); return err }, fs.ErrInvalid},
		{"list missing", func() error { _, err := c.ListDir(ctx, dir+"/missing"); return err }, fs.ErrNotExist},
		{"remove non-empty dir", func() error { return c.Remove(ctx, filepath.Join(dir, "a"), false) }, fs.ErrExist},
		{"remove missing", func() error { return c.Remove(ctx, dir+"/missing", true) }, fs.ErrNotExist},
		{"remove root", func() error { return c.Remove(ctx, "/", true) }, fs.ErrInvalid},
	}
	for _, tt := range errCases {
		err := tt.call()
		if !errors.Is(err, tt.is) {
			t.Errorf("%s: err = %v, want %v", tt.name, err, tt.is)
		}
		var ae *Error
		if !errors.As(err, &ae) {
			t.Errorf("%s: err = %#v, want *Error", tt.name, err)
		}
	}

	// Remove: a file, a symlink (not its target), an empty dir, a tree.
	must(c.Remove(ctx, filepath.Join(dir, "link"), false))
	if _, err := os.Stat(file); err != nil {
		t.Errorf("removing the link removed its target: %v", err)
	}
	must(c.Remove(ctx, file, false))
	must(c.Remove(ctx, filepath.Join(dir, "x", "y"), false))
	must(c.Remove(ctx, filepath.Join(dir, "a"), true))
	ents, err = c.ListDir(ctx, dir)
	must(err)
	if len(ents) != 3 { // big, fifo, x
		t.Errorf("after removals: %+v", ents)
	}
}

func TestBadPathsRefused(t *testing.T) {
	c := startAgent(t)
	ctx := context.Background()
	ops := map[string]func(p string) error{
		"stat":   func(p string) error { _, err := c.Stat(ctx, p); return err },
		"read":   func(p string) error { _, _, err := c.ReadFile(ctx, p); return err },
		"write":  func(p string) error { _, err := c.WriteFile(ctx, p, 0, strings.NewReader("x")); return err },
		"list":   func(p string) error { _, err := c.ListDir(ctx, p); return err },
		"mkdir":  func(p string) error { return c.MakeDir(ctx, p, 0) },
		"remove": func(p string) error { return c.Remove(ctx, p, true) },
	}
	paths := []string{"", "relative/x", "/tmp/../etc/passwd", "/..", "/tmp/a/..", "..", "/tmp/a\x00b"}
	for name, op := range ops {
		for _, p := range paths {
			err := op(p)
			if !errors.Is(err, fs.ErrInvalid) || !strings.Contains(err.Error(), errBadPath) {
				t.Errorf("%s %q: err = %v, want fs.ErrInvalid with %q", name, p, err, errBadPath)
			}
		}
	}
	// ".." inside a name is not a ".." element.
	if _, err := c.Stat(ctx, "/tmp/a..b/..c"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("stat /tmp/a..b/..c: err = %v, want fs.ErrNotExist", err)
	}
}

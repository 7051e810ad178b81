package diskimg

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func needLoop(t *testing.T) *Maker {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (loop devices, mount)")
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		t.Skipf("no loop devices: %v", err)
	}
	m, err := NewMaker(filepath.Join(t.TempDir(), "templates"))
	if err != nil {
		t.Skip(err)
	}
	return m
}

// allocated is the bytes the host's file system holds for path.
func allocated(t *testing.T, path string) int64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

func mounted(t *testing.T, m *Maker, size int64) (img, mnt string) {
	t.Helper()
	dir := t.TempDir()
	img, mnt = filepath.Join(dir, "disk.img"), filepath.Join(dir, "disk")
	if err := m.Make(context.Background(), img, size); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := Mount(img, mnt); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { Unmount(mnt) })
	return img, mnt
}

func TestSizeHolds(t *testing.T) {
	m := needLoop(t)
	const size = 64 << 20
	img, mnt := mounted(t, m, size)
	if a := allocated(t, img); a > 4<<20 {
		t.Errorf("a fresh image holds %d bytes of the host's disk, want a sparse one (< 4 MiB)", a)
	}
	f, err := os.Create(filepath.Join(mnt, "fill"))
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1<<20)
	var written int64
	for written < 4*size {
		n, err := f.Write(buf)
		written += int64(n)
		if err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatalf("write after %d bytes: %v, want ENOSPC", written, err)
			}
			break
		}
	}
	f.Close()
	if written > size || written < size*3/4 {
		t.Errorf("wrote %d bytes into a %d-byte image before ENOSPC", written, size)
	}
	if a := allocated(t, img); a > size {
		t.Errorf("the image holds %d bytes of the host's disk, more than its size %d", a, size)
	}
	t.Logf("wrote %d MiB before ENOSPC; host holds %d MiB", written>>20, allocated(t, img)>>20)
}

func TestInodesHold(t *testing.T) {
	m := needLoop(t)
	const size = 16 << 20
	_, mnt := mounted(t, m, size)
	want := Inodes(size)
	var made int64
	for made < 4*want {
		f, err := os.Create(filepath.Join(mnt, fmt.Sprint(made)))
		if err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatalf("create file %d: %v, want ENOSPC", made, err)
			}
			break
		}
		f.Close()
		made++
	}
	// mkfs rounds the count up to fill its block groups.
	if made < want-16 || made > want+want/4 {
		t.Errorf("made %d empty files before ENOSPC, want about %d", made, want)
	}
}

func TestConcurrentMakeAndMount(t *testing.T) {
	m := needLoop(t)
	dir := t.TempDir()
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			img, mnt := filepath.Join(dir, fmt.Sprint(i, ".img")), filepath.Join(dir, fmt.Sprint(i))
			if err := m.Make(context.Background(), img, 32<<20); err != nil {
				errs <- err
				return
			}
			os.Mkdir(mnt, 0o755)
			if err := Mount(img, mnt); err != nil {
				errs <- err
				return
			}
			if !IsMounted(mnt) {
				errs <- fmt.Errorf("%s not mounted", mnt)
			}
			if err := os.WriteFile(filepath.Join(mnt, "x"), []byte("x"), 0o644); err != nil {
				errs <- err
			}
			if err := Unmount(mnt); err != nil {
				errs <- err
			}
			if IsMounted(mnt) {
				errs <- fmt.Errorf("%s still mounted", mnt)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	// One template for the one size.
	ents, _ := os.ReadDir(m.dir)
	if len(ents) != 1 {
		t.Errorf("templates: %d files, want 1", len(ents))
	}
}

func TestSizeBounds(t *testing.T) {
	m := &Maker{dir: t.TempDir(), templates: nil}
	for _, size := range []int64{-1, 0, MinBytes - 1, MaxBytes + 1} {
		if err := m.Make(context.Background(), filepath.Join(t.TempDir(), "x"), size); err == nil {
			t.Errorf("Make of %d bytes: no error", size)
		}
	}
	if err := Unmount(filepath.Join(t.TempDir(), "nothing")); err != nil {
		t.Errorf("Unmount of nothing: %v", err)
	}
}

// BenchmarkMakeMountUnmount: what a disk adds to a create (make + mount)
// and to a delete (unmount + remove), for a 1 GiB image.
func BenchmarkMakeMountUnmount(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root")
	}
	m, err := NewMaker(filepath.Join(b.TempDir(), "templates"))
	if err != nil {
		b.Skip(err)
	}
	dir := b.TempDir()
	var tMake, tMount, tUnmount time.Duration
	n := 0
	for i := 0; b.Loop(); i++ {
		img, mnt := filepath.Join(dir, fmt.Sprint(i, ".img")), filepath.Join(dir, fmt.Sprint(i))
		t0 := time.Now()
		if err := m.Make(context.Background(), img, 1<<30); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		os.Mkdir(mnt, 0o755)
		if err := Mount(img, mnt); err != nil {
			b.Fatal(err)
		}
		t2 := time.Now()
		if err := Unmount(mnt); err != nil {
			b.Fatal(err)
		}
		os.Remove(img)
		os.Remove(mnt)
		t3 := time.Now()
		if i > 0 { // the first formats the template
			tMake, tMount, tUnmount, n = tMake+t1.Sub(t0), tMount+t2.Sub(t1), tUnmount+t3.Sub(t2), n+1
		}
	}
	if n > 0 {
		b.ReportMetric(float64(tMake.Microseconds())/float64(n)/1000, "make-ms")
		b.ReportMetric(float64(tMount.Microseconds())/float64(n)/1000, "mount-ms")
		b.ReportMetric(float64(tUnmount.Microseconds())/float64(n)/1000, "unmount+rm-ms")
	}
}

// TestCopySparse: the copy has the source's data at the same offsets and
// its holes as holes.
func TestCopySparse(t *testing.T) {
	dir := t.TempDir()
	src, dst := filepath.Join(dir, "src"), filepath.Join(dir, "dst")
	const size = 64 << 20
	f, err := os.Create(src)
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(size)
	chunks := map[int64][]byte{0: bytes.Repeat([]byte("a"), 5000), 8 << 20: bytes.Repeat([]byte("b"), 300<<10), size - 4096: bytes.Repeat([]byte("c"), 4096)}
	for off, b := range chunks {
		if _, err := f.WriteAt(b, off); err != nil {
			t.Fatal(err)
		}
	}
	f.Close()
	if err := copySparse(src, dst, size); err != nil {
		t.Fatal(err)
	}
	want, _ := os.ReadFile(src)
	got, err := os.ReadFile(dst)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("copy differs from its source (%d bytes, %v)", len(got), err)
	}
	var st unix.Stat_t
	if err := unix.Stat(dst, &st); err != nil {
		t.Fatal(err)
	}
	if used := st.Blocks * 512; used > 4<<20 {
		t.Errorf("copy uses %d bytes of %d: its holes were filled", used, size)
	}
}

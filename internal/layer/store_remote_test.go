package layer

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/layer/lazy"
	"github.com/shoal-sandbox/shoal/internal/layer/remote"
	"github.com/shoal-sandbox/shoal/internal/layer/remote/s3server/s3test"
)

// randomTree writes n files of size bytes of random data (incompressible,
// so that chunks map to files) and returns their contents by name.
func randomTree(t testing.TB, dir string, n, size int) map[string][]byte {
	t.Helper()
	r := rand.New(rand.NewPCG(1, 2))
	files := map[string][]byte{}
	for i := range n {
		b := make([]byte, size+i*97)
		for k := range b {
			b[k] = byte(r.Uint32())
		}
		name := filepath.Join("data", "f"+string(rune('a'+i/26))+string(rune('a'+i%26)))
		files[name] = b
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return files
}

func TestFileStorePushResolveMountPull(t *testing.T) {
	a := newEnv(t)
	storeDir := filepath.Join(a.root, "store")
	st, err := remote.Open("file://"+storeDir, remote.Options{})
	if err != nil {
		t.Fatal(err)
	}
	a.store.SetRemote(RemoteConfig{Store: st})
	src := writeTree(t, filepath.Join(a.root, "src"), map[string]string{"etc/os-release": "shoal\n", "big": strings.Repeat("x", 1<<20)})
	l := a.build(t, "base", "1", src)
	if _, res, err := a.store.Push(context.Background(), "base:1"); err != nil || res.UploadedBytes != l.Size {
		t.Fatalf("push: %+v %v", res, err)
	}
	// Pushed again: nothing uploaded.
	if _, res, err := a.store.Push(context.Background(), "base:1"); err != nil || res.UploadedBytes != 0 {
		t.Fatalf("second push: %+v %v", res, err)
	}

	// Another node, same store: resolves the tag it does not hold and
	// mounts the image straight from the store's file.
	b := newEnv(t)
	b.store.SetRemote(RemoteConfig{Store: st})
	got, err := b.store.Resolve("base:1")
	if err != nil || got.Digest != l.Digest || got.Remote != st.URL() {
		t.Fatalf("resolve from store: %+v %v", got, err)
	}
	if _, err := b.store.Resolve("base:2"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("resolve of a tag nowhere: %v, want not found", err)
	}
	dir, err := b.store.Acquire(l.Digest)
	if err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, filepath.Join(dir, "etc/os-release")); got != "shoal\n" {
		t.Fatalf("read %q", got)
	}
	ms, _ := readMountinfo()
	var source string
	for _, m := range ms {
		if m.point == dir {
			source = m.source
		}
	}
	if want := st.LocalPath(blobKey(l.Digest)); source != want {
		t.Fatalf("mounted from %q, want the store's file %q (no copy)", source, want)
	}
	if _, err := os.Stat(b.store.ImagePath(l.Digest)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the image was copied to the node: %v", err)
	}
	if err := b.store.Release(l.Digest); err != nil {
		t.Fatal(err)
	}

	// Pull copies it whole and tags it here.
	c := newEnv(t)
	c.store.SetRemote(RemoteConfig{Store: st})
	pulled, err := c.store.Pull(context.Background(), "base:1")
	if err != nil || pulled.Digest != l.Digest || pulled.Remote != "" {
		t.Fatalf("pull: %+v %v", pulled, err)
	}
	if fi, err := os.Stat(c.store.ImagePath(l.Digest)); err != nil || fi.Size() != l.Size {
		t.Fatalf("pulled image: %v", err)
	}
	if ls, _ := c.store.List(); len(ls) != 1 || ls[0].Ref() != "base:1" {
		t.Fatalf("tags after pull: %+v", ls)
	}
}

func needLazy(t testing.TB) {
	t.Helper()
	needRoot(t)
	for _, p := range []string{"/dev/fuse", "/dev/loop-control"} {
		if _, err := os.Stat(p); err != nil {
			t.Skipf("needs %s for lazy layers: %v", p, err)
		}
	}
}

// lazyNode is a node's Store over an s3:// layer store with a lazy FS.
type lazyNode struct {
	env   *testEnv
	fs    *lazy.FS
	cache string
}

func newLazyNode(t *testing.T, st remote.Store, cache string, cfg lazy.Config) *lazyNode {
	t.Helper()
	e := newEnv(t)
	cfg.CacheDir = cache
	var log *slog.Logger
	if testing.Verbose() {
		log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	fsys, err := lazy.Mount(filepath.Join(e.dir, "lazy"), st, cfg, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fsys.Unmount() })
	e.store.SetRemote(RemoteConfig{Store: st, Lazy: fsys})
	return &lazyNode{env: e, fs: fsys, cache: cache}
}

func s3Store(t testing.TB, srv *s3test.Server) remote.Store {
	st, err := remote.Open("s3://"+srv.Bucket+"/layers", remote.Options{Endpoint: "http://" + srv.Addr, AccessKey: "test", SecretKey: "test", Region: "us-east-1", PathStyle: true})
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func TestS3Lazy(t *testing.T) {
	needLazy(t)
	srv := s3test.Start(t, t.TempDir(), "shoal", 50<<20)
	st := s3Store(t, srv)

	a := newEnv(t)
	a.store.SetRemote(RemoteConfig{Store: st, ChunkSize: 64 << 10})
	src := filepath.Join(a.root, "src")
	files := randomTree(t, src, 40, 200<<10) // ~8 MB of random data
	l, err := a.store.Build(context.Background(), BuildOptions{Kind: KindBase, Name: "base", Version: "1", Source: src, Compression: "none"})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := a.store.Push(context.Background(), "base:1"); err != nil {
		t.Fatal(err)
	}

	cache := filepath.Join(t.TempDir(), "cache")
	n := newLazyNode(t, st, cache, lazy.Config{})
	if _, err := n.env.store.Resolve("base:1"); err != nil {
		t.Fatal(err)
	}
	dir, err := n.env.store.Acquire(l.Digest)
	if err != nil {
		t.Fatal(err)
	}

	// Only touched chunks are fetched.
	touched := int64(0)
	for _, name := range []string{"data/fab", "data/fba"} {
		got, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, files[name]) {
			t.Fatalf("%s differs from the source", name)
		}
		touched += int64(len(got))
	}
	fetched := n.fs.Stats().BytesFetched
	t.Logf("image %d bytes, touched %d, fetched %d (%.2fx)", l.Size, touched, fetched, float64(fetched)/float64(touched))
	if fetched < touched || fetched > l.Size/3 {
		t.Fatalf("fetched %d bytes of a %d-byte image to read %d: want only the touched chunks", fetched, l.Size, touched)
	}

	// Every file byte for byte.
	for name, want := range files {
		got, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("%s differs from the source (%v)", name, err)
		}
	}
	total := n.fs.Stats().BytesFetched
	if err := n.env.store.Release(l.Digest); err != nil {
		t.Fatal(err)
	}
	if err := n.fs.Unmount(); err != nil {
		t.Fatal(err)
	}

	// A restart over the same cache fetches nothing again.
	n2 := newLazyNode(t, st, cache, lazy.Config{NoPrefetch: true})
	if _, err := n2.env.store.Resolve(l.Digest); err != nil {
		t.Fatal(err)
	}
	dir, err = n2.env.store.Acquire(l.Digest)
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range files {
		got, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("after restart: %s differs from the source (%v)", name, err)
		}
	}
	if s := n2.fs.Stats(); s.BytesFetched != 0 || s.CacheHits == 0 {
		t.Fatalf("after restart with a warm cache (%d bytes): fetched %d bytes, %d hits; want 0 fetched", total, s.BytesFetched, s.CacheHits)
	}
	if err := n2.env.store.Release(l.Digest); err != nil {
		t.Fatal(err)
	}

	// Under a cap smaller than the image, the cache evicts and stays
	// under it; reads are still right.
	const capBytes = 1 << 20
	n3 := newLazyNode(t, st, filepath.Join(t.TempDir(), "small"), lazy.Config{CacheMax: capBytes})
	n3.env.store.Resolve(l.Digest)
	dir, err = n3.env.store.Acquire(l.Digest)
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range files {
		got, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("small cache: %s differs from the source (%v)", name, err)
		}
	}
	s := n3.fs.Stats()
	if s.CacheBytes > capBytes || s.Evictions == 0 {
		t.Fatalf("cache of %d bytes (cap %d), %d evictions", s.CacheBytes, capBytes, s.Evictions)
	}
	var onDisk int64
	filepath.Walk(filepath.Join(n3.cache, "chunks"), func(p string, fi os.FileInfo, err error) error {
		if err == nil && fi.Mode().IsRegular() {
			onDisk += fi.Size()
		}
		return nil
	})
	if onDisk > capBytes {
		t.Fatalf("%d bytes of chunks on disk, cap %d", onDisk, capBytes)
	}
	n3.env.store.Release(l.Digest)
}

func TestS3LazyServerKilled(t *testing.T) {
	needLazy(t)
	srv := s3test.Start(t, t.TempDir(), "shoal", 0)
	st := s3Store(t, srv)
	a := newEnv(t)
	a.store.SetRemote(RemoteConfig{Store: st, ChunkSize: 64 << 10})
	src := filepath.Join(a.root, "src")
	files := randomTree(t, src, 20, 200<<10)
	l, err := a.store.Build(context.Background(), BuildOptions{Kind: KindBase, Name: "base", Version: "1", Source: src, Compression: "none"})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := a.store.Push(context.Background(), "base:1"); err != nil {
		t.Fatal(err)
	}
	const bound = 2 * time.Second
	n := newLazyNode(t, st, filepath.Join(t.TempDir(), "cache"), lazy.Config{FetchTimeout: bound, Readahead: -1})
	n.env.store.Resolve("base:1")
	dir, err := n.env.store.Acquire(l.Digest)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(filepath.Join(dir, "data/faa")); err != nil || !bytes.Equal(got, files["data/faa"]) {
		t.Fatalf("read before the kill: %v", err)
	}
	srv.Kill()
	start := time.Now()
	done := make(chan error, 1)
	go func() {
		_, err := os.ReadFile(filepath.Join(dir, "data/fat"))
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, syscall.EIO) {
			t.Fatalf("read with the store gone: %v, want EIO", err)
		}
		t.Logf("EIO after %v (bound %v)", time.Since(start), bound)
	case <-time.After(10 * bound): // a hang detector, not a timing assert
		t.Fatalf("read still hanging %v after the store went away", 10*bound)
	}
	// The node is fine: the layer unmounts, and reads work again once the
	// store is back.
	srv.Restart()
	if got, err := os.ReadFile(filepath.Join(dir, "data/fat")); err != nil || !bytes.Equal(got, files["data/fat"]) {
		t.Fatalf("read after the store came back: %v", err)
	}
	released := make(chan error, 1)
	go func() { released <- n.env.store.Release(l.Digest) }()
	select {
	case err := <-released:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("release hangs")
	}
}

// TestS3LazyTracePrefetch: the first mount of a layer records which chunks
// were read; a cold start with that trace prefetches them, so the same
// reads then wait on no fetch.
func TestS3LazyTracePrefetch(t *testing.T) {
	needLazy(t)
	srv := s3test.Start(t, t.TempDir(), "shoal", 0)
	st := s3Store(t, srv)
	a := newEnv(t)
	a.store.SetRemote(RemoteConfig{Store: st, ChunkSize: 64 << 10})
	src := filepath.Join(a.root, "src")
	files := randomTree(t, src, 30, 200<<10)
	l, err := a.store.Build(context.Background(), BuildOptions{Kind: KindBase, Name: "base", Version: "1", Source: src, Compression: "none"})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := a.store.Push(context.Background(), "base:1"); err != nil {
		t.Fatal(err)
	}
	workload := []string{"data/fac", "data/fbb", "data/fad"}
	run := func(n *lazyNode) {
		t.Helper()
		n.env.store.Resolve(l.Digest)
		dir, err := n.env.store.Acquire(l.Digest)
		if err != nil {
			t.Fatal(err)
		}
		for _, name := range workload {
			if got, err := os.ReadFile(filepath.Join(dir, name)); err != nil || !bytes.Equal(got, files[name]) {
				t.Fatalf("%s differs from the source (%v)", name, err)
			}
		}
		if err := n.env.store.Release(l.Digest); err != nil {
			t.Fatal(err)
		}
	}
	cache1 := filepath.Join(t.TempDir(), "cache")
	first := newLazyNode(t, st, cache1, lazy.Config{Readahead: -1})
	run(first)
	coldMisses := first.fs.Stats().CacheMisses
	first.fs.Unmount()
	traces, _ := filepath.Glob(filepath.Join(cache1, "traces", "*.json"))
	if len(traces) != 1 {
		t.Fatalf("traces after the first run: %v", traces)
	}

	// A cold node (no chunks) with the trace.
	cache2 := filepath.Join(t.TempDir(), "cache")
	if err := os.MkdirAll(filepath.Join(cache2, "traces"), 0o755); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(traces[0])
	os.WriteFile(filepath.Join(cache2, "traces", filepath.Base(traces[0])), b, 0o644)
	second := newLazyNode(t, st, cache2, lazy.Config{Readahead: -1})
	second.env.store.Resolve(l.Digest)
	dir, err := second.env.store.Acquire(l.Digest)
	if err != nil {
		t.Fatal(err)
	}
	hexd := strings.TrimPrefix(l.Digest, "sha256:")
	deadline := time.Now().Add(30 * time.Second)
	for {
		st, _ := second.fs.ImageStats(hexd)
		if !st.Prefetching && st.ChunksCached >= st.TraceChunks {
			t.Logf("prefetched %d of %d traced chunks", st.Prefetched, st.TraceChunks)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("prefetch not done after 30s: %+v", st)
		}
		time.Sleep(20 * time.Millisecond)
	}
	before := second.fs.Stats()
	for _, name := range workload {
		if got, err := os.ReadFile(filepath.Join(dir, name)); err != nil || !bytes.Equal(got, files[name]) {
			t.Fatalf("%s differs from the source (%v)", name, err)
		}
	}
	after := second.fs.Stats()
	// The kernel's readahead on the image file may reach a chunk or two
	// past what the first run's reads touched (its windows depend on
	// timing: seen once in CI, 2 misses after 15 of 15 prefetched): the
	// same reads must miss at most a quarter of what they missed cold.
	missed := after.CacheMisses - before.CacheMisses
	t.Logf("cold run missed %d chunks, after the prefetch %d", coldMisses, missed)
	if after.Prefetched == 0 || coldMisses == 0 || 4*missed > coldMisses {
		t.Fatalf("after prefetch the workload still missed %d chunks of the %d it missed cold (prefetched %d)", missed, coldMisses, after.Prefetched)
	}
	second.env.store.Release(l.Digest)
}

// TestS3LazyFetchedOverTouched: a workload reading every 10th of many
// small files spread through an image (the worst case for chunked fetches:
// nearly every chunk holds one) fetches at most twice what the kernel
// read, and the loop device under EROFS reads ahead no more than
// loopReadaheadKB.
func TestS3LazyFetchedOverTouched(t *testing.T) {
	needLazy(t)
	srv := s3test.Start(t, t.TempDir(), "shoal", 0)
	st := s3Store(t, srv)
	a := newEnv(t)
	a.store.SetRemote(RemoteConfig{Store: st})
	src := filepath.Join(a.root, "src")
	r := rand.New(rand.NewPCG(3, 4))
	var names []string
	for i := range 600 {
		b := make([]byte, 4<<10+r.IntN(16<<10))
		for k := range b {
			b[k] = byte(r.Uint32())
		}
		name := filepath.Join("d"+string(rune('a'+i%7)), "f"+strings.Repeat("x", i%5)+string(rune('a'+i/26%26))+string(rune('a'+i%26)))
		p := filepath.Join(src, name)
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		names = append(names, name)
	}
	l, err := a.store.Build(context.Background(), BuildOptions{Kind: KindBase, Name: "base", Version: "1", Source: src, Compression: "none"})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := a.store.Push(context.Background(), "base:1"); err != nil {
		t.Fatal(err)
	}
	n := newLazyNode(t, st, filepath.Join(t.TempDir(), "cache"), lazy.Config{})
	n.env.store.Resolve(l.Digest)
	dir, err := n.env.store.Acquire(l.Digest)
	if err != nil {
		t.Fatal(err)
	}
	defer n.env.store.Release(l.Digest)
	var read int64
	for i := 0; i < len(names); i += 10 {
		b, err := os.ReadFile(filepath.Join(dir, names[i]))
		if err != nil {
			t.Fatal(err)
		}
		read += int64(len(b))
	}
	is, ok := n.fs.ImageStats(strings.TrimPrefix(l.Digest, "sha256:"))
	if !ok {
		t.Fatal("no stats for the image")
	}
	t.Logf("image %d bytes, files read %d bytes, kernel read %d distinct bytes, fetched %d (%.2fx touched, %.2fx file bytes)",
		l.Size, read, is.BytesTouched, is.BytesFetched, float64(is.BytesFetched)/float64(is.BytesTouched), float64(is.BytesFetched)/float64(read))
	if is.BytesTouched < read {
		t.Fatalf("the kernel read %d distinct bytes, less than the %d bytes of the files", is.BytesTouched, read)
	}
	if is.BytesFetched > 2*is.BytesTouched || is.BytesFetched > 3*read {
		t.Fatalf("fetched %d bytes for %d touched (%d of files): want at most 2x touched", is.BytesFetched, is.BytesTouched, read)
	}
}

// slowPutStore is a store whose uploads take a while (a slow link), so
// that a push reports several updates.
type slowPutStore struct {
	remote.Store
}

func (s slowPutStore) Put(ctx context.Context, key string, r io.Reader, size int64) error {
	return s.Store.Put(ctx, key, &slowReader{r: r}, size)
}

type slowReader struct{ r io.Reader }

func (s *slowReader) Read(p []byte) (int, error) {
	time.Sleep(20 * time.Millisecond)
	return s.r.Read(p[:min(len(p), 64<<10)])
}

func TestPushProgress(t *testing.T) {
	srv := s3test.Start(t, t.TempDir(), "shoal", 0)
	for _, tc := range []struct {
		name       string
		store      func(root string) remote.Store
		minUpdates int // upload updates before the last one
	}{
		{"s3", func(string) remote.Store { return s3Store(t, srv) }, 0},
		{"file-slow", func(root string) remote.Store {
			st, err := remote.Open("file://"+filepath.Join(root, "store"), remote.Options{})
			if err != nil {
				t.Fatal(err)
			}
			return slowPutStore{st}
		}, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := newEnv(t)
			a.store.SetRemote(RemoteConfig{Store: tc.store(a.root)})
			randomTree(t, filepath.Join(a.root, "src"), 4, 256<<10) // ~1 MiB, incompressible
			l := a.build(t, "base", "1", filepath.Join(a.root, "src"))
			var got []Progress
			_, res, err := a.store.PushProgress(t.Context(), "base:1", func(p Progress) { got = append(got, p) })
			if err != nil || res.UploadedBytes != l.Size {
				t.Fatalf("push: %+v %v", res, err)
			}
			// Lines: upload, chunks, done; between them byte counts that
			// only grow and end at the image's size.
			var stages []string
			updates := map[string][]int64{}
			for _, p := range got {
				if p.Message != "" {
					stages = append(stages, p.Stage)
					continue
				}
				if p.Unit != "bytes" || p.Total != l.Size {
					t.Fatalf("update %+v: want bytes of %d", p, l.Size)
				}
				if u := updates[p.Stage]; len(u) > 0 && p.Done < u[len(u)-1] {
					t.Fatalf("%s went back: %v then %d", p.Stage, u, p.Done)
				}
				updates[p.Stage] = append(updates[p.Stage], p.Done)
			}
			if strings.Join(stages, ",") != "upload,chunks,done" {
				t.Fatalf("stages %v; events %+v", stages, got)
			}
			for _, st := range []string{StageUpload, StageChunks} {
				u := updates[st]
				if len(u) == 0 || u[len(u)-1] != l.Size {
					t.Fatalf("%s updates %v: want them to end at %d", st, u, l.Size)
				}
			}
			if n := len(updates[StageUpload]) - 1; n < tc.minUpdates {
				t.Fatalf("upload: %d updates before the last, want at least %d: %v", n, tc.minUpdates, updates[StageUpload])
			}
			// Again: the store has it; a line says so, no bytes move.
			got = nil
			if _, res, err := a.store.PushProgress(t.Context(), "base:1", func(p Progress) { got = append(got, p) }); err != nil || res.UploadedBytes != 0 {
				t.Fatalf("second push: %+v %v", res, err)
			}
			if len(got) != 2 || !strings.Contains(got[0].Message, "already") || got[1].Stage != StageDone {
				t.Fatalf("second push reported %+v", got)
			}
		})
	}
}

// A node that knows a layer by its tag but lacks the image (a cluster's
// tag, built on another node) exports it all the same: the image comes
// from the layer store first.
func TestExportFetchesFromStore(t *testing.T) {
	a := newEnv(t)
	st, err := remote.Open("file://"+filepath.Join(a.root, "store"), remote.Options{})
	if err != nil {
		t.Fatal(err)
	}
	a.store.SetRemote(RemoteConfig{Store: st})
	src := writeTree(t, filepath.Join(a.root, "src"), map[string]string{"etc/os-release": "shoal\n"})
	l := a.build(t, "xfer", "1", src)
	if _, _, err := a.store.Push(context.Background(), "xfer:1"); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(a.store.ImagePath(l.Digest)); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	got, err := a.store.Export(context.Background(), "xfer:1", &out)
	if err != nil || got.Digest != l.Digest || out.Len() < int(l.Size) {
		t.Fatalf("export without the image here: %+v, %d bytes, %v", got, out.Len(), err)
	}
	if _, err := os.Stat(a.store.ImagePath(l.Digest)); err != nil {
		t.Errorf("the image fetched from the store is not kept: %v", err)
	}
}

// TestTenantPushPull: a tenant's push keeps its tag its own in the layer
// store (tenants/<t>/tags/...): another node resolves it for that tenant
// only, another tenant neither resolves nor pulls it, and a tenant pushes
// or pulls no shared tag.
func TestTenantPushPull(t *testing.T) {
	a := newEnv(t)
	st, err := remote.Open("file://"+filepath.Join(a.root, "store"), remote.Options{})
	if err != nil {
		t.Fatal(err)
	}
	a.store.SetRemote(RemoteConfig{Store: st})
	ctx := context.Background()
	src := writeTree(t, filepath.Join(a.root, "src"), map[string]string{"f": "tenant a\n"})
	l, err := a.store.Build(ctx, BuildOptions{Kind: KindBase, Name: "app", Version: "1", Source: src, Tenant: "a"})
	if err != nil {
		t.Fatal(err)
	}
	shared := writeTree(t, filepath.Join(a.root, "shared"), map[string]string{"f": "shared\n"})
	a.build(t, "base", "1", shared)
	ta := a.store.As(Owner{Tenant: "a"})
	if _, _, err := ta.PushProgress(ctx, "app:1", nil); err != nil {
		t.Fatal(err)
	}
	if _, _, err := ta.PushProgress(ctx, "base:1", nil); !errors.Is(err, ErrReadOnly) {
		t.Fatalf("a tenant pushes a shared tag: %v", err)
	}
	if _, _, err := a.store.Push(ctx, "base:1"); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Stat(ctx, tagKey("a", "app", "1")); err != nil {
		t.Fatalf("a's tag in the store: %v", err)
	}
	if _, err := st.Stat(ctx, tagKey("", "app", "1")); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("a's tag is shared in the store: %v", err)
	}

	b := newEnv(t)
	b.store.SetRemote(RemoteConfig{Store: st})
	if got, err := b.store.As(Owner{Tenant: "a"}).Resolve("app:1"); err != nil || got.Digest != l.Digest || got.Tenant != "a" {
		t.Fatalf("a resolves its tag from the store on another node: %+v %v", got, err)
	}
	tb := b.store.As(Owner{Tenant: "b"})
	if _, err := tb.Resolve("app:1"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("b resolves a's tag from the store: %v", err)
	}
	if _, err := tb.Pull(ctx, "a/app:1"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("b pulls a's tag: %v", err)
	}
	if _, err := tb.Resolve("base:1"); err != nil {
		t.Fatalf("b resolves the shared base from the store: %v", err)
	}
	if _, err := tb.Pull(ctx, "base:1"); !errors.Is(err, ErrReadOnly) {
		t.Fatalf("b pulls (tags here) the shared base: %v", err)
	}
	if got, err := b.store.As(Owner{Tenant: "a"}).Pull(ctx, "app:1"); err != nil || got.Tenant != "a" {
		t.Fatalf("a pulls its own: %+v %v", got, err)
	}
}

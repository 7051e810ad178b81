package lazy

import (
	"bytes"
	"context"
	"encoding/json"
	"math/rand/v2"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/layer/remote"
	"github.com/shoal-sandbox/shoal/internal/layer/remote/s3server/s3test"
)

// slowS3 starts a real S3 server (gofakes3, a child process) whose
// responses share rate bytes per second, and puts a random image of size
// bytes in it as key "img".
func slowS3(t *testing.T, rate int64, size int) (remote.Store, []byte) {
	t.Helper()
	srv := s3test.Start(t, t.TempDir(), "shoal", rate)
	st, err := remote.Open("s3://"+srv.Bucket+"/layers", remote.Options{Endpoint: "http://" + srv.Addr, AccessKey: "test", SecretKey: "test", Region: "us-east-1", PathStyle: true})
	if err != nil {
		t.Fatal(err)
	}
	data := make([]byte, size)
	r := rand.New(rand.NewPCG(5, 6))
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	if err := st.Put(context.Background(), "img", bytes.NewReader(data), int64(size)); err != nil {
		t.Fatal(err)
	}
	return st, data
}

// TestDemandBeforePrefetch: with a large trace prefetch under way over a
// slow link, reads that wait on the store (misses on chunks the trace does
// not hold, one after another as a process's page faults come) are served
// first: the prefetch stops taking the link while they wait, instead of
// sharing it with them request for request. A read of a chunk the
// prefetch has not reached yet is fetched once, not twice.
func TestDemandBeforePrefetch(t *testing.T) {
	const (
		rate   = 2 << 20 // bytes/s of the link
		chunk  = 16 << 10
		size   = 24 << 20
		traced = 1024 // chunks 0..traced-1: 16 MiB, ~8 s of the link
		reads  = 96   // demand reads of chunks after the trace
	)
	st, data := slowS3(t, rate, size)
	m, err := BuildManifest(bytes.NewReader(data), chunk)
	if err != nil {
		t.Fatal(err)
	}
	cacheDir := t.TempDir()
	hexd := "ab" + string(bytes.Repeat([]byte("0"), 62))
	trace := make([]int32, traced)
	for i := range trace {
		trace[i] = int32(i)
	}
	b, _ := json.Marshal(trace)
	if err := writeFileAtomic(filepath.Join(cacheDir, "traces", hexd+".json"), b); err != nil {
		t.Fatal(err)
	}
	f, err := newFS(st, Config{CacheDir: cacheDir, Readahead: -1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	im, prefetch := f.newImage(hexd, "img", m)
	if !prefetch {
		t.Fatal("the image has a trace but no prefetch")
	}
	prefetchDone := make(chan struct{})
	go func() { im.prefetch(); close(prefetchDone) }()
	defer func() { im.stop(); <-prefetchDone }()

	// The prefetch fills its background slots.
	deadline := time.Now().Add(30 * time.Second)
	for _, bg := f.sched.counts(); bg < f.cfg.Parallel; _, bg = f.sched.counts() {
		if time.Now().After(deadline) {
			t.Fatalf("prefetch has %d of %d requests in flight after 30s", bg, f.cfg.Parallel)
		}
		time.Sleep(5 * time.Millisecond)
	}

	read := func(i int) {
		t.Helper()
		buf := make([]byte, 4096)
		off := int64(i) * chunk
		n, err := im.readAt(context.Background(), buf, off)
		if err != nil || n != len(buf) || !bytes.Equal(buf, data[off:off+int64(n)]) {
			t.Fatalf("read chunk %d: %d bytes, %v, or not the image's bytes", i, n, err)
		}
	}
	start := time.Now()
	for k := range reads {
		read(traced + 10 + 3*k) // not adjacent: one request each
	}
	took := time.Since(start)
	// Sharing the link with the prefetch's requests one for one, as the
	// loader did, the reads get 1/(Parallel+1) of it.
	shared := time.Duration(float64(reads*chunk*(f.cfg.Parallel+1)) / rate * float64(time.Second))
	t.Logf("%d demand reads took %v while a prefetch ran (sharing the link evenly: ~%v, alone: ~%v)", reads, took, shared, time.Duration(float64(reads*chunk)/rate*float64(time.Second)))
	if took > shared*6/10 {
		t.Fatalf("%d demand reads took %v behind a prefetch, want under %v: demand fetches are not served first", reads, took, shared*6/10)
	}

	// A traced chunk the prefetch has not reached: fetched on demand, then
	// skipped by the prefetch.
	read(traced - 5)
	select {
	case <-prefetchDone:
	case <-time.After(2 * time.Minute):
		t.Fatal("prefetch not done after 2 min")
	}
	if got, want := f.Stats().ChunksFetched, int64(traced+reads); got != want {
		t.Fatalf("fetched %d chunks, want %d: some were fetched twice", got, want)
	}
}

// TestReadaheadAlone: a lone reader's sequential misses still read ahead
// right after one another (the hold that keeps prefetch off between a
// process's faults does not drop them).
func TestReadaheadAlone(t *testing.T) {
	const chunk = 16 << 10
	st, data := slowS3(t, 0, 1<<20)
	m, err := BuildManifest(bytes.NewReader(data), chunk)
	if err != nil {
		t.Fatal(err)
	}
	f, err := newFS(st, Config{CacheDir: t.TempDir(), Readahead: 4}, nil)
	if err != nil {
		t.Fatal(err)
	}
	im, _ := f.newImage(strings.Repeat("cd", 32), "img", m)
	defer im.stop()
	buf := make([]byte, chunk)
	for _, i := range []int{10, 11} { // the second miss follows the first
		if n, err := im.readAt(context.Background(), buf, int64(i)*chunk); err != nil || !bytes.Equal(buf[:n], data[i*chunk:(i+1)*chunk]) {
			t.Fatalf("read chunk %d: %v, or not its bytes", i, err)
		}
	}
	deadline := time.Now().Add(20 * time.Second)
	for i := 12; i < 16; i++ {
		for !f.cache.has(im.hex, i) {
			if time.Now().After(deadline) {
				t.Fatalf("chunk %d not read ahead after 20s of a sequential miss", i)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
}

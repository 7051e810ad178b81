package layer

import (
	"context"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/layer/lazy"
	"github.com/shoal-sandbox/shoal/internal/layer/remote"
	"github.com/shoal-sandbox/shoal/internal/layer/remote/s3server/s3test"
)

// TestMeasureLazy prints, as JSON, what lazy loading fetches for a
// workload reading every 10th file of a real tree (SHOAL_MEASURE_TREE,
// default /usr/lib/python3) at several chunk sizes, and the workload's time
// cold, cold with a trace prefetch, and warm, with the S3 server limited to
// SHOAL_MEASURE_RATE bytes/s (default 50 MB/s). It measures; it asserts
// nothing. Run: SHOAL_MEASURE=1 go test -run TestMeasureLazy -v ./internal/layer/
func TestMeasureLazy(t *testing.T) {
	if os.Getenv("SHOAL_MEASURE") == "" {
		t.Skip("a measurement: set SHOAL_MEASURE=1")
	}
	needLazy(t)
	tree := os.Getenv("SHOAL_MEASURE_TREE")
	if tree == "" {
		tree = "/usr/lib/python3"
	}
	var rate int64 = 50 << 20
	if v, err := strconv.Atoi(os.Getenv("SHOAL_MEASURE_LOOP_RA_KB")); err == nil {
		loopReadaheadKB = v
	}
	if v := os.Getenv("SHOAL_MEASURE_LOOP_DIO"); v != "" {
		loopDirectIO = v == "1"
	}
	lcfg := lazy.Config{}
	if v, err := strconv.Atoi(os.Getenv("SHOAL_MEASURE_READAHEAD")); err == nil {
		lcfg.Readahead = v
	}
	chunks := []int64{64 << 10, 256 << 10, 1 << 20}
	if v := os.Getenv("SHOAL_MEASURE_CHUNKS_KIB"); v != "" {
		chunks = nil
		for _, f := range strings.Split(v, ",") {
			k, _ := strconv.Atoi(f)
			chunks = append(chunks, int64(k)<<10)
		}
	}
	comps := []string{"none", "lz4hc"}
	if v := os.Getenv("SHOAL_MEASURE_COMPRESSION"); v != "" {
		comps = strings.Split(v, ",")
	}
	srv := s3test.Start(t, t.TempDir(), "shoal", rate)
	var workload []string
	var touched int64
	i := 0
	filepath.WalkDir(tree, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if i%10 == 0 {
				rel, _ := filepath.Rel(tree, p)
				workload = append(workload, rel)
				if fi, err := d.Info(); err == nil {
					touched += fi.Size()
				}
			}
			i++
		}
		return nil
	})
	type row struct {
		Compression     string  `json:"compression"`
		ChunkKiB        int64   `json:"chunk_kib"`
		ImageBytes      int64   `json:"image_bytes"`
		Files           int     `json:"files"`
		FilesRead       int     `json:"files_read"`
		TouchedBytes    int64   `json:"touched_bytes"`
		FetchedBytes    int64   `json:"fetched_bytes"`
		FetchedOverRead float64 `json:"fetched_over_touched"`
		Chunks          int64   `json:"chunks_fetched"`
		ColdSeconds     float64 `json:"cold_seconds"`
		PrefetchSeconds float64 `json:"cold_with_trace_prefetch_seconds"`
		WarmSeconds     float64 `json:"warm_cache_seconds"`
	}
	for _, comp := range comps {
		a := newEnv(t)
		l, err := a.store.Build(context.Background(), BuildOptions{Kind: KindBase, Name: "m", Version: comp, Source: tree, Compression: comp})
		if err != nil {
			t.Fatal(err)
		}
		for _, cs := range chunks {
			// A store prefix per chunk size: a digest list of its own.
			st2, err := remote.Open(fmt.Sprintf("s3://%s/m-%s-%d", srv.Bucket, comp, cs>>10), remote.Options{Endpoint: "http://" + srv.Addr, AccessKey: "test", SecretKey: "test", Region: "us-east-1", PathStyle: true})
			if err != nil {
				t.Fatal(err)
			}
			a.store.SetRemote(RemoteConfig{Store: st2, ChunkSize: cs})
			if _, _, err := a.store.Push(context.Background(), l.Ref()); err != nil {
				t.Fatal(err)
			}
			readAll := func(n *lazyNode) time.Duration {
				n.env.store.Resolve(l.Digest)
				start := time.Now()
				dir, err := n.env.store.Acquire(l.Digest)
				if err != nil {
					t.Fatal(err)
				}
				for _, w := range workload {
					if _, err := os.ReadFile(filepath.Join(dir, w)); err != nil {
						t.Fatal(err)
					}
				}
				took := time.Since(start)
				n.env.store.Release(l.Digest)
				return took
			}
			cache := filepath.Join(t.TempDir(), "c")
			n := newLazyNode(t, st2, cache, lcfg)
			cold := readAll(n)
			s := n.fs.Stats()
			warm := readAll(n)
			n.fs.Unmount()
			// Cold with the trace: chunks gone, trace kept.
			os.RemoveAll(filepath.Join(cache, "chunks"))
			n2 := newLazyNode(t, st2, cache, lcfg)
			pre := readAll(n2)
			n2.fs.Unmount()
			r := row{comp, cs >> 10, l.Size, i, len(workload), touched, s.BytesFetched, float64(s.BytesFetched) / float64(touched), s.ChunksFetched, cold.Seconds(), pre.Seconds(), warm.Seconds()}
			b, _ := json.Marshal(r)
			t.Logf("%s", b)
		}
	}
}

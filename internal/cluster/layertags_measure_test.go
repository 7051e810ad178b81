package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/cluster/etcdtest"
	"github.com/shoal-sandbox/shoal/internal/layer"
)

// TestMeasureLayerTagMove measures a tag's move in the cluster:
// SHOAL_TAG_MEASURE=N moves one tag N times through a node's layer store
// (etcd first, then its own copy) in an embedded etcd, and times each
// move and how long until another node's store resolves the new layer (its
// watch). It prints one JSON line. Skipped unless set.
func TestMeasureLayerTagMove(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("SHOAL_TAG_MEASURE"))
	if n <= 0 {
		t.Skip("set SHOAL_TAG_MEASURE=N to measure N tag moves and their propagation")
	}
	ep := etcdtest.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	src, dst := openStore(t), openStore(t)
	for _, s := range []*layer.Store{src, dst} {
		m, err := MirrorLayers(ctx, client(t, ep), s, log)
		if err != nil {
			t.Fatal(err)
		}
		s.SetClusterTags(m)
	}
	// Two layers to move the tag between, tagged first.
	for i := range 2 {
		if _, _, err := PutLayerTag(ctx, client(t, ep), baseLayer(fmt.Sprintf("v:%d", i), i+1)); err != nil {
			t.Fatal(err)
		}
	}
	for !resolvesTo(src, "v:1", digestOf(2)) {
		time.Sleep(time.Millisecond)
	}
	moves := make([]time.Duration, 0, n)
	seen := make([]time.Duration, 0, n)
	for i := range n {
		want := i%2 + 1
		start := time.Now()
		if _, _, err := src.Tag(fmt.Sprintf("v:%d", i%2), "moving:1"); err != nil {
			t.Fatal(err)
		}
		moves = append(moves, time.Since(start))
		for !resolvesTo(dst, "moving:1", digestOf(want)) {
			time.Sleep(100 * time.Microsecond)
		}
		seen = append(seen, time.Since(start))
	}
	pct := func(d []time.Duration, p float64) float64 {
		slices.Sort(d)
		return float64(d[int(float64(len(d)-1)*p)].Microseconds()) / 1000
	}
	b, _ := json.Marshal(map[string]any{
		"moves": n, "move_p50_ms": pct(moves, 0.5), "move_p99_ms": pct(moves, 0.99),
		"seen_by_other_node_p50_ms": pct(seen, 0.5), "seen_by_other_node_p99_ms": pct(seen, 0.99),
	})
	fmt.Println(string(b))
}

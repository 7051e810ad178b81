//go:build !client

package main

import (
	"fmt"
	"log/slog"
	"path/filepath"
	"time"

	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/layer/lazy"
	"github.com/shoal-sandbox/shoal/internal/layer/remote"
	"github.com/shoal-sandbox/shoal/internal/metrics"
)

// openLayerStore attaches the configured layer store to layers and, for an
// s3:// store, mounts the lazy loader (returned, to unmount at shutdown)
// and registers its metrics.
func openLayerStore(cfg serveConfig, layers *layer.Store, mt *metrics.Metrics, log *slog.Logger) (*lazy.FS, error) {
	lc := cfg.LayerStore
	st, err := remote.Open(lc.URL, lc.S3)
	if err != nil {
		return nil, fmt.Errorf("--layer-store: %w", err)
	}
	rc := layer.RemoteConfig{Store: st, WriteThrough: lc.WriteThrough, ChunkSize: lc.ChunkSize, CacheMax: lc.ImageCacheMax}
	var lz *lazy.FS
	if st.LocalPath("tags") == "" && lc.Lazy {
		dir := filepath.Join(cfg.DataDir, "layers")
		lz, err = lazy.Mount(filepath.Join(dir, "lazy"), st, lazy.Config{
			CacheDir:     filepath.Join(dir, "lazy-cache"),
			CacheMax:     lc.CacheMax,
			FetchTimeout: lc.FetchTimeout,
			OnFetch:      func(_ int, took time.Duration) { mt.LazyFetch(took) },
		}, log)
		if err != nil {
			return nil, fmt.Errorf("--layer-store %s: lazy loader: %w", lc.URL, err)
		}
		rc.Lazy = lz
		registerLazyMetrics(mt, lz)
	}
	layers.SetRemote(rc)
	log.Info("layer store", "url", st.URL(), "lazy", lz != nil, "write_through", lc.WriteThrough)
	return lz, nil
}

func registerLazyMetrics(mt *metrics.Metrics, lz *lazy.FS) {
	one := func(v float64) []metrics.Gauge { return []metrics.Gauge{{Value: v}} }
	mt.Counters("shoal_layer_lazy_fetched_bytes_total", "Bytes the lazy layer loader fetched from the layer store.", nil, func() []metrics.Gauge {
		return one(float64(lz.Stats().BytesFetched))
	})
	mt.Counters("shoal_layer_lazy_chunks_fetched_total", "Chunks the lazy layer loader fetched from the layer store.", nil, func() []metrics.Gauge {
		return one(float64(lz.Stats().ChunksFetched))
	})
	mt.Counters("shoal_layer_lazy_fetch_errors_total", "Failed chunk fetch attempts (each retry counts).", nil, func() []metrics.Gauge {
		return one(float64(lz.Stats().FetchErrors))
	})
	mt.Counters("shoal_layer_lazy_cache_reads_total", "Chunk reads by the lazy layer loader, by result (hit: from the on-disk cache; miss: waited on a fetch).", []string{"result"}, func() []metrics.Gauge {
		s := lz.Stats()
		return []metrics.Gauge{{Labels: []string{"hit"}, Value: float64(s.CacheHits)}, {Labels: []string{"miss"}, Value: float64(s.CacheMisses)}}
	})
	mt.Gauges("shoal_layer_lazy_cache_hit_ratio", "Hits / (hits + misses) of the lazy chunk cache since the node started.", nil, func() []metrics.Gauge {
		s := lz.Stats()
		if s.CacheHits+s.CacheMisses == 0 {
			return one(0)
		}
		return one(float64(s.CacheHits) / float64(s.CacheHits+s.CacheMisses))
	})
	mt.Gauges("shoal_layer_lazy_cache_bytes", "Bytes of chunks in the lazy loader's on-disk cache.", nil, func() []metrics.Gauge {
		return one(float64(lz.Stats().CacheBytes))
	})
	mt.Counters("shoal_layer_lazy_prefetched_chunks_total", "Chunks fetched ahead of use by trace-driven prefetch.", nil, func() []metrics.Gauge {
		return one(float64(lz.Stats().Prefetched))
	})
}

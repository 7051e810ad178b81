// Package s3server runs a real S3-compatible HTTP server (gofakes3 over a
// directory) on 127.0.0.1 for tests and benchmarks, optionally with its
// responses rate-limited so that the network, not the disk, is the
// bottleneck. Tests run it as a child process (package s3test) so that it
// can be killed mid-read.
package s3server

import (
	"context"
	"io"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3afero"
	"github.com/spf13/afero"
)

// Handler serves an S3 API over the buckets in dir (one directory each),
// creating bucket if it is not "" and does not exist. rate > 0 limits the
// bytes per second of all response bodies together.
func Handler(dir, bucket string, rate int64) (http.Handler, error) {
	be, err := s3afero.MultiBucket(afero.NewBasePathFs(afero.NewOsFs(), dir))
	if err != nil {
		return nil, err
	}
	if bucket != "" {
		if ok, _ := be.BucketExists(bucket); !ok {
			if err := be.CreateBucket(bucket); err != nil {
				return nil, err
			}
		}
	}
	h := gofakes3.New(be, gofakes3.WithTimeSkewLimit(0)).Server()
	if rate <= 0 {
		return h, nil
	}
	lim := &limiter{rate: float64(rate), next: time.Now()}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.ServeHTTP(&limitedWriter{ResponseWriter: w, lim: lim}, r)
	}), nil
}

// limiter is a token bucket shared by every response.
type limiter struct {
	rate float64 // bytes per second
	mu   sync.Mutex
	next time.Time // guarded by mu: when the bytes sent so far have been paid for
}

func (l *limiter) wait(n int) {
	l.mu.Lock()
	now := time.Now()
	if l.next.Before(now.Add(-50 * time.Millisecond)) {
		l.next = now.Add(-50 * time.Millisecond) // a small burst, no more
	}
	l.next = l.next.Add(time.Duration(float64(n) / l.rate * float64(time.Second)))
	until := l.next
	l.mu.Unlock()
	time.Sleep(time.Until(until))
}

type limitedWriter struct {
	http.ResponseWriter
	lim *limiter
}

func (w *limitedWriter) Write(p []byte) (int, error) {
	n := 0
	for len(p) > 0 {
		k := min(len(p), 16<<10)
		w.lim.wait(k)
		m, err := w.ResponseWriter.Write(p[:k])
		n += m
		if err != nil {
			return n, err
		}
		p = p[k:]
	}
	return n, nil
}

// ReadFrom hides the underlying writer's, which would bypass the limit.
func (w *limitedWriter) ReadFrom(r io.Reader) (int64, error) {
	return io.CopyBuffer(struct{ io.Writer }{w}, r, make([]byte, 32<<10))
}

// Serve listens on addr and serves Handler until ctx ends; ready gets the
// address it listens on.
func Serve(ctx context.Context, addr, dir, bucket string, rate int64, ready func(string)) error {
	h, err := Handler(dir, bucket, rate)
	if err != nil {
		return err
	}
	return serve(ctx, addr, h, ready)
}

// ServeLatency is Serve, unlimited, with each request answered after
// latency (a store's time to first byte).
func ServeLatency(ctx context.Context, addr, dir, bucket string, latency time.Duration, ready func(string)) error {
	h, err := Handler(dir, bucket, 0)
	if err != nil {
		return err
	}
	return serve(ctx, addr, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if latency > 0 {
			time.Sleep(latency)
		}
		h.ServeHTTP(w, r)
	}), ready)
}

func serve(ctx context.Context, addr string, h http.Handler, ready func(string)) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	if ready != nil {
		ready(ln.Addr().String())
	}
	if err := srv.Serve(ln); err != nil && err != http.ErrServerClosed {
		return err
	}
	return nil
}

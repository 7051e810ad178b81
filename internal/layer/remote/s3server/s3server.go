// Package s3server runs a real S3-compatible HTTP server (gofakes3 over a
// directory) on 127.0.0.1 for tests and benchmarks, optionally with its
// responses rate-limited so that the network, not the disk, is the
// bottleneck. Tests run it as a child process (Start) so that it can be
// killed mid-read.
package s3server

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
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

// ServeLatency is Serve, unlimited, with each request answered after
// latency (a store's time to first byte).
func ServeLatency(ctx context.Context, addr, dir, bucket string, latency time.Duration, ready func(string)) error {
	h, err := Handler(dir, bucket, 0)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if latency > 0 {
			time.Sleep(latency)
		}
		h.ServeHTTP(w, r)
	}), ReadHeaderTimeout: 10 * time.Second}
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

// The child process: a binary that imports this package and is started
// with these variables set serves S3 and never returns.
const (
	envDir    = "SHOAL_S3SERVER_DIR"
	envBucket = "SHOAL_S3SERVER_BUCKET"
	envRate   = "SHOAL_S3SERVER_RATE"
	envAddr   = "SHOAL_S3SERVER_ADDR"
)

func init() {
	dir := os.Getenv(envDir)
	if dir == "" {
		return
	}
	rate, _ := strconv.ParseInt(os.Getenv(envRate), 10, 64)
	addr := os.Getenv(envAddr)
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	err := Serve(context.Background(), addr, dir, os.Getenv(envBucket), rate, func(a string) {
		fmt.Printf("listening %s\n", a)
	})
	fmt.Fprintln(os.Stderr, "s3server:", err)
	os.Exit(1)
}

// Server is a child process serving S3.
type Server struct {
	Addr   string // host:port
	Bucket string
	dir    string
	rate   int64
	cmd    *exec.Cmd
	t      testing.TB
}

// Start runs this test binary again as an S3 server over dir (a bucket
// directory inside it), on 127.0.0.1. It is killed when the test ends.
func Start(t testing.TB, dir, bucket string, rate int64) *Server {
	t.Helper()
	s := &Server{Bucket: bucket, dir: dir, rate: rate, t: t}
	s.start("127.0.0.1:0")
	t.Cleanup(s.Kill)
	return s
}

func (s *Server) start(addr string) {
	t := s.t
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envDir+"="+s.dir, envBucket+"="+s.Bucket, envRate+"="+strconv.FormatInt(s.rate, 10), envAddr+"="+addr)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if a, ok := strings.CutPrefix(sc.Text(), "listening "); ok {
				line <- a
			}
		}
		close(line)
	}()
	select {
	case a, ok := <-line:
		if !ok {
			cmd.Process.Kill()
			cmd.Wait()
			t.Fatal("s3server: exited before listening")
		}
		s.Addr = a
	case <-time.After(30 * time.Second):
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatal("s3server: not listening after 30s")
	}
	s.cmd = cmd
}

// Kill ends the server at once (SIGKILL), mid-request if need be.
func (s *Server) Kill() {
	if s.cmd == nil {
		return
	}
	s.cmd.Process.Kill()
	s.cmd.Wait()
	s.cmd = nil
}

// Restart starts the server again on the same address and directory.
func (s *Server) Restart() {
	s.Kill()
	s.start(s.Addr)
}

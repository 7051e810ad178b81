// Package s3test runs s3server as a child process of a test binary, so
// that a test can kill it mid-read and start it again. Only tests import
// it: its init turns the binary into the server when the variables below
// are set.
package s3test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/layer/remote/s3server"
)

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
	err := s3server.Serve(context.Background(), addr, dir, os.Getenv(envBucket), rate, func(a string) {
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

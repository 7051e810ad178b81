// Package serveproc holds what the end-to-end harnesses (test/e2e,
// test/fncall) do with the `shoal serve` process they start.
package serveproc

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"
)

// Exited reports whether pid is gone or has exited and waits to be reaped.
func Exited(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] == 'Z'
}

// Stop asks serve (started with Setpgid) to stop with SIGTERM and kills
// its process group if it has not within 30 s: a teardown must not hang,
// nor leave a serve behind.
func Stop(cmd *exec.Cmd) {
	cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		fmt.Fprintln(os.Stderr, "shoal serve did not stop within 30 s of SIGTERM: killed")
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
	}
}

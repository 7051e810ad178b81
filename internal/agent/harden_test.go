package agent

import (
	"context"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestAgentNotDumpable: a process of the agent's own uid cannot look into
// it through /proc (as a command of a sandbox, same uid, cannot): the
// agent is not dumpable. Run as nobody, where the capabilities of root do
// not blur the picture.
func TestAgentNotDumpable(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run the agent and its peer as another user")
	}
	// Not t.TempDir: nobody must be able to reach it.
	dir, err := os.MkdirTemp("", "agnd")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	os.Chmod(dir, 0o777)
	data, err := os.ReadFile(agentBinary(t))
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "shoal-agent")
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "s")
	nobody := &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	cmd := exec.Command(bin, "--listen", sock)
	cmd.SysProcAttr = nobody
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	c := NewClient(sock)
	waitReady(t, c)
	pid := strconv.Itoa(cmd.Process.Pid)
	for _, p := range []string{"/proc/" + pid + "/environ", "/proc/" + pid + "/mem", "/proc/" + pid + "/fd/2"} {
		peer := exec.Command("/bin/cat", p)
		peer.SysProcAttr = nobody
		out, err := peer.CombinedOutput()
		if err == nil || !strings.Contains(string(out), "ermission denied") {
			t.Errorf("cat %s as the agent's uid: %v %q; want permission denied", p, err, out)
		}
	}
	// Its commands are dumpable again (execve): their own /proc is theirs.
	p, err := c.Exec(context.Background(), ExecRequest{Args: []string{"/bin/sh", "-c", "cat /proc/$$/environ >/dev/null && echo readable"}})
	if err != nil {
		t.Fatal(err)
	}
	if r := collect(t, p); r.stdout != "readable\n" || r.exit.Code != 0 {
		t.Errorf("a command reading its own /proc: %q %q %+v", r.stdout, r.stderr, r.exit)
	}
}

// TestAgentLogNeverBlocks: the agent's log is a pipe that nobody reads
// (the node is gone, or slow), then a pipe without a reader: it keeps
// serving, and leaves the descriptor it inherited blocking.
func TestAgentLogNeverBlocks(t *testing.T) {
	bin := agentBinary(t)
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil { // blocking, unlike os.Pipe
		t.Fatal(err)
	}
	r, w := os.NewFile(uintptr(p[0]), "log-r"), os.NewFile(uintptr(p[1]), "log-w")
	defer r.Close()
	sock := shortSocket(t)
	cmd := exec.Command(bin, "--listen", sock)
	cmd.Stderr = w
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	c := NewClient(sock)
	waitReady(t, c)
	if fl, err := unix.FcntlInt(w.Fd(), unix.F_GETFL, 0); err != nil || fl&unix.O_NONBLOCK != 0 {
		t.Errorf("the inherited description's flags %#x %v: want it left blocking", fl, err)
	}
	// Fill the pipe to the brim, as a node that stopped reading would
	// leave it.
	fill, err := unix.Open("/proc/self/fd/"+strconv.Itoa(p[1]), unix.O_WRONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	filler := make([]byte, 4096)
	filled := 0
	for {
		n, err := unix.Write(fill, filler)
		if err != nil {
			break
		}
		filled += n
	}
	unix.Close(fill)
	w.Close()

	// Each broken request is a warning line on the log, written before the
	// agent closes the connection: once it did, the line was written or
	// dropped.
	warnings := func(n int) {
		t.Helper()
		for range n {
			conn, err := net.Dial("unix", sock)
			if err != nil {
				t.Fatal(err)
			}
			conn.Write([]byte{FrameRequest})
			conn.(*net.UnixConn).CloseWrite()
			conn.SetReadDeadline(time.Now().Add(5 * time.Second))
			_, err = io.Copy(io.Discard, conn)
			conn.Close()
			if err != nil {
				t.Fatalf("the agent does not finish a broken request: %v (stuck writing its log?)", err)
			}
		}
	}
	ping := func(when string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if _, err := c.Ping(ctx); err != nil {
			t.Fatalf("%s: ping: %v", when, err)
		}
	}
	warnings(500)
	ping("with a full log pipe")
	// Dropped, not waiting: no thread stuck in a write, and nothing comes
	// once the pipe is drained.
	if n, _ := strconv.Atoi(procStatus(t, cmd.Process.Pid, "Threads")); n > 50 {
		t.Errorf("agent has %d threads: writes to its log block", n)
	}
	unix.SetNonblock(p[0], true)
	var log []byte
	buf := make([]byte, 64<<10)
	for deadline := time.Now().Add(200 * time.Millisecond); time.Now().Before(deadline); {
		n, _ := unix.Read(p[0], buf)
		if n > 0 {
			log = append(log, buf[:n]...)
		} else {
			time.Sleep(10 * time.Millisecond)
		}
	}
	if len(log) < filled {
		t.Fatalf("read %d bytes, want at least the %d we wrote", len(log), filled)
	}
	if lines := strings.Count(string(log[filled:]), "shoal-agent: read request"); lines != 0 {
		t.Errorf("%d of 500 warnings made on a full pipe reached it later: they waited instead of being dropped", lines)
	}
	r.Close() // now without a reader: EPIPE
	warnings(200)
	ping("with a log pipe without a reader")
	if err := cmd.Process.Signal(syscall.Signal(0)); err != nil {
		t.Fatalf("agent gone: %v", err)
	}
}

package forkserver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The test binary is its own fork server.
func TestMain(m *testing.M) {
	Serve()
	os.Exit(m.Run())
}

func newClient(t *testing.T) *Client {
	t.Helper()
	c := NewClient(os.Args[0])
	t.Cleanup(c.Close)
	return c
}

// run starts sh -c script through c and returns its stdout and pid.
func run(t *testing.T, c *Client, req Request) (string, Process) {
	t.Helper()
	devNull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer devNull.Close()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	p, err := c.Start(ctx, req, []*os.File{devNull, w, w})
	w.Close()
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(p.Close)
	r.SetReadDeadline(time.Now().Add(20 * time.Second))
	out, err := io.ReadAll(r)
	if err != nil {
		t.Fatalf("read output: %v", err)
	}
	return string(out), p
}

func sh(script string, env ...string) Request {
	return Request{Path: "/bin/sh", Args: []string{"sh", "-c", script}, Env: env, Dir: "/"}
}

// A child gets its request's environment and descriptors, nothing of the
// server's (its socket above all), and is not the caller's child.
func TestStart(t *testing.T) {
	c := newClient(t)
	out, p := run(t, c, sh(`echo "$FOO"; pwd; ls /proc/self/fd; grep PPid /proc/self/status`, "FOO=bar"))
	lines := strings.Fields(out)
	if len(lines) < 3 || lines[0] != "bar" || lines[1] != "/" {
		t.Fatalf("output %q: want FOO=bar and cwd /", out)
	}
	// 0, 1, 2 and ls's own directory: 3.
	if got := strings.Join(lines[2:len(lines)-2], " "); got != "0 1 2 3" {
		t.Errorf("child's descriptors: %s, want 0 1 2 3 (nothing of the server's)", got)
	}
	if ppid := lines[len(lines)-1]; ppid == fmt.Sprint(os.Getpid()) {
		t.Errorf("the child's parent is the caller (%s): the server did not fork it", ppid)
	}
	if p.Pid <= 0 {
		t.Errorf("pid %d", p.Pid)
	}
}

// A user namespace of its own with the requested maps and credentials: the
// case the fork server exists for.
func TestStartUserNamespace(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (writes a child's uid and gid maps)")
	}
	c := newClient(t)
	req := sh(`cat /proc/self/uid_map /proc/self/gid_map; echo "uid=$(id -u) gid=$(id -g)"; sleep 30`)
	req.Cloneflags = syscall.CLONE_NEWUSER | syscall.CLONE_NEWNS
	req.UidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: 1 << 30, Size: 65536}}
	req.GidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: 1 << 30, Size: 65536}}
	req.GidMappingsEnableSetgroups = true
	req.Credential = &syscall.Credential{Uid: 0, Gid: 0}
	req.Setsid = true
	req.Nice = 7

	devNull, _ := os.Open(os.DevNull)
	defer devNull.Close()
	r, w, _ := os.Pipe()
	defer r.Close()
	p, err := c.Start(context.Background(), req, []*os.File{devNull, w, w})
	w.Close()
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	defer p.Close()
	buf := make([]byte, 4096)
	r.SetReadDeadline(time.Now().Add(20 * time.Second))
	var out string
	for !strings.Contains(out, "gid=") {
		n, err := r.Read(buf)
		if err != nil {
			t.Fatalf("read: %v (so far %q)", err, out)
		}
		out += string(buf[:n])
	}
	if f := strings.Fields(out); len(f) < 8 || f[0] != "0" || f[1] != "1073741824" || f[2] != "65536" || f[3] != "0" || f[4] != "1073741824" ||
		f[6] != "uid=0" || f[7] != "gid=0" {
		t.Fatalf("maps and ids: %q", out)
	}
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.Pid))
	if err != nil {
		t.Fatal(err)
	}
	// Fields after the command's ")": state ppid pgrp session ... (19th: nice).
	f := strings.Fields(string(st[strings.LastIndexByte(string(st), ')')+2:]))
	if f[3] != fmt.Sprint(p.Pid) {
		t.Errorf("session %s: want its own (%d, setsid)", f[3], p.Pid)
	}
	if f[16] != "7" {
		t.Errorf("nice %s, want 7", f[16])
	}
	if err := p.Kill(); err != nil {
		t.Fatal(err)
	}
	// Killed through its pidfd: the pidfd polls readable once it exited.
	pfd := []unix.PollFd{{Fd: int32(p.PidFD), Events: unix.POLLIN}}
	if n, err := unix.Poll(pfd, 10_000); err != nil || n != 1 {
		t.Fatalf("poll pidfd after Kill: %d, %v", n, err)
	}
}

// A request that cannot start answers with the reason, and the server
// serves on; one it cannot even send is refused before.
func TestStartErrors(t *testing.T) {
	c := newClient(t)
	devNull, _ := os.Open(os.DevNull)
	defer devNull.Close()
	_, err := c.Start(context.Background(), Request{Path: "/nonexistent/prog", Args: []string{"prog"}}, []*os.File{devNull, devNull, devNull})
	if err == nil || !strings.Contains(err.Error(), "no such file") {
		t.Fatalf("start of a missing program: %v", err)
	}
	if _, err := c.Start(context.Background(), sh("true"), []*os.File{devNull}); err == nil {
		t.Fatal("a start without stdio was accepted")
	}
	many := make([]*os.File, maxFiles+1)
	for i := range many {
		many[i] = devNull
	}
	if _, err := c.Start(context.Background(), sh("true"), many); err == nil {
		t.Fatal("a start with too many descriptors was accepted")
	}
	if out, _ := run(t, c, sh("echo ok")); strings.TrimSpace(out) != "ok" {
		t.Fatalf("after the errors: %q", out)
	}
}

// A fork server that died is started again: at most the request in flight
// when it died fails.
func TestServerRestarts(t *testing.T) {
	c := newClient(t)
	run(t, c, sh("true"))
	c.mu.Lock()
	c.proc.Kill()
	c.mu.Unlock()
	devNull, _ := os.Open(os.DevNull)
	defer devNull.Close()
	ok := false
	for i := 0; i < 2 && !ok; i++ {
		p, err := c.Start(context.Background(), sh("true"), []*os.File{devNull, devNull, devNull})
		if err == nil {
			p.Close()
			ok = true
		}
	}
	if !ok {
		t.Fatal("no start succeeded after the server was killed")
	}
}

// Concurrent callers take turns on one server.
func TestConcurrentStarts(t *testing.T) {
	c := newClient(t)
	errc := make(chan error, 8)
	for i := 0; i < 8; i++ {
		go func(i int) {
			devNull, _ := os.Open(os.DevNull)
			defer devNull.Close()
			r, w, _ := os.Pipe()
			defer r.Close()
			p, err := c.Start(context.Background(), sh(fmt.Sprintf("echo %d", i)), []*os.File{devNull, w, devNull})
			w.Close()
			if err != nil {
				errc <- err
				return
			}
			defer p.Close()
			r.SetReadDeadline(time.Now().Add(20 * time.Second))
			out, err := io.ReadAll(r)
			if err == nil && strings.TrimSpace(string(out)) != fmt.Sprint(i) {
				err = fmt.Errorf("child %d said %q", i, out)
			}
			errc <- err
		}(i)
	}
	for i := 0; i < 8; i++ {
		if err := <-errc; err != nil {
			t.Error(err)
		}
	}
}

// A binary that is no fork server (it never says hello) is reported as
// ErrUnavailable at once, and not started again for a while.
func TestNotAForkServer(t *testing.T) {
	c := NewClient("/bin/true")
	defer c.Close()
	devNull, _ := os.Open(os.DevNull)
	defer devNull.Close()
	for i := 0; i < 2; i++ {
		t0 := time.Now()
		_, err := c.Start(context.Background(), sh("true"), []*os.File{devNull, devNull, devNull})
		if !errors.Is(err, ErrUnavailable) {
			t.Fatalf("start %d through /bin/true: %v, want ErrUnavailable", i, err)
		}
		if d := time.Since(t0); d > 5*time.Second {
			t.Errorf("start %d took %v", i, d)
		}
	}
}

// Children are reaped as they exit (no zombie), by one thread: a server
// with many children running has not many threads.
func TestReapsWithOneThread(t *testing.T) {
	c := newClient(t)
	devNull, _ := os.Open(os.DevNull)
	defer devNull.Close()
	var sleepers []Process
	defer func() {
		for _, p := range sleepers {
			p.Kill()
			p.Close()
		}
	}()
	for i := 0; i < 40; i++ {
		p, err := c.Start(context.Background(), sh("exec sleep 60"), []*os.File{devNull, devNull, devNull})
		if err != nil {
			t.Fatal(err)
		}
		sleepers = append(sleepers, p)
	}
	for i := 0; i < 20; i++ {
		p, err := c.Start(context.Background(), sh("exit 0"), []*os.File{devNull, devNull, devNull})
		if err != nil {
			t.Fatal(err)
		}
		p.Close()
	}
	c.mu.Lock()
	server := c.proc.Pid
	c.mu.Unlock()
	threads := func() int {
		es, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", server))
		return len(es)
	}
	zombies := func() (n int) {
		es, _ := os.ReadDir("/proc")
		for _, e := range es {
			st, err := os.ReadFile("/proc/" + e.Name() + "/stat")
			if err != nil {
				continue
			}
			s := string(st)
			f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
			if f[0] == "Z" && f[1] == fmt.Sprint(server) {
				n++
			}
		}
		return n
	}
	deadline := time.Now().Add(10 * time.Second)
	for zombies() > 0 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if n := zombies(); n > 0 {
		t.Errorf("%d children of the server left unreaped", n)
	}
	if n := threads(); n > 20 {
		t.Errorf("the server has %d threads with 40 children running", n)
	}
}

// A private server's children see neither the mounts below its shed
// directories that existed when it started nor any the node made after
// (the node's mounts are shared, as systemd makes them), only what their
// request binds, which the node never sees; a server started in its
// parent's mount namespace refuses to make it private.
func TestPrivateMounts(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (mounts)")
	}
	dir := t.TempDir()
	mount := func(p string) {
		t.Helper()
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mount("tmpfs", p, "tmpfs", 0, "size=1m"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Unmount(p, unix.MNT_DETACH) })
	}
	mount(dir)
	if err := unix.Mount("", dir, "", unix.MS_SHARED, ""); err != nil {
		t.Fatal(err)
	}
	mount(dir + "/before")
	for _, f := range []string{"target", "source"} {
		if err := os.WriteFile(dir+"/"+f, []byte(f+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	c := NewPrivateClient(os.Args[0], dir)
	t.Cleanup(c.Close)
	points := func(out string) []string {
		var ps []string
		for _, l := range strings.Split(out, "\n") {
			if f := strings.Fields(l); len(f) > 4 && strings.HasPrefix(f[4], dir) {
				ps = append(ps, f[4])
			}
		}
		return ps
	}
	// The server starts with the first request.
	out, _ := run(t, c, sh(`cat /proc/self/mountinfo`))
	if got := points(out); len(got) != 1 || got[0] != dir {
		t.Errorf("mounts below %s at the server's start: %v, want only the directory's own", dir, got)
	}
	mount(dir + "/after")
	req := sh(`cat ` + dir + `/target; cat /proc/self/mountinfo`)
	req.Cloneflags = syscall.CLONE_NEWNS
	req.Bind = &Bind{Source: dir + "/source", Target: dir + "/target"}
	out, _ = run(t, c, req)
	if !strings.HasPrefix(out, "source\n") {
		t.Errorf("the child's bound target says %q, want the source's content", strings.SplitN(out, "\n", 2)[0])
	}
	if got := points(out); len(got) != 2 || got[0] != dir || got[1] != dir+"/target" {
		t.Errorf("a child's mounts below %s: %v, want the directory and its bind only (nothing the node mounted after the server started)", dir, got)
	}
	if host, err := os.ReadFile(dir + "/target"); err != nil || string(host) != "target\n" {
		t.Errorf("the node's target says %q, %v: the bind reached the node", host, err)
	}
	out, _ = run(t, c, sh(`cat `+dir+`/target`))
	if out != "target\n" {
		t.Errorf("the next child's target says %q: the server kept the bind", out)
	}

	// Started in the parent's namespace (as a client that did not ask for
	// a new one would): no hello, and the node's mounts untouched.
	cmd := exec.Command(os.Args[0], "--forkserver")
	cmd.Env = []string{EnvFD + "=3", EnvShed + "=" + dir}
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	peer := os.NewFile(uintptr(fds[1]), "peer")
	defer unix.Close(fds[0])
	cmd.ExtraFiles = []*os.File{peer}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Run(); err == nil {
		t.Fatal("a private server in its parent's mount namespace ran")
	}
	peer.Close()
	if !strings.Contains(stderr.String(), "refusing") {
		t.Errorf("stderr %q", stderr.String())
	}
	mi, _ := os.ReadFile("/proc/self/mountinfo")
	if !strings.Contains(string(mi), " "+dir+"/before ") {
		t.Error("the node lost a mount")
	}
}

package agent

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// fnUID is the uid the fncall tests run as: one nothing else on a test
// machine uses (the tests kill every process of it).
const fnUID = 47913

func needRootFn(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (setuid, cgroups)")
	}
}

// fnCgroups creates a cgroup in the memory and pids v1 hierarchies and
// returns its tasks files opened for writing, and the directories.
func fnCgroups(t *testing.T) ([]int, []string) {
	t.Helper()
	var fds []int
	var dirs []string
	for _, h := range []string{"memory", "pids"} {
		root := filepath.Join("/sys/fs/cgroup", h)
		if _, err := os.Stat(filepath.Join(root, "tasks")); err != nil {
			t.Skip("needs the cgroup v1 " + h + " hierarchy at " + root)
		}
		d := filepath.Join(root, fmt.Sprintf("shoal-agent-fntest-%d-%d", os.Getpid(), time.Now().UnixNano()))
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
		dirs = append(dirs, d)
		fd, err := unix.Open(filepath.Join(d, "tasks"), unix.O_WRONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		fds = append(fds, fd)
	}
	t.Cleanup(func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
		for _, d := range dirs {
			for i := 0; i < 100 && os.Remove(d) != nil; i++ {
				time.Sleep(10 * time.Millisecond)
			}
		}
	})
	return fds, dirs
}

func TestFnRunCgroupUIDAndLeftovers(t *testing.T) {
	needRootFn(t)
	c := startAgent(t)
	fds, dirs := fnCgroups(t)
	box := openTempDir(t)
	ctx := context.Background()
	pidsMax, err := unix.Open(filepath.Join(dirs[1], "pids.max"), unix.O_WRONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(pidsMax)
	p, err := c.FnStart(ctx, FnRunRequest{
		Args: []string{"/bin/sh", "-c", "sleep 100 & sleep 100 & id -u; cat /proc/self/cgroup; cat"},
		Cwd:  box, UID: fnUID, GID: fnUID, Stdin: []byte("from stdin\n"),
		CgroupFDs: fds, Timeout: 10 * time.Second, PidsMaxFD: pidsMax, Pids: 7,
	})
	if err != nil {
		t.Fatal(err)
	}
	res, err := p.Wait()
	if err != nil {
		t.Fatal(err)
	}
	out := string(res.Stdout)
	if !strings.HasPrefix(out, fmt.Sprintf("%d\n", fnUID)) || !strings.HasSuffix(out, "from stdin\n") {
		t.Fatalf("stdout %q", out)
	}
	for _, d := range dirs {
		if !strings.Contains(out, "/"+filepath.Base(d)+"\n") {
			t.Errorf("process not in cgroup %s:\n%s", d, out)
		}
	}
	if res.Code != 0 || res.Leftover != 2 {
		t.Fatalf("code %d leftover %d, want 0 and 2", res.Code, res.Leftover)
	}
	if b, _ := os.ReadFile(filepath.Join(dirs[1], "pids.max")); strings.TrimSpace(string(b)) != "7" {
		t.Errorf("pids.max %q, want 7", b)
	}
	// Nothing of the run is left in its cgroups.
	for _, d := range dirs {
		b, _ := os.ReadFile(filepath.Join(d, "cgroup.procs"))
		if len(strings.TrimSpace(string(b))) != 0 {
			t.Errorf("%s still has tasks: %s", d, b)
		}
	}
}

func TestFnRunOutputLimitAndTimeout(t *testing.T) {
	needRootFn(t)
	c := startAgent(t)
	ctx := context.Background()
	p, err := c.FnStart(ctx, FnRunRequest{
		Args: []string{"/bin/sh", "-c", "yes; sleep 100"}, Cwd: "/", UID: fnUID, GID: fnUID,
		OutputLimit: 100000, Timeout: 10 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	res, err := p.Wait()
	if err != nil {
		t.Fatal(err)
	}
	if !res.StdoutOver || len(res.Stdout) != 100000 || res.Signal != "SIGKILL" {
		t.Fatalf("flood: over %v, %d bytes, signal %q", res.StdoutOver, len(res.Stdout), res.Signal)
	}
	p, err = c.FnStart(ctx, FnRunRequest{
		Args: []string{"/bin/sh", "-c", "echo err >&2; sleep 100"}, Cwd: "/", UID: fnUID, GID: fnUID,
		Timeout: 200 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	res, err = p.Wait()
	if err != nil {
		t.Fatal(err)
	}
	if !res.TimedOut || string(res.Stderr) != "err\n" || res.Wall < 200*time.Millisecond || res.Wall > 30*time.Second {
		t.Fatalf("timeout: %+v", res)
	}
}

func TestFnPrepare(t *testing.T) {
	needRootFn(t)
	c := startAgent(t)
	ctx := context.Background()
	base := openTempDir(t)
	box, tmp := filepath.Join(base, "box"), filepath.Join(base, "tmp")
	os.Mkdir(tmp, 0o1777)
	os.Chmod(tmp, 0o1777)
	// Left by an earlier call: files, a background process.
	os.MkdirAll(filepath.Join(box, "old", "deep"), 0o500)
	os.WriteFile(filepath.Join(tmp, "junk"), []byte("x"), 0o600)
	p, err := c.FnStart(ctx, FnRunRequest{Args: []string{"/bin/sh", "-c", "sleep 100 & echo started"}, Cwd: "/", UID: fnUID, GID: fnUID})
	if err != nil {
		t.Fatal(err)
	}
	p.Wait()
	res, err := c.FnPrepare(ctx, FnPrepareRequest{
		Box: box, Wipe: []string{tmp}, UID: fnUID, GID: fnUID,
		Files: []FnFile{{Path: "main.py", Data: []byte("print(1)\n")}, {Path: "data/in.txt", Mode: 0o600, Data: make([]byte, 200<<10)}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Removed != 2 || len(res.Dirty) != 0 {
		t.Fatalf("prepare: %+v", res)
	}
	for path, mode := range map[string]os.FileMode{"main.py": 0o644, "data/in.txt": 0o600} {
		fi, err := os.Stat(filepath.Join(box, path))
		if err != nil || fi.Mode().Perm() != mode {
			t.Fatalf("%s: %v %v", path, fi.Mode(), err)
		}
		if st := fi.Sys().(*syscall.Stat_t); st.Uid != fnUID {
			t.Fatalf("%s owned by %d", path, st.Uid)
		}
	}
	if fi, err := os.Stat(filepath.Join(box, "data/in.txt")); err != nil || fi.Size() != 200<<10 {
		t.Fatalf("data/in.txt: %v", err)
	}
	if _, err := os.Stat(filepath.Join(tmp, "junk")); !os.IsNotExist(err) {
		t.Fatalf("tmp not wiped: %v", err)
	}
	for _, bad := range []string{"../x", "/etc/passwd", "a//b", ""} {
		if _, err := c.FnPrepare(ctx, FnPrepareRequest{Box: box, UID: fnUID, GID: fnUID, Files: []FnFile{{Path: bad}}}); err == nil {
			t.Errorf("file path %q accepted", bad)
		}
	}
	if _, err := c.FnPrepare(ctx, FnPrepareRequest{Box: box, UID: 0, GID: 0}); err == nil {
		t.Error("uid 0 accepted")
	}
}

// openTempDir is a temporary directory the test uid can enter.
func openTempDir(t *testing.T) string {
	d, err := os.MkdirTemp("", "fntest")
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(d, 0o755)
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

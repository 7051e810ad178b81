package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

func TestExecOutputExitCodeStdin(t *testing.T) {
	need(t)
	id := create(t)
	stdout, stderr, code := run3(nil, "exec", id, "--", "sh", "-c", "echo out; echo err >&2; exit 3")
	if stdout != "out\n" || stderr != "err\n" || code != 3 {
		t.Fatalf("got stdout %q stderr %q code %d", stdout, stderr, code)
	}
	stdout, _, code = run3([]byte("hello stdin\n"), "exec", "-i", id, "--", "cat")
	if stdout != "hello stdin\n" || code != 0 {
		t.Fatalf("stdin: got %q code %d", stdout, code)
	}
	stdout, _, code = run3(nil, "exec", "--cwd", "/tmp", "--env", "FOO=bar", id, "--", "sh", "-c", "echo $PWD $FOO")
	if stdout != "/tmp bar\n" || code != 0 {
		t.Fatalf("cwd/env: got %q code %d", stdout, code)
	}
	// Killed by a signal: 128+9.
	_, _, code = run3(nil, "exec", id, "--", "sh", "-c", "kill -9 $$")
	if code != 137 {
		t.Fatalf("killed command: exit code %d, want 137", code)
	}
	// A missing program is a clear error, not a hang, with a shell's exit
	// codes: 127 not found (by path or in PATH), 126 not executable; a
	// missing working directory or sandbox is Shoal's own error (1).
	for _, c := range []struct {
		args []string
		code int
		says string
	}{
		{[]string{id, "--", "/no/such/program"}, 127, "not_found"},
		{[]string{id, "--", "no-such-program"}, 127, "not found in $PATH"},
		{[]string{id, "--", "/work"}, 126, "permission"},
		{[]string{"--cwd", "/no/such/dir", id, "--", "true"}, 1, "cwd /no/such/dir"},
		{[]string{"no-such-sandbox", "--", "true"}, 1, "not a sandbox ID"},
	} {
		out, code := run(nil, append([]string{"exec"}, c.args...)...)
		if code != c.code || !strings.Contains(out, c.says) {
			t.Errorf("exec %q: code %d output %q, want code %d and %q", c.args, code, out, c.code, c.says)
		}
	}
	// Large stdin is pumped, not inlined: 3 MiB through cat.
	big := bytes.Repeat([]byte("0123456789abcdef"), 3<<16)
	stdout, _, code = run3(big, "exec", "-i", id, "--", "cat")
	if code != 0 || stdout != string(big) {
		t.Fatalf("large stdin: code %d, got %d bytes want %d", code, len(stdout), len(big))
	}
	// Timeout kills the command.
	c := sdk(t)
	st, err := c.Exec(context.Background(), id, shoal.ExecOptions{Args: []string{"sleep", "30"}, Timeout: 300 * time.Millisecond})
	if err != nil || !st.TimedOut {
		t.Fatalf("timeout: %+v %v", st, err)
	}
}

func TestFileRoundTrip100MiB(t *testing.T) {
	need(t)
	id := create(t)
	c := sdk(t)
	ctx := context.Background()
	src := make([]byte, 100<<20)
	rand.Read(src)
	n, err := c.WriteFile(ctx, id, "/work/big.bin", 0o600, bytes.NewReader(src))
	if err != nil || n != int64(len(src)) {
		t.Fatalf("write: %d %v", n, err)
	}
	h := sha256.New()
	n, err = c.ReadFile(ctx, id, "/work/big.bin", h)
	if err != nil || n != int64(len(src)) {
		t.Fatalf("read: %d %v", n, err)
	}
	want := sha256.Sum256(src)
	if !bytes.Equal(h.Sum(nil), want[:]) {
		t.Fatal("content differs after round trip")
	}
	// The command sees the same file.
	stdout, _, _ := run3(nil, "exec", id, "--", "sh", "-c", "wc -c < /work/big.bin")
	if strings.TrimSpace(stdout) != strconv.Itoa(len(src)) {
		t.Fatalf("size inside: %q", stdout)
	}
	// CLI cp both ways.
	local := filepath.Join(t.TempDir(), "f.txt")
	os.WriteFile(local, []byte("via cp\n"), 0o640)
	if out, code := run(nil, "cp", local, id+":/work/f.txt"); code != 0 {
		t.Fatalf("cp in: %s", out)
	}
	if stdout, _, code := run3(nil, "cp", id+":/work/f.txt", "-"); code != 0 || stdout != "via cp\n" {
		t.Fatalf("cp out: %q %d", stdout, code)
	}
	// Metadata calls.
	fi, err := c.Sandboxes.StatFile(ctx, connect.NewRequest(&pb.StatFileRequest{SandboxId: id, Path: "/work/f.txt"}))
	if err != nil || fi.Msg.Size != 7 || fi.Msg.Mode != 0o640 {
		t.Fatalf("stat: %v %v", fi, err)
	}
	if _, err := c.Sandboxes.MakeDir(ctx, connect.NewRequest(&pb.MakeDirRequest{SandboxId: id, Path: "/work/a/b"})); err != nil {
		t.Fatal(err)
	}
	ls, err := c.Sandboxes.ListDir(ctx, connect.NewRequest(&pb.ListDirRequest{SandboxId: id, Path: "/work"}))
	if err != nil {
		t.Fatal(err)
	}
	names := []string{}
	for _, e := range ls.Msg.Entries {
		names = append(names, e.Name)
	}
	if strings.Join(names, ",") != "a,big.bin,f.txt" {
		t.Fatalf("list: %v", names)
	}
	if _, err := c.Sandboxes.RemoveFile(ctx, connect.NewRequest(&pb.RemoveFileRequest{SandboxId: id, Path: "/work/a", Recursive: true})); err != nil {
		t.Fatal(err)
	}
	_, err = c.Sandboxes.StatFile(ctx, connect.NewRequest(&pb.StatFileRequest{SandboxId: id, Path: "/work/a"}))
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("stat removed dir: %v", err)
	}
}

func TestPathEscapesRefused(t *testing.T) {
	need(t)
	id := create(t)
	c := sdk(t)
	ctx := context.Background()
	// A host file that must never be reachable from the sandbox.
	secret := filepath.Join(t.TempDir(), "host-secret")
	os.WriteFile(secret, []byte("HOST SECRET"), 0o600)

	for _, p := range []string{"/../../../../" + secret, "/work/../../etc/passwd", "relative/path", ""} {
		_, err := c.ReadFile(ctx, id, p, io.Discard)
		if connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("read %q: want invalid_argument, got %v", p, err)
		}
		_, err = c.WriteFile(ctx, id, p, 0o644, strings.NewReader("x"))
		if connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("write %q: want invalid_argument, got %v", p, err)
		}
	}
	// Symlinks made inside the sandbox resolve inside the sandbox's root.
	run(nil, "exec", id, "--", "ln", "-s", "/../../../.."+secret, "/work/escape")
	run(nil, "exec", id, "--", "ln", "-s", "/etc/hostname", "/work/host")
	var buf bytes.Buffer
	_, err := c.ReadFile(ctx, id, "/work/escape", &buf)
	if connect.CodeOf(err) != connect.CodeNotFound || strings.Contains(buf.String(), "SECRET") {
		t.Fatalf("symlink escape: got %q, %v", buf.String(), err)
	}
	buf.Reset()
	if _, err := c.ReadFile(ctx, id, "/work/host", &buf); err != nil || buf.String() != "layer-hostname\n" {
		t.Fatalf("symlink inside sandbox: got %q, %v", buf.String(), err)
	}
	// Writing through a symlink lands inside the sandbox, never on the host.
	if _, err := c.WriteFile(ctx, id, "/work/escape", 0o644, strings.NewReader("overwritten")); err != nil {
		t.Logf("write through escaping symlink: %v", err)
	}
	if b, _ := os.ReadFile(secret); string(b) != "HOST SECRET" {
		t.Fatalf("host file changed: %q", b)
	}
}

func TestMemoryLimitKillsHog(t *testing.T) {
	need(t)
	id := create(t, "--memory", "64M")
	stdout, _, code := run3(nil, "exec", id, "--", "hog", "256")
	if code != 137 {
		t.Fatalf("hog exit code %d, want 137 (SIGKILL by the OOM killer); output tail %q", code, tail(stdout))
	}
	lines := strings.Fields(stdout)
	if len(lines) == 0 {
		t.Fatal("hog printed nothing")
	}
	last, _ := strconv.Atoi(lines[len(lines)-1])
	if last > 64 {
		t.Fatalf("hog got %d MiB with a 64 MiB limit", last)
	}
	// The sandbox survives its command's OOM kill.
	if out, code := run(nil, "exec", id, "--", "true"); code != 0 {
		t.Fatalf("sandbox unusable after OOM: %s", out)
	}
	// And a hog under the limit completes.
	if out, code := run(nil, "exec", id, "--", "hog", "16"); code != 0 || !strings.Contains(out, "done") {
		t.Fatalf("small hog: %d %s", code, tail(out))
	}
}

func tail(s string) string {
	if len(s) > 200 {
		return s[len(s)-200:]
	}
	return s
}

func TestForkBombStoppedByPidsLimit(t *testing.T) {
	need(t)
	id := create(t)
	c := sdk(t)
	var out bytes.Buffer
	start := time.Now()
	st, err := c.Exec(context.Background(), id, shoal.ExecOptions{
		// The leader stays (a busy loop needs no fork) so that the timeout
		// kills its whole process group, bomb included. Its one fork comes
		// before any bombing: had it forked the pipeline's members itself,
		// its second fork could meet the full pids limit and end the command
		// (exit 2) before its timeout, leaving the bomb behind.
		Args:    []string{"sh", "-c", "(bomb() { bomb | bomb & }; bomb) & while :; do :; done"},
		Stdout:  &out,
		Stderr:  &out,
		Timeout: 5 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	if !st.TimedOut {
		t.Errorf("the bomb's command was not killed by its timeout: %+v", st)
	}
	// The agent's kill is not starved by the bomb (its threads run above
	// its commands': agent.AgentNice); how long it took is logged.
	t.Logf("fork bomb: %+v after %v (timeout 5s), output tail %q", st, time.Since(start).Round(time.Millisecond), tail(out.String()))
	pids := cgroupValue(t, "pids", runcID(t, id), "pids.max")
	if pids != "1024" {
		t.Fatalf("pids.max = %q", pids)
	}
	if !strings.Contains(out.String(), "Resource temporarily unavailable") && !strings.Contains(out.String(), "can't fork") {
		t.Errorf("expected fork failures in the output")
	}
	// The host is fine and the sandbox answers once the bomb is gone (its
	// processes are killed, then reaped: wait for the pids cgroup to hold
	// little more than the agent's own threads).
	deadline := time.Now().Add(30 * time.Second)
	for {
		n, _ := strconv.Atoi(cgroupValue(t, "pids", runcID(t, id), "pids.current"))
		if n < 64 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d tasks left in the sandbox 30s after the bomb's timeout", n)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if o, code := run(nil, "exec", id, "--", "echo", "alive"); code != 0 || !strings.Contains(o, "alive") {
		t.Fatalf("sandbox after fork bomb: %d %s", code, o)
	}
}

// runcID returns the runc container ID of a sandbox, which names its
// cgroups (/sys/fs/cgroup/CTRL/shoal/RUNC_ID): the sandbox ID for a sandbox
// created cold, the ID of the pool container it was claimed from for one
// created from the container backend's warm pool (the backend keeps it in
// DATA/pool/claimed/<sandbox id>/runc-id).
func runcID(t *testing.T, id string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dataDir, "pool", "claimed", id, "runc-id"))
	if err != nil {
		return id
	}
	return strings.TrimSpace(string(b))
}

// upperOf is where a sandbox's writable layer is on the host (in its dir,
// on its disk image, or on the disk its pool container brought).
func upperOf(t *testing.T, id string) string {
	t.Helper()
	sb, err := sdk(t).Get(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	if u := sb.Runtime["upper"]; u != "" {
		return u
	}
	return filepath.Join(dataDir, "sandboxes", id, "upper")
}

// pooled reports whether a sandbox was created from the warm pool.
func pooled(id string) bool {
	_, err := os.Stat(filepath.Join(dataDir, "pool", "claimed", id))
	return err == nil
}

// sandboxProcs lists the host PIDs in a sandbox's cgroup (its agent and
// commands).
func sandboxProcs(t *testing.T, id string) []string {
	t.Helper()
	b, _ := os.ReadFile(filepath.Join("/sys/fs/cgroup/pids/shoal", runcID(t, id), "cgroup.procs"))
	return strings.Fields(string(b))
}

// cgroupValue reads a v1 cgroup file of a container (see runcID).
func cgroupValue(t *testing.T, ctrl, runcID, file string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("/sys/fs/cgroup", ctrl, "shoal", runcID, file))
	if err != nil {
		t.Fatalf("read cgroup: %v", err)
	}
	return strings.TrimSpace(string(b))
}

func TestNoNetworkByDefault(t *testing.T) {
	need(t)
	id := create(t)
	stdout, _, _ := run3(nil, "exec", id, "--", "cat", "/proc/net/dev")
	var ifaces []string
	for _, line := range strings.Split(stdout, "\n") {
		if name, _, ok := strings.Cut(line, ":"); ok {
			ifaces = append(ifaces, strings.TrimSpace(name))
		}
	}
	if strings.Join(ifaces, ",") != "lo" {
		t.Fatalf("interfaces %v, want only lo", ifaces)
	}
	stdout, _, _ = run3(nil, "exec", id, "--", "cat", "/proc/net/route")
	if strings.Count(strings.TrimSpace(stdout), "\n") != 0 {
		t.Fatalf("routes present: %q", stdout)
	}
	// Loopback works inside.
	stdout, _, code := run3(nil, "exec", id, "--", "sh", "-c", "nc -l -p 8080 -e echo pong & i=0; until out=$(nc 127.0.0.1 8080 </dev/null) && [ -n \"$out\" ]; do i=$((i+1)); [ $i -gt 400 ] && exit 1; sleep 0.05; done; echo \"$out\"")
	if code != 0 || !strings.Contains(stdout, "pong") {
		t.Fatalf("loopback: %d %q", code, stdout)
	}
}

func TestDeleteLeavesNothing(t *testing.T) {
	need(t)
	id := create(t)
	if _, code := run(nil, "exec", id, "--", "sh", "-c", "sleep 1000 & echo started"); code != 0 {
		t.Fatal("exec")
	}
	dir := filepath.Join(dataDir, "sandboxes", id)
	rid := runcID(t, id)
	t.Logf("sandbox %s: pooled %v, runc container %s", id, pooled(id), rid)
	if pooled(id) {
		// Its root is mounted in the sandbox's mount namespace only: an
		// overlay, whose options name no host path (its directories are
		// given to overlayfs as /proc/self/fd/N).
		procs := sandboxProcs(t, id)
		if len(procs) == 0 {
			t.Fatal("no process in the sandbox's cgroup")
		}
		mi, _ := os.ReadFile(filepath.Join("/proc", procs[0], "mountinfo"))
		root := ""
		for _, line := range strings.Split(string(mi), "\n") {
			if f := strings.Fields(line); len(f) > 4 && f[4] == "/" {
				root = line
			}
		}
		if !strings.Contains(root, " - overlay ") || !strings.Contains(root, "upperdir=/proc/self/fd/") {
			t.Fatalf("the sandbox's root is not its overlay:\n%s", mi)
		}
		if strings.Contains(string(mi), dataDir) {
			t.Fatalf("the sandbox's mountinfo shows the data dir %s:\n%s", dataDir, mi)
		}
	} else if len(mountsUnder(dir)) == 0 {
		t.Fatal("no rootfs mount while running")
	}
	// A create in flight keeps the reaper waiting: the delete's answer
	// finds the sandbox frozen, its teardown still to come.
	hold := make(chan struct{})
	held := make(chan struct{})
	first := make(chan struct{})
	go func() {
		defer close(held)
		for i := 0; ; i++ {
			if i == 1 {
				close(first)
			}
			select {
			case <-hold:
				return
			default:
			}
			if out, _, code := run3(nil, "create", "--base", baseRef); code == 0 {
				run(nil, "rm", strings.TrimSpace(out))
			}
		}
	}()
	<-first
	if out, code := run(nil, "rm", id); code != 0 {
		t.Fatalf("rm: %s", out)
	}
	// (On a host slow enough for the creates to leave the reaper 250 ms,
	// its teardown may have begun, which thaws it to kill it: then it is
	// gone soon. internal/node's tests check the order.)
	freezer := filepath.Join("/sys/fs/cgroup/freezer/shoal", rid, "freezer.state")
	if st, err := os.ReadFile(freezer); err != nil {
		t.Logf("the teardown began before the check: %v", err)
	} else if strings.TrimSpace(string(st)) != "FROZEN" {
		time.Sleep(5 * time.Second)
		if st, err := os.ReadFile(freezer); err == nil && strings.TrimSpace(string(st)) != "FROZEN" {
			t.Errorf("a deleted sandbox is %s 5 s after its delete answered, want FROZEN or torn down", st)
		}
	}
	close(hold)
	<-held
	// Then the reaper tears it down: nothing is left.
	var left []string
	eventually(teardownTimeout, func() bool {
		left = nil
		if m := mountsUnder(dir); len(m) != 0 {
			left = append(left, "mounts left: "+strings.Join(m, ", "))
		}
		for _, ctrl := range []string{"memory", "pids", "cpu", "freezer", "devices", "blkio", "cpuset"} {
			if _, err := os.Stat(filepath.Join("/sys/fs/cgroup", ctrl, "shoal", rid)); err == nil {
				left = append(left, "cgroup "+ctrl+" left")
			}
		}
		if _, err := os.Stat(filepath.Join(dataDir, "pool", "claimed", id)); err == nil {
			left = append(left, "pool container dir left")
		}
		if _, err := os.Stat(dir); err == nil {
			left = append(left, "sandbox dir left")
		}
		out, _ := exec.Command("runc", "--root", filepath.Join(dataDir, "runc"), "state", rid).CombinedOutput()
		if !strings.Contains(string(out), "does not exist") {
			left = append(left, "runc still knows the container: "+string(out))
		}
		return len(left) == 0
	})
	for _, l := range left {
		t.Error(l)
	}
	if procs := processesWithEnv("SHOAL_SANDBOX_ID=" + id); len(procs) > 0 {
		t.Errorf("processes left: %v", procs)
	}
	if out, code := run(nil, "inspect", id); code == 0 || !strings.Contains(out, "not_found") {
		t.Errorf("inspect after rm: %d %s", code, out)
	}
	// No layer mount is left once no sandbox uses it (other tests may run
	// sandboxes concurrently, so only check when none is left).
	if sbs, _ := sdk(t).List(context.Background()); len(sbs) == 0 {
		mnt := filepath.Join(dataDir, "layers", "mnt")
		if !eventually(teardownTimeout, func() bool { return len(mountsUnder(mnt)) == 0 }) {
			t.Errorf("layer mounts left: %v", mountsUnder(mnt))
		}
	}
}

// processesWithEnv lists host PIDs whose environment contains kv.
func processesWithEnv(kv string) []string {
	var out []string
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "environ"))
		if err == nil && bytes.Contains(b, []byte(kv+"\x00")) {
			out = append(out, e.Name())
		}
	}
	return out
}

func TestServeKilledAndRestartedKeepsSandboxes(t *testing.T) {
	need(t)
	id := create(t)
	if out, code := run(nil, "exec", id, "--", "sh", "-c", "echo before > /work/state"); code != 0 {
		t.Fatal(out)
	}
	killServe()
	// The sandbox keeps running without shoal serve.
	if procs := sandboxProcs(t, id); len(procs) == 0 {
		t.Fatal("the sandbox died with shoal serve")
	}
	if err := startServe(); err != nil {
		t.Fatal(err)
	}
	stdout, _, code := run3(nil, "exec", id, "--", "cat", "/work/state")
	if code != 0 || stdout != "before\n" {
		t.Fatalf("after restart: %d %q", code, stdout)
	}
	out, _ := run(nil, "ls")
	if !strings.Contains(out, id) || !strings.Contains(out, "running") {
		t.Fatalf("ls after restart: %s", out)
	}
	// Its layer mounts were adopted, not duplicated.
	n := 0
	for _, m := range mountsUnder(filepath.Join(dataDir, "layers", "mnt")) {
		_ = m
		n++
	}
	if n != 1 {
		t.Errorf("%d layer mounts after restart, want 1", n)
	}
}

func TestIdleTimeoutDeletes(t *testing.T) {
	need(t)
	// Activity pushes the deadline back: an exec that starts at t0 leaves
	// the sandbox expiring no earlier than t0 + its timeout. (Checked on
	// the deadline itself, not by sleeping near it: a loaded host may take
	// longer than any margin to run the exec.)
	id := create(t, "--timeout", "60s")
	c := sdk(t)
	t0 := time.Now()
	if _, code := run(nil, "exec", id, "--", "true"); code != 0 {
		t.Fatalf("exec: %d", code)
	}
	sb, err := c.Get(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	if exp := sb.ExpiresAt.AsTime(); exp.Before(t0.Add(60 * time.Second).Truncate(time.Second)) {
		t.Fatalf("expires at %v after an exec at %v with a 60s timeout", exp, t0)
	}
	// SetTimeout restarts the clock: deleted once idle that long.
	if _, err := c.SetTimeout(context.Background(), id, 2*time.Second); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if _, err := c.Get(context.Background(), id); connect.CodeOf(err) == connect.CodeNotFound {
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Fatal("sandbox not deleted after its idle timeout")
}

func TestBadInputClearErrors(t *testing.T) {
	need(t)
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"create", "--base", "nosuch:1"}, "not_found"},
		// No version: an image (docker.io/library/nosuch:latest), which the
		// CLI pulls: the error names it (not_found from a registry,
		// unavailable where none can be reached).
		{[]string{"create", "--base", "nosuch"}, "pull nosuch"},
		{[]string{"create", "--base", baseRef, "--memory", "1M"}, "memory"},
		{[]string{"create", "--base", baseRef, "--cpus", "64"}, "cpus"},
		{[]string{"create", "--base", baseRef, "--backend", "quantum"}, "backend"},
		{[]string{"create", "--base", baseRef, "--workspace", baseRef}, "not a workspace"},
		{[]string{"create", "--base", baseRef, "--timeout", "1000h"}, "timeout"},
		{[]string{"exec", "aaaaaaaaaaaaaaaaaaaa", "--", "true"}, "not_found"},
		{[]string{"inspect", "../../etc"}, "not_found"},
		{[]string{"rm", "aaaaaaaaaaaaaaaaaaaa"}, "not_found"},
		{[]string{"layer", "build", "--kind", "base", "x:1", "/nonexistent"}, "nonexistent"},
		{[]string{"layer", "build", "--kind", "basement", "x:1", "/tmp"}, "--kind"},
	}
	for _, tc := range cases {
		out, code := run(nil, tc.args...)
		if code == 0 || !strings.Contains(out, tc.want) {
			t.Errorf("%v: code %d, output %q (want it to mention %q)", tc.args, code, out, tc.want)
		}
	}
	// No leftovers from the failed creates.
	if sbs, _ := sdk(t).List(context.Background()); len(sbs) > 0 {
		for _, sb := range sbs {
			if sb.State != pb.SandboxState_SANDBOX_STATE_RUNNING {
				t.Errorf("leftover sandbox %s in state %s", sb.Id, sb.State)
			}
		}
	}
	// Authentication on every call but /healthz.
	for _, key := range []string{"", "wrong-key"} {
		req, _ := http.NewRequest("POST", apiURL+"/shoal.v1.SandboxService/ListSandboxes", strings.NewReader("{}"))
		req.Header.Set("Content-Type", "application/json")
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		if res.StatusCode != http.StatusUnauthorized {
			t.Errorf("key %q: status %d, want 401", key, res.StatusCode)
		}
	}
	// Malformed JSON gets invalid_argument.
	req, _ := http.NewRequest("POST", apiURL+"/shoal.v1.SandboxService/CreateSandbox", strings.NewReader("{not json"))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+apiKey)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), "invalid_argument") {
		t.Errorf("malformed JSON: %d %s", res.StatusCode, body)
	}
	var ce *connect.Error
	_, err = sdk(t).Get(context.Background(), "zzzzzzzzzzzzzzzzzzzz")
	if !errors.As(err, &ce) || ce.Code() != connect.CodeNotFound || !strings.Contains(ce.Message(), "zzzzzzzzzzzzzzzzzzzz") {
		t.Errorf("unknown id: %v", err)
	}
}

func TestDeadAgentMarksSandboxError(t *testing.T) {
	need(t)
	id := create(t)
	c := sdk(t)
	sb, err := c.Get(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	state := readInitState(t, sb.Runtime["runc_id"])
	var st struct {
		Pid int `json:"init_process_pid"`
	}
	if err := json.Unmarshal(state, &st); err != nil || st.Pid <= 0 {
		t.Fatalf("runc state: %v %d", err, st.Pid)
	}
	// The sandbox's init (the guest agent) dies.
	syscall.Kill(st.Pid, syscall.SIGKILL)
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		sb, err = c.Get(context.Background(), id)
		if err == nil && sb.State == pb.SandboxState_SANDBOX_STATE_ERROR {
			break
		}
		time.Sleep(250 * time.Millisecond)
	}
	if sb.State != pb.SandboxState_SANDBOX_STATE_ERROR || !strings.Contains(sb.Error, "guest agent") {
		t.Fatalf("after the agent died: state %s error %q", sb.State, sb.Error)
	}
	if out, code := run(nil, "exec", id, "--", "true"); code == 0 || !strings.Contains(out, "failed_precondition") {
		t.Fatalf("exec in a dead sandbox: %d %s", code, out)
	}
	if out, code := run(nil, "rm", id); code != 0 {
		t.Fatalf("rm of a dead sandbox: %s", out)
	}
	if dir := filepath.Join(dataDir, "sandboxes", id); !eventually(teardownTimeout, func() bool { return len(mountsUnder(dir)) == 0 }) {
		t.Errorf("mounts left: %v", mountsUnder(dir))
	}
}

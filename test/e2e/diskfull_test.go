package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// TestDataDiskFull: the node's data disk fills up (a serve of its own whose
// data dir is a small file system) while a command streams its output. serve
// keeps serving (/healthz, reads), a create that needs room fails with an
// error instead of hanging, the command's output waits in its sandbox
// (the node takes back the partial record and retries; nothing more is
// received, so the agent keeps it), and once there is room again every
// byte is in the command's log, in order: nothing is lost. (The node used
// to kill the command and mark it lost at the first ENOSPC.)
func TestDataDiskFull(t *testing.T) {
	need(t)
	// A small file system of its own: ext4 on a loop device (EROFS layers
	// are mounted from their image files, which tmpfs cannot back).
	data, img := t.TempDir(), filepath.Join(t.TempDir(), "data.img")
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", img, "96M").CombinedOutput(); err != nil {
		t.Skipf("mkfs.ext4: %v %s", err, out)
	}
	if out, err := exec.Command("mount", "-o", "loop", img, data).CombinedOutput(); err != nil {
		t.Skipf("cannot loop-mount a file system: %v %s", err, out)
	}
	t.Cleanup(func() {
		unmountUnder(data)
		exec.Command("umount", "-l", data).Run()
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	url := "http://" + addr
	// serve's log, in a file (a buffer would be written by exec's copying
	// goroutine while the test reads it).
	logPath := filepath.Join(t.TempDir(), "serve.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	slog := func() string { b, _ := os.ReadFile(logPath); return string(b) }
	// No disk budget: "auto" on a 96 MiB file system admits nothing (a
	// sandbox's log budget counts in it), and admission is not what this
	// test is about; the disk filling up under a running command is.
	serve := exec.Command(filepath.Join(binDir, "shoal"), "serve", "--data", data, "--listen", addr, "--e2b-listen=",
		"--egress-subnet=", "--default-disk", "none", "--disk-budget", "none", "--pool-size", "0")
	serve.Stdout, serve.Stderr = logFile, logFile
	if err := serve.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Its sandboxes go with it: delete them, then stop it.
		if key, err := os.ReadFile(filepath.Join(data, "admin.key")); err == nil {
			if c, err := shoal.New(shoal.Options{URL: url, APIKey: strings.TrimSpace(string(key))}); err == nil {
				if sbs, err := c.List(context.Background()); err == nil {
					for _, sb := range sbs {
						c.Delete(context.Background(), sb.Id)
					}
				}
			}
		}
		serve.Process.Signal(syscall.SIGTERM)
		serve.Wait()
		if t.Failed() {
			t.Logf("serve's log:\n%s", slog())
		}
	})
	healthy := func() bool {
		res, err := http.Get(url + "/healthz")
		if err != nil {
			return false
		}
		res.Body.Close()
		return res.StatusCode == http.StatusOK
	}
	deadline := time.Now().Add(2 * time.Minute)
	for !healthy() {
		if time.Now().After(deadline) {
			t.Fatalf("serve did not start:\n%s", slog())
		}
		time.Sleep(50 * time.Millisecond)
	}
	key, err := os.ReadFile(filepath.Join(data, "admin.key"))
	if err != nil {
		t.Fatal(err)
	}
	c, err := shoal.New(shoal.Options{URL: url, APIKey: strings.TrimSpace(string(key))})
	if err != nil {
		t.Fatal(err)
	}
	rootfs, err := busyboxRootfs()
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(rootfs)
	cli := func(args ...string) (string, int) {
		cmd := exec.Command(filepath.Join(binDir, "shoal"), args...)
		cmd.Env = append(os.Environ(), "SHOAL_URL="+url, "SHOAL_API_KEY="+strings.TrimSpace(string(key)))
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return string(out), ee.ExitCode()
		}
		return string(out), 0
	}
	if out, code := cli("layer", "build", "--kind", "base", "full:1", rootfs); code != 0 {
		t.Fatalf("layer build: %s", out)
	}
	ctx := context.Background()
	sb, err := c.Create(ctx, &pb.CreateSandboxRequest{Base: "full:1"})
	if err != nil {
		t.Fatal(err)
	}
	// ~1.3 MB of output, starting once the disk is full (the command waits
	// for the host to say so through a file in /dev/shm, its own tmpfs).
	const lines = 200000
	cm, err := c.Start(ctx, &pb.ExecRequest{SandboxId: sb.Id, Args: []string{"sh", "-c",
		"while [ ! -e /dev/shm/go ]; do sleep 0.05; done; seq 1 " + fmt.Sprint(lines)}})
	if err != nil {
		t.Fatal(err)
	}
	// Fill the data disk.
	filler := filepath.Join(data, "filler")
	f, err := os.Create(filler)
	if err != nil {
		t.Fatal(err)
	}
	chunk := make([]byte, 1<<20)
	for {
		if _, err := f.Write(chunk); err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatal(err)
			}
			break
		}
	}
	// Fill the last partial pages too.
	for _, n := range []int{64 << 10, 4 << 10, 512, 1} {
		for {
			if _, err := f.Write(chunk[:n]); err != nil {
				break
			}
		}
	}
	f.Close()
	// Start the output: a file written in the sandbox's /dev/shm (its own
	// tmpfs, not the host's full disk) by the agent.
	var none bytes.Buffer
	if _, err := c.WriteFile(ctx, sb.Id, "/dev/shm/go", 0o644, &none); err != nil {
		t.Fatalf("write the go file: %v", err)
	}
	// While the disk is full: serve answers, a create fails (not hangs).
	if !healthy() {
		t.Fatal("serve does not answer /healthz while its disk is full")
	}
	if _, err := c.Get(ctx, sb.Id); err != nil {
		t.Fatalf("get while the disk is full: %v", err)
	}
	cctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	if sb2, err := c.Create(cctx, &pb.CreateSandboxRequest{Base: "full:1"}); err == nil {
		t.Logf("a create succeeded while the disk was full (%s): it needed no room", sb2.Id)
	} else if cctx.Err() != nil {
		t.Fatalf("a create hung while the disk was full: %v", err)
	} else {
		t.Logf("create while the disk is full: %v", err)
	}
	cancel()
	// Let the command produce for a while into a full disk, then make room.
	time.Sleep(time.Second)
	if got, err := c.Commands.GetCommand(ctx, connectReq(&pb.GetCommandRequest{SandboxId: sb.Id, CommandId: cm.Id})); err != nil {
		t.Fatalf("get command while the disk is full: %v", err)
	} else if got.Msg.State == pb.CommandState_COMMAND_STATE_LOST {
		t.Fatalf("the command was lost when the disk filled: %v", got.Msg)
	}
	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	actx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	st, err := c.Attach(actx, sb.Id, cm.Id, 0, &out, &out)
	if err != nil {
		t.Fatalf("attach after making room: %v", err)
	}
	if st.Code != 0 {
		t.Fatalf("command exit %d", st.Code)
	}
	var want strings.Builder
	for i := 1; i <= lines; i++ {
		fmt.Fprintf(&want, "%d\n", i)
	}
	if out.String() != want.String() {
		got := out.String()
		var again bytes.Buffer
		st2, err2 := c.Attach(actx, sb.Id, cm.Id, 0, &again, &again)
		t.Fatalf("the command's log has %d bytes, want %d (first difference at byte %d); exit %+v; attached again: %d bytes, %+v, %v",
			len(got), want.Len(), firstDiff(got, want.String()), st, again.Len(), st2, err2)
	}
	if !strings.Contains(slog(), "the host's disk is full") {
		t.Error("the disk never filled under the command's log (the test did not test it)")
	}
}

func firstDiff(a, b string) int {
	for i := 0; i < len(a) && i < len(b); i++ {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// TestLogBudget is issue 45's scenario scaled down: a sandbox with a 64 MiB
// disk (a log budget of a quarter of it by default) runs 6 commands that
// print 24 MiB each. The host keeps at most the budget of their output;
// the oldest command's output is gone, and re-attaching to it says so and
// names the offset to go on from; another sandbox's output is whole.
func TestLogBudget(t *testing.T) {
	need(t)
	other := create(t)
	if out, code := run(nil, "exec", other, "--", "echo", "mine"); code != 0 || out != "mine\n" {
		t.Fatalf("other sandbox: %d %q", code, out)
	}
	id := create(t, "--disk", "64M")
	const budget = 16 << 20
	var cmds []string
	for i := range 6 {
		out, code := run(nil, "exec", "-d", id, "--", "sh", "-c", fmt.Sprintf("head -c %d /dev/zero | tr '\\0' x; echo end-%d", 24<<20, i))
		if code != 0 {
			t.Fatalf("exec -d: %s", out)
		}
		cid := strings.TrimSpace(out)
		cmds = append(cmds, cid)
		// One after the other, as a trajectory's steps.
		waitFor(t, 2*time.Minute, "the command's exit", func() bool {
			out, _ := run(nil, "ps", id)
			for _, l := range strings.Split(out, "\n") {
				if f := strings.Fields(l); len(f) > 2 && f[0] == cid {
					return f[2] == "exited"
				}
			}
			return false
		})
	}
	var held int64
	logs := filepath.Join(dataDir, "sandboxes", id, "logs")
	ents, err := os.ReadDir(logs)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		var st syscall.Stat_t
		if err := syscall.Stat(filepath.Join(logs, e.Name()), &st); err != nil {
			t.Fatal(err)
		}
		held += st.Blocks * 512
	}
	t.Logf("6 commands of 24 MiB: %d bytes of logs on the host (budget %d)", held, budget)
	if held > budget+1<<20 {
		t.Errorf("the host holds %d bytes of the sandbox's logs, budget %d", held, budget)
	}
	stdout, stderr, code := run3(nil, "attach", id, cmds[0])
	if code == 0 || stdout != "" || !strings.Contains(stderr, "pruned") || !strings.Contains(stderr, "re-attach from offset") {
		t.Fatalf("attach to the oldest command: exit %d, %d bytes, %q", code, len(stdout), stderr)
	}
	// The newest command's head went too (it alone printed more than the
	// budget); its tail is there, from the offset the refusal names.
	_, stderr, code = run3(nil, "attach", id, cmds[5])
	m := regexp.MustCompile(`re-attach from offset (\d+)`).FindStringSubmatch(stderr)
	if code == 0 || m == nil {
		t.Fatalf("attach to the newest command from 0: exit %d, %q", code, stderr)
	}
	stdout, stderr, code = run3(nil, "attach", "--offset", m[1], id, cmds[5])
	if code != 0 || !strings.HasSuffix(stdout, "xxxend-5\n") || len(stdout) > budget {
		t.Fatalf("attach to the newest command from %s: exit %d, %d bytes, %q", m[1], code, len(stdout), stderr)
	}
	if out, code := run(nil, "exec", other, "--", "echo", "still"); code != 0 || out != "still\n" {
		t.Fatalf("other sandbox after: %d %q", code, out)
	}
}

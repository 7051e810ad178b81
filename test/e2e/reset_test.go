package e2e

import (
	"context"
	"errors"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// TestReset: `shoal reset` brings a sandbox back to its start in place:
// none of the old state is visible after (files in its writable layer,
// /tmp, /dev/shm, a deleted file of its layers, SysV IPC objects,
// listening sockets, processes, a shell's environment), its durable
// commands end with the reason "reset", and it is the same sandbox (ID,
// container, host name, limits) with a working agent. Run on a sandbox
// with a disk image of its own too, and reset twice.
func TestReset(t *testing.T) {
	need(t)
	for _, tc := range []struct {
		name  string
		extra []string
	}{
		{"plain", nil},
		{"disk", []string{"--disk", "64M"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id := create(t, append([]string{"--memory", "96M"}, tc.extra...)...)
			c := sdk(t)
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			before, err := c.Get(ctx, id)
			if err != nil {
				t.Fatal(err)
			}
			fresh := map[string]string{
				"env":      sh(t, id, "env | sort"),
				"hostname": sh(t, id, "uname -n"),
				"hosts":    sh(t, id, "cat /etc/hosts 2>&1; true"),
				"work":     sh(t, id, "ls -A /work"),
				"tmp":      sh(t, id, "ls -A /tmp"),
				"shm":      sh(t, id, "ls -A /dev/shm"),
				"etc":      sh(t, id, "cat /etc/hostname"),
				"ipc":      sh(t, id, "cat /proc/sysvipc/shm /proc/sysvipc/sem /proc/sysvipc/msg"),
			}

			for r := 1; r <= 2; r++ {
				// The state a rollout leaves.
				sh(t, id, "echo f > /work/f; mkdir -p /work/d/e; echo t > /tmp/t; echo s > /dev/shm/s; rm /etc/hostname")
				if out := sh(t, id, "sysvipc"); len(strings.Fields(out)) != 3 {
					t.Fatalf("sysvipc: %q", out)
				}
				if out := sh(t, id, "cat /proc/sysvipc/shm /proc/sysvipc/sem /proc/sysvipc/msg"); out == fresh["ipc"] {
					t.Fatalf("sysvipc made no object: %q", out)
				}
				startInSandbox(t, id, "portsrv", "tcp", "127.0.0.1:7070")
				waitFor(t, 10*time.Second, "portsrv listening", func() bool {
					out, _ := run(nil, "exec", id, "--", "cat", "/proc/net/tcp")
					return strings.Contains(out, ":1B9E 00000000:0000 0A")
				})
				cmd, err := c.Start(ctx, &pb.ExecRequest{SandboxId: id, Args: []string{"sleep", "1000"}})
				if err != nil {
					t.Fatal(err)
				}
				if out, code := run(nil, "shell", "create", id, "main"); code != 0 {
					t.Fatalf("shell create: %s", out)
				}
				if out, code := run(nil, "shell", "run", id, "main", "--", "export FOO=bar"); code != 0 {
					t.Fatalf("shell run: %s", out)
				}
				oldUpper := upperOf(t, id)

				out := shoalOK(t, "reset", id)
				if !strings.Contains(out, id+" reset in ") {
					t.Fatalf("shoal reset said %q", out)
				}

				// The durable command ended with the reason "reset".
				_, err = c.Attach(ctx, id, cmd.Id, 0, io.Discard, io.Discard)
				var ce *connect.Error
				if !errors.Is(err, shoal.ErrCommandReset) || !errors.As(err, &ce) || ce.Code() != connect.CodeFailedPrecondition || ce.Meta().Get("Shoal-Error-Reason") != "sandbox_reset" {
					t.Fatalf("attach to a command closed by a reset: %v, want failed_precondition with reason sandbox_reset", err)
				}
				res, err := c.Commands.GetCommand(ctx, connect.NewRequest(&pb.GetCommandRequest{SandboxId: id, CommandId: cmd.Id}))
				if err != nil {
					t.Fatal(err)
				}
				got := res.Msg
				if got.EndReason != "reset" || got.State == pb.CommandState_COMMAND_STATE_RUNNING {
					t.Fatalf("command after reset: state %v, end reason %q", got.State, got.EndReason)
				}
				// The shell is closed; a new one has none of its environment.
				if _, _, code := run3(nil, "shell", "run", id, "main", "--", "echo $FOO"); code == 0 {
					t.Fatal("a shell survived the reset")
				}
				if out, code := run(nil, "shell", "create", id, "main"); code != 0 {
					t.Fatalf("shell create after reset: %s", out)
				}
				if out, _, code := run3(nil, "shell", "run", id, "main", "--", "echo \"[$FOO]\""); code != 0 || strings.TrimSpace(out) != "[]" {
					t.Fatalf("new shell after reset: %q (exit %d), want [] (no FOO)", out, code)
				}
				run(nil, "shell", "rm", id, "main")

				// Nothing of the old state.
				for what, script := range map[string]string{
					"env":      "env | sort",
					"hostname": "uname -n",
					"hosts":    "cat /etc/hosts 2>&1; true",
					"work":     "ls -A /work",
					"tmp":      "ls -A /tmp",
					"shm":      "ls -A /dev/shm",
					"etc":      "cat /etc/hostname",
					"ipc":      "cat /proc/sysvipc/shm /proc/sysvipc/sem /proc/sysvipc/msg",
				} {
					if got := sh(t, id, script); got != fresh[what] {
						t.Errorf("reset %d: %s is %q, a fresh sandbox's is %q", r, what, got, fresh[what])
					}
				}
				if out := sh(t, id, "cat /proc/net/tcp"); strings.Contains(out, " 0A ") {
					t.Errorf("reset %d: a socket still listens:\n%s", r, out)
				}
				// Only the agent (and this ps).
				out = sh(t, id, "ps -o pid,args")
				for _, l := range strings.Split(strings.TrimSpace(out), "\n")[1:] {
					if !strings.Contains(l, "/.shoal/agent") && !strings.Contains(l, "ps -o pid,args") {
						t.Errorf("reset %d: a process left: %s", r, l)
					}
				}
				after, err := c.Get(ctx, id)
				if err != nil {
					t.Fatal(err)
				}
				if after.Id != before.Id || after.Runtime["runc_id"] != before.Runtime["runc_id"] || after.State != pb.SandboxState_SANDBOX_STATE_RUNNING ||
					after.MemoryBytes != before.MemoryBytes {
					t.Fatalf("reset %d made another sandbox: %+v, before %+v", r, after, before)
				}
				if _, err := os.Stat(oldUpper); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("reset %d: the old writable layer %s is still there (%v)", r, oldUpper, err)
				}
				// The new one is where the sandbox writes.
				sh(t, id, "echo new > /work/new")
				if got := hostFile(t, id, "work/new"); got != "new" {
					t.Errorf("reset %d: the sandbox's writes are not in its upper %s (%q)", r, upperOf(t, id), got)
				}
				sh(t, id, "rm /work/new")
			}
		})
	}
}

// TestPauseFSOnly: `shoal pause --fs-only` ends the sandbox's processes
// and keeps its files: after the resume its files are there, its
// processes (and their commands) are not, and its agent serves.
func TestPauseFSOnly(t *testing.T) {
	need(t)
	id := create(t)
	c := sdk(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	sh(t, id, "echo kept > /work/f; echo tmp > /tmp/t")
	cmd, err := c.Start(ctx, &pb.ExecRequest{SandboxId: id, Args: []string{"sleep", "1000"}})
	if err != nil {
		t.Fatal(err)
	}
	shoalOK(t, "pause", "--fs-only", id)
	sb := getSandbox(t, c, id)
	if sb.State != pb.SandboxState_SANDBOX_STATE_PAUSED || sb.Pause == nil || !sb.Pause.FsOnly {
		t.Fatalf("after pause --fs-only: state %v, pause %+v", sb.State, sb.Pause)
	}
	shoalOK(t, "resume", id)
	if got := sh(t, id, "cat /work/f /tmp/t"); got != "kept\ntmp\n" {
		t.Fatalf("files after a file-system-only pause: %q", got)
	}
	if out := sh(t, id, "ps -o args"); strings.Contains(out, "sleep 1000") {
		t.Fatalf("a process survived a file-system-only pause:\n%s", out)
	}
	res, err := c.Commands.GetCommand(ctx, connect.NewRequest(&pb.GetCommandRequest{SandboxId: id, CommandId: cmd.Id}))
	if err != nil {
		t.Fatal(err)
	}
	if res.Msg.State == pb.CommandState_COMMAND_STATE_RUNNING {
		t.Fatalf("the command of a killed process still runs: %+v", res.Msg)
	}
	// A plain pause still keeps the processes.
	startInSandbox(t, id, "sleep", "999")
	shoalOK(t, "pause", id)
	if sb := getSandbox(t, c, id); sb.Pause == nil || sb.Pause.FsOnly {
		t.Fatalf("a plain pause says fs_only: %+v", sb.Pause)
	}
	shoalOK(t, "resume", id)
	if out := sh(t, id, "ps -o args"); !strings.Contains(out, "sleep 999") {
		t.Fatalf("a plain pause lost a process:\n%s", out)
	}
}

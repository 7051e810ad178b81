package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// TestMicroVM drives a microvm sandbox through the CLI: create, exec, files
// both ways, a commit refused with the reason, a restart of the server
// that the VM survives (the new server re-dials its agent channel), a
// pause (snapshot, QEMU ends) across another restart and a resume, and a
// delete that ends its QEMU. It skips when this node offers no microvm
// backend (no QEMU or guest kernel: scripts/vmkernel.sh). serve chooses
// the accelerator (KVM if a probe guest boots on it, else TCG).
func TestMicroVM(t *testing.T) {
	need(t)
	stdout, stderr, code := run3(nil, "create", "--backend", "microvm", "--base", baseRef, "--memory", "256M", "--env", "GREETING=hello")
	if code != 0 {
		if strings.Contains(stderr, "not available on this node") {
			t.Skipf("no microvm backend on this node: %s", strings.TrimSpace(stderr))
		}
		t.Fatalf("create: %s %s", stdout, stderr)
	}
	id := strings.TrimSpace(stdout)
	deleted := false
	t.Cleanup(func() {
		if !deleted {
			run(nil, "rm", id)
		}
	})
	var info struct {
		Backend string            `json:"backend"`
		State   string            `json:"state"`
		Runtime map[string]string `json:"runtime"`
	}
	out, code := run(nil, "inspect", id)
	if code != 0 || json.Unmarshal([]byte(out), &info) != nil || info.Backend != "microvm" || info.State != "running" {
		t.Fatalf("inspect: %d %s", code, out)
	}
	t.Logf("accel %s", info.Runtime["accel"])
	pid := info.Runtime["pid"]
	if out, code := run(nil, "exec", id, "--", "sh", "-c", "echo $GREETING; cat /proc/1/comm; uname -r"); code != 0 ||
		!strings.HasPrefix(out, "hello\ninit\n") {
		t.Fatalf("exec: %d %q", code, out)
	}
	if out, code := run([]byte("in the vm\n"), "cp", "-", id+":/work/x.txt"); code != 0 {
		t.Fatalf("cp in: %d %s", code, out)
	}
	if out, code := run(nil, "cp", id+":/work/x.txt", "-"); code != 0 || out != "in the vm\n" {
		t.Fatalf("cp out: %d %q", code, out)
	}
	if out, code := run(nil, "files", "ls", id, "/work"); code != 0 || !strings.Contains(out, "x.txt") {
		t.Fatalf("files ls: %d %s", code, out)
	}
	if out, code := run(nil, "layer", "commit", id, "--kind", "workspace", "vmws:1"); code == 0 || !strings.Contains(out, "inside the guest") {
		t.Errorf("commit of a VM: exit %d: %s", code, out)
	}
	// The VM outlives the server; the next one re-dials its channel.
	killServe()
	if err := startServe(); err != nil {
		t.Fatal(err)
	}
	// Bounded: a guest that never takes the new server's channel would
	// leave the request waiting.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var buf bytes.Buffer
	st, err := sdk(t).Exec(ctx, id, shoal.ExecOptions{Args: []string{"cat", "/work/x.txt"}, Stdout: &buf})
	if err != nil || st.Code != 0 || buf.String() != "in the vm\n" {
		t.Fatalf("exec after a restart of the server: %v %v %q", st, err, buf.String())
	}
	// Paused: the VM's state goes to a file and its QEMU ends; a command
	// that runs across the pause (and a restart of the server while the
	// VM is paused) streams to its end after the resume, in a new QEMU.
	cmdID := strings.TrimSpace(shoalOK(t, "exec", "-d", id, "--", "sh", "-c", "i=0; while [ $i -lt 20 ]; do i=$((i+1)); echo line $i; sleep 0.05; done"))
	var want strings.Builder
	for i := 1; i <= 20; i++ {
		fmt.Fprintf(&want, "line %d\n", i)
	}
	t.Logf("shoal pause: %s", shoalOK(t, "pause", id))
	if _, stderr, code := run3(nil, "pause", id); code != 0 || !strings.Contains(stderr, "paused already") {
		t.Fatalf("second pause: exit %d, %s", code, stderr)
	}
	killServe()
	if err := startServe(); err != nil {
		t.Fatal(err)
	}
	out, code = run(nil, "inspect", id)
	if code != 0 || json.Unmarshal([]byte(out), &info) != nil || info.State != "paused" {
		t.Fatalf("inspect of a paused VM after a restart of the server: %d %s", code, out)
	}
	if b, err := os.ReadFile("/proc/" + pid + "/stat"); err == nil && !strings.Contains(string(b), ") Z ") {
		t.Fatalf("qemu %s still runs while the VM is paused", pid)
	}
	shoalOK(t, "resume", id)
	if got := shoalOK(t, "attach", id, cmdID); got != want.String() {
		t.Fatalf("the command started before the pause streamed\n%q\nwant\n%q", got, want.String())
	}
	if out, code := run(nil, "cp", id+":/work/x.txt", "-"); code != 0 || out != "in the vm\n" {
		t.Fatalf("a file after the resume: %d %q", code, out)
	}
	out, code = run(nil, "inspect", id)
	if code != 0 || json.Unmarshal([]byte(out), &info) != nil || info.State != "running" || info.Runtime["pid"] == pid {
		t.Fatalf("inspect after resume: %d %s", code, out)
	}
	pid = info.Runtime["pid"]
	if out, code := run(nil, "rm", id); code != 0 {
		t.Fatalf("rm: %d %s", code, out)
	}
	deleted = true
	deadline := time.Now().Add(30 * time.Second)
	for {
		b, err := os.ReadFile("/proc/" + pid + "/stat")
		if err != nil || strings.Contains(string(b), ") Z ") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("qemu %s still runs after rm", pid)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

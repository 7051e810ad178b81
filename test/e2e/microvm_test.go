package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// TestMicroVM drives a microvm sandbox through the CLI: create, exec, files
// both ways, a commit (checkVMCommit), a half-closed TCP tunnel, a restart of the server
// that the VM survives (the new server re-dials its agent channel), a
// pause (snapshot, QEMU ends) across another restart and a resume, and a
// delete that ends its QEMU. It skips when this node offers no microvm
// backend (no QEMU or guest kernel: scripts/vmkernel.sh). serve chooses
// the accelerator (KVM if a probe guest boots on it, else TCG).
func TestMicroVM(t *testing.T) {
	need(t)
	id := createMicroVM(t, "--env", "GREETING=hello")
	deleted := false
	t.Cleanup(func() {
		if !deleted {
			run(nil, "rm", id)
		}
	})
	var info struct {
		Backend   string            `json:"backend"`
		State     string            `json:"state"`
		PidsLimit int64             `json:"pids_limit"`
		Runtime   map[string]string `json:"runtime"`
	}
	out, code := run(nil, "inspect", id)
	if code != 0 || json.Unmarshal([]byte(out), &info) != nil || info.Backend != "microvm" || info.State != "running" {
		t.Fatalf("inspect: %d %s", code, out)
	}
	t.Logf("accel %s, layers as %s", info.Runtime["accel"], info.Runtime["layer_devices"])
	if want := os.Getenv("SHOAL_VM_LAYERS"); want != "" && info.Runtime["layer_devices"] != want {
		t.Fatalf("layers as %q, SHOAL_VM_LAYERS=%s", info.Runtime["layer_devices"], want)
	}
	pid := info.Runtime["pid"]
	if out, code := run(nil, "exec", id, "--", "sh", "-c", "echo $GREETING; cat /proc/1/comm; uname -r"); code != 0 ||
		!strings.HasPrefix(out, "hello\ninit\n") {
		t.Fatalf("exec: %d %q", code, out)
	}
	// The sandbox's tasks limit holds in the guest: its commands' cgroup.
	if out, code := run(nil, "exec", id, "--", "cat", "/sys/fs/cgroup/cmds/pids.max"); code != 0 || info.PidsLimit < 1 ||
		out != fmt.Sprintf("%d\n", info.PidsLimit) {
		t.Fatalf("the guest's pids.max: %d %q, the sandbox's pids_limit %d", code, out, info.PidsLimit)
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
	checkVMCommit(t, id)
	// A TCP half-close through the SDK's tunnel reaches the guest's
	// server, which answers once it has read to the end.
	startInSandbox(t, id, "portsrv", "tcp", "127.0.0.1:7070")
	var conn net.Conn
	var err error
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if conn, err = sdk(t).DialPort(context.Background(), id, 7070); err == nil || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	halfCloseRoundTrip(t, conn, "hello through the VM's channel")
	conn.Close()
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

// TestMicroVMPauseInPlace: with serve --vm-pause in-place, a paused VM
// keeps its QEMU (stopped, its memory paged out), stays paused across a
// restart of the server, and resumes in the same QEMU; a command started
// before the pause streams to its end.
func TestMicroVMPauseInPlace(t *testing.T) {
	need(t)
	restartServeWith(t, "--vm-pause", "in-place")
	id := createMicroVM(t)
	t.Cleanup(func() { run(nil, "rm", id) })
	var info struct {
		State   string            `json:"state"`
		Runtime map[string]string `json:"runtime"`
	}
	inspect := func(want string) {
		t.Helper()
		out, code := run(nil, "inspect", id)
		if code != 0 || json.Unmarshal([]byte(out), &info) != nil || info.State != want {
			t.Fatalf("inspect: %d %s (want %s)", code, out, want)
		}
	}
	inspect("running")
	pid := info.Runtime["pid"]
	alive := func() bool {
		b, err := os.ReadFile("/proc/" + pid + "/stat")
		return err == nil && !strings.Contains(string(b), ") Z ")
	}
	cmdID := strings.TrimSpace(shoalOK(t, "exec", "-d", id, "--", "sh", "-c", "i=0; while [ $i -lt 20 ]; do i=$((i+1)); echo line $i; sleep 0.05; done"))
	var want strings.Builder
	for i := 1; i <= 20; i++ {
		fmt.Fprintf(&want, "line %d\n", i)
	}
	t.Logf("shoal pause: %s", shoalOK(t, "pause", id))
	killServe()
	if err := startServe(); err != nil {
		t.Fatal(err)
	}
	inspect("paused")
	if !alive() {
		t.Fatalf("qemu %s ended: a VM paused in place keeps it", pid)
	}
	shoalOK(t, "resume", id)
	if got := shoalOK(t, "attach", id, cmdID); got != want.String() {
		t.Fatalf("the command started before the pause streamed\n%q\nwant\n%q", got, want.String())
	}
	inspect("running")
	if info.Runtime["pid"] != pid {
		t.Fatalf("resumed in QEMU %s, paused in %s: want the same", info.Runtime["pid"], pid)
	}
	if out, code := run(nil, "rm", id); code != 0 {
		t.Fatalf("rm: %d %s", code, out)
	}
}

// With serve --vm-boot template, the first microVM of a shape boots and
// the node makes its template after it; the next one is restored from it
// (runtime boot=template), with its own environment and writable layer.
func TestMicroVMTemplate(t *testing.T) {
	need(t)
	restartServeWith(t, "--vm-boot", "template")
	boot := func(id string) string {
		t.Helper()
		var info struct {
			Runtime map[string]string `json:"runtime"`
		}
		out, code := run(nil, "inspect", id)
		if code != 0 || json.Unmarshal([]byte(out), &info) != nil {
			t.Fatalf("inspect: %d %s", code, out)
		}
		return info.Runtime["boot"]
	}
	first := createMicroVM(t)
	t.Cleanup(func() { run(nil, "rm", first) })
	if got := boot(first); got != "cold" {
		t.Fatalf("the first microVM: boot %q, want cold", got)
	}
	deadline := time.Now().Add(4 * time.Minute)
	for {
		if m, _ := filepath.Glob(filepath.Join(dataDir, "vm", "templates", "*.state")); len(m) > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no template 4 minutes after the first microVM")
		}
		time.Sleep(200 * time.Millisecond)
	}
	second := createMicroVM(t, "--env", "WHO=second")
	t.Cleanup(func() { run(nil, "rm", second) })
	if got := boot(second); got != "template" {
		t.Fatalf("the second microVM: boot %q, want template", got)
	}
	shoalOK(t, "exec", second, "--", "sh", "-c", "echo mine > /tmp/f")
	if got := shoalOK(t, "exec", second, "--", "sh", "-c", "echo $WHO; cat /tmp/f"); got != "second\nmine\n" {
		t.Errorf("the restored VM: %q", got)
	}
	if got := shoalOK(t, "exec", first, "--", "sh", "-c", "cat /tmp/f 2>/dev/null || echo none"); got != "none\n" {
		t.Errorf("the first VM sees the second's file: %q", got)
	}
}

// restartServeWith restarts the test's server with more flags, and as it
// was when the test ends.
func restartServeWith(t *testing.T, flags ...string) {
	t.Helper()
	killServe()
	serveExtra = flags
	if err := startServe(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		killServe()
		serveExtra = nil
		if err := startServe(); err != nil {
			t.Errorf("restart the server as it was: %v", err)
		}
	})
}

// createMicroVM creates a 256 MiB microvm sandbox from the test's base
// with the CLI (more flags in args) and returns its ID; it skips the test
// when this node offers no microvm backend.
func createMicroVM(t *testing.T, args ...string) string {
	t.Helper()
	stdout, stderr, code := run3(nil, append([]string{"create", "--backend", "microvm", "--base", baseRef, "--memory", "256M"}, args...)...)
	if code != 0 {
		if strings.Contains(stderr, "not available on this node") {
			t.Skipf("no microvm backend on this node: %s", strings.TrimSpace(stderr))
		}
		t.Fatalf("create: %s %s", stdout, stderr)
	}
	return strings.TrimSpace(stdout)
}

// checkVMCommit commits the VM id's writable layer after changes that make
// whiteouts, an opaque directory, a hard link, a symlink, owners and modes,
// and checks that the same changes made in a container commit to the very
// same image, and that a container from the base and the VM's commit sees
// what the VM saw.
func checkVMCommit(t *testing.T, id string) {
	t.Helper()
	changes := `set -e
		rm /etc/hostname
		echo old > /root/old && sync
		rm -rf /root && mkdir /root && echo new > /root/new
		mkdir -p /repo/.git && echo 'print(42)' > /repo/main.py && ln -s /repo/main.py /repo/link && ln /repo/main.py /repo/hard.py
		chmod 700 /repo && chown 1000:1000 /repo/main.py`
	snapshot := "find /etc /root /repo /work | sort; cat /repo/link /root/new; stat -c '%a %u' /repo /repo/main.py; ls -i /repo/main.py /repo/hard.py | awk '{print $1}' | uniq | wc -l; test -e /etc/hostname || echo gone"
	sh(t, id, changes)
	want := sh(t, id, snapshot)
	start := time.Now()
	stdout, stderr, code := run3(nil, "layer", "commit", id, "--kind", "workspace", "vmws:1")
	vmTook := time.Since(start)
	if code != 0 || !strings.HasPrefix(stdout, "vmws@sha256:") || !strings.Contains(stderr, "from its guest") {
		t.Fatalf("commit of a VM: %d %q %q", code, stdout, stderr)
	}
	// The same changes in a container (and the file the VM got by cp).
	ct := createWith(t, "--base", baseRef)
	if out, code := run([]byte("in the vm\n"), "cp", "-", ct+":/work/x.txt"); code != 0 {
		t.Fatalf("cp in: %d %s", code, out)
	}
	sh(t, ct, changes)
	if got := sh(t, ct, snapshot); got != want {
		t.Fatalf("the same changes in a container:\n%s\nin the VM:\n%s", got, want)
	}
	start = time.Now()
	shoalOK(t, "layer", "commit", ct, "--kind", "workspace", "ctws:1")
	t.Logf("shoal layer commit: VM %s, container %s (the same changes)", vmTook.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
	if vm, c := inspectLayer(t, "vmws:1"), inspectLayer(t, "ctws:1"); vm.Digest != c.Digest {
		t.Errorf("a VM's commit is %s, a container's of the same changes %s\nVM:\n%s\ncontainer:\n%s", vm.Digest, c.Digest, listImage(t, vm.Digest), listImage(t, c.Digest))
	}
	sb := createWith(t, "--base", baseRef, "--workspace", "vmws:1")
	if got := sh(t, sb, snapshot); got != want {
		t.Errorf("base + the VM's commit:\n%s\nthe VM:\n%s", got, want)
	}
}

// listImage lists a layer image's entries with their metadata (to tell
// two images apart).
func listImage(t *testing.T, digest string) string {
	dir := t.TempDir()
	if out, err := exec.Command("mount", "-t", "erofs", "-o", "ro,loop", imagePath(digest), dir).CombinedOutput(); err != nil {
		return fmt.Sprintf("mount: %v %s", err, out)
	}
	defer exec.Command("umount", dir).Run()
	out, _ := exec.Command("sh", "-c", "cd "+dir+" && find . -printf '%p %M %U:%G %s %l\\n' | sort && python3 -c 'import os\nfor r, ds, fs in os.walk(\".\"):\n  for n in [r]+[os.path.join(r, f) for f in fs]:\n    for a in os.listxattr(n, follow_symlinks=False): print(n, a, os.getxattr(n, a, follow_symlinks=False))'").CombinedOutput()
	return string(out)
}

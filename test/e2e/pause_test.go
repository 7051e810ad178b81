package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

func getSandbox(t *testing.T, c *shoal.Client, id string) *pb.Sandbox {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sb, err := c.Get(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	return sb
}

// hostFile reads a file of a sandbox's writable layer from the host,
// without going through (and so without resuming) the sandbox.
func hostFile(t *testing.T, id, path string) string {
	b, _ := os.ReadFile(filepath.Join(upperOf(t, id), path))
	return strings.TrimSpace(string(b))
}

// cgroupMemory is the sandbox's memory cgroup usage (v1), -1 if unknown.
func cgroupMemory(sb *pb.Sandbox) int64 {
	b, err := os.ReadFile(filepath.Join("/sys/fs/cgroup/memory/shoal", sb.Runtime["runc_id"], "memory.usage_in_bytes"))
	if err != nil {
		return -1
	}
	n, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	return n
}

func hostHasSwap() bool {
	b, err := os.ReadFile("/proc/swaps")
	return err == nil && len(strings.Split(strings.TrimSpace(string(b)), "\n")) > 1
}

// frozen checks that memhold's tick does not move for a while (the
// sandbox's processes are stopped).
func frozen(t *testing.T, id string) {
	t.Helper()
	before := hostFile(t, id, "work/m/tick")
	time.Sleep(500 * time.Millisecond) // memhold ticks every 20 ms
	if after := hostFile(t, id, "work/m/tick"); after != before {
		t.Fatalf("a paused sandbox ran: memhold's tick moved %s -> %s", before, after)
	}
}

// memholdOK asks memhold to hash its memory again and use its TCP
// connection, and checks both are as before the pause.
func memholdOK(t *testing.T, id string) {
	t.Helper()
	sum0 := hostFile(t, id, "work/m/sum0")
	sh(t, id, "rm -f /work/m/out; touch /work/m/go") // resumes a paused sandbox
	var out string
	waitFor(t, 30*time.Second, "memhold's answer", func() bool {
		out = hostFile(t, id, "work/m/out")
		return out != ""
	})
	if want := sum0 + " echoed"; out != want {
		t.Fatalf("after pause and resume memhold says %q, want %q (same memory, TCP connection alive)", out, want)
	}
}

// TestPauseResume: a paused sandbox stops (its processes make no
// progress), its memory is reclaimed when the host has swap, and resumed
// it has the same memory content, files and TCP connection; a command
// started before the pause streams to its end after the resume, its
// output byte for byte; a request resumes a paused sandbox by itself; and
// a restarted serve keeps a paused sandbox paused and resumable.
func TestPauseResume(t *testing.T) {
	need(t)
	c := sdk(t)
	id := create(t, "--memory", "512M", "--auto-pause", "0")
	sh(t, id, "mkdir -p /work/m && echo kept > /work/file")
	startInSandbox(t, id, "memhold", "96", "/work/m")
	waitFor(t, 60*time.Second, "memhold to fill its memory", func() bool { return hostFile(t, id, "work/m/sum0") != "" })
	// A command that runs across the pause: 40 lines, 50 ms apart.
	cmdID := strings.TrimSpace(shoalOK(t, "exec", "-d", id, "--", "sh", "-c", "i=0; while [ $i -lt 40 ]; do i=$((i+1)); echo line $i; sleep 0.05; done"))
	var want strings.Builder
	for i := 1; i <= 40; i++ {
		fmt.Fprintf(&want, "line %d\n", i)
	}

	before := cgroupMemory(getSandbox(t, c, id))
	out := shoalOK(t, "pause", id)
	t.Logf("shoal pause: %s", out)
	sb := getSandbox(t, c, id)
	if sb.State != pb.SandboxState_SANDBOX_STATE_PAUSED || sb.Pause == nil {
		t.Fatalf("after pause: state %s, pause %v", sb.State, sb.Pause)
	}
	frozen(t, id)
	after := cgroupMemory(sb)
	switch {
	case !hostHasSwap():
		t.Logf("no swap on this host (serve could not set up zram): the reclaim of anonymous memory is not checked (cgroup memory %d -> %d)", before, after)
	case before < 0:
		t.Log("no v1 memory cgroup: the reclaim is not checked")
	case before-after < 64<<20:
		t.Errorf("pause reclaimed %d bytes of the sandbox's memory (%d -> %d), want at least 64 MiB of memhold's 96", before-after, before, after)
	default:
		t.Logf("cgroup memory %d -> %d bytes", before, after)
	}
	// Pausing again changes nothing.
	if _, stderr, code := run3(nil, "pause", id); code != 0 || !strings.Contains(stderr, "paused already") {
		t.Fatalf("second pause: exit %d, %s", code, stderr)
	}

	shoalOK(t, "resume", id)
	if sb := getSandbox(t, c, id); sb.State != pb.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("after resume: %s", sb.State)
	}
	if got := shoalOK(t, "attach", id, cmdID); got != want.String() {
		t.Fatalf("the command started before the pause streamed\n%q\nwant\n%q", got, want.String())
	}
	memholdOK(t, id)
	if got := sh(t, id, "cat /work/file"); got != "kept\n" {
		t.Fatalf("file after resume: %q", got)
	}

	// Transparent resume: exec on a paused sandbox.
	shoalOK(t, "pause", id)
	frozen(t, id)
	memholdOK(t, id)
	if sb := getSandbox(t, c, id); sb.State != pb.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("after a request to a paused sandbox: %s", sb.State)
	}

	// A restarted serve keeps it paused, and it resumes.
	shoalOK(t, "pause", id)
	killServe()
	if err := startServe(); err != nil {
		t.Fatal(err)
	}
	c = sdk(t)
	if sb := getSandbox(t, c, id); sb.State != pb.SandboxState_SANDBOX_STATE_PAUSED {
		t.Fatalf("after a restart of serve: %s, want paused", sb.State)
	}
	frozen(t, id)
	memholdOK(t, id)

	// A paused sandbox is deleted like any other (its frozen tasks die).
	shoalOK(t, "pause", id)
	shoalOK(t, "rm", id)
	if _, stderr, code := run3(nil, "inspect", id); code == 0 || !strings.Contains(stderr, "no sandbox") {
		t.Fatalf("inspect after rm of a paused sandbox: exit %d, %s", code, stderr)
	}
}

// TestPauseFreesMemoryByDefault: on a node with serve's default flags
// (--zram-size auto: a zram swap when the host has none), a pause frees at
// least 90% of a 200 MiB process's memory, and neither its pause record
// nor /metrics says file pages only. Skipped, with serve's reason, only
// when serve could not set up zram (no zram module, a container host).
func TestPauseFreesMemoryByDefault(t *testing.T) {
	need(t)
	serveLog, _ := os.ReadFile(filepath.Join(dataDir, "serve.log"))
	if i := strings.Index(string(serveLog), "no zram swap: pauses reclaim file pages only"); i >= 0 {
		line, _, _ := strings.Cut(string(serveLog[i:]), "\n")
		t.Skipf("serve could not set up zram: %s", line)
	}
	if !hostHasSwap() {
		t.Fatalf("the host has no swap after serve started with --zram-size auto, and serve did not say why:\n%s", serveLog)
	}
	const mib = 200
	c := sdk(t)
	id := create(t, "--memory", "512M", "--auto-pause", "0")
	sh(t, id, "mkdir -p /work/m")
	startInSandbox(t, id, "memhold", fmt.Sprint(mib), "/work/m")
	waitFor(t, 60*time.Second, "memhold to fill its memory", func() bool { return hostFile(t, id, "work/m/sum0") != "" })
	before := cgroupMemory(getSandbox(t, c, id))
	if before < 0 {
		t.Skip("no v1 memory cgroup to read the sandbox's memory from")
	}
	shoalOK(t, "pause", id)
	sb := getSandbox(t, c, id)
	after := cgroupMemory(sb)
	t.Logf("cgroup memory %d -> %d MiB; pause record %+v", before>>20, after>>20, sb.Pause)
	if freed := before - after; freed < mib<<20*9/10 {
		t.Errorf("the pause freed %d MiB of the sandbox's %d MiB (memhold holds %d MiB), want at least 90%% of memhold's", freed>>20, before>>20, mib)
	}
	if sb.Pause == nil || sb.Pause.FilePagesOnly {
		t.Errorf("pause record %+v: file pages only on a host with swap", sb.Pause)
	}
	if out := shoalOK(t, "inspect", id); !strings.Contains(out, `"file_pages_only": false`) {
		t.Errorf("inspect does not say file_pages_only false:\n%s", out)
	}
	req, _ := http.NewRequest(http.MethodGet, apiURL+"/metrics", nil)
	req.Header.Set("Authorization", "Bearer "+apiKey)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if !strings.Contains(string(body), "\nshoal_pause_file_pages_only 0\n") || !strings.Contains(string(body), `shoal_host_swap_bytes{kind="total"}`) {
		t.Errorf("/metrics lacks shoal_pause_file_pages_only 0 or shoal_host_swap_bytes")
	}
	memholdOK(t, id)
}

// TestAutoPause: a sandbox created with --auto-pause is paused after that
// long idle, not while a command runs in it, and an exec resumes it.
func TestAutoPause(t *testing.T) {
	need(t)
	c := sdk(t)
	id := create(t, "--auto-pause", "1s")
	// memhold in the background, left by a command that ended: not a
	// running command.
	sh(t, id, "mkdir -p /work/m; memhold 8 /work/m >/dev/null 2>&1 &")
	waitFor(t, 30*time.Second, "memhold to start", func() bool { return hostFile(t, id, "work/m/tick") != "" })
	// While a command runs, it is not idle.
	shoalOK(t, "exec", "-d", id, "--", "sleep", "3")
	time.Sleep(2 * time.Second) // past its auto-pause, with the command running
	if sb := getSandbox(t, c, id); sb.State != pb.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("paused while a command ran: %s", sb.State)
	}
	waitFor(t, 30*time.Second, "the idle sandbox to be paused", func() bool {
		return getSandbox(t, c, id).State == pb.SandboxState_SANDBOX_STATE_PAUSED
	})
	if sb := getSandbox(t, c, id); sb.Pause == nil || !sb.Pause.Auto {
		t.Fatalf("pause info %v, want auto", sb.Pause)
	}
	frozen(t, id)
	if got := sh(t, id, "echo hi"); got != "hi\n" {
		t.Fatalf("exec after auto-pause: %q", got)
	}
	if sb := getSandbox(t, c, id); sb.State != pb.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("after exec: %s", sb.State)
	}
}

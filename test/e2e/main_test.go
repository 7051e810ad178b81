// Package e2e tests Shoal end to end: real `shoal serve` and `shoal` binaries,
// real runc, overlayfs and EROFS, driven through the CLI and the Go SDK.
// They need root, runc, mkfs.erofs and busybox-static; without them every
// test skips with the reason.
package e2e

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/zram"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
	"github.com/shoal-sandbox/shoal/test/internal/serveproc"
)

var (
	skipReason string
	binDir     string // shoal, shoal-agent
	dataDir    string
	buildRoot  string // serve --build-root: server-path builds read below it
	apiURL     string
	apiKey     string
	serveCmd   *exec.Cmd
	baseRef    = "busybox:1"
	// egressSubnet is this run's own: other nodes on the host (parallel
	// runs) take theirs (network_test.go).
	egressSubnet = fmt.Sprintf("10.%d.0.0/16", 128+os.Getpid()%120)
)

func TestMain(m *testing.M) {
	code := func() int {
		if err := setup(); err != nil {
			if skipReason == "" {
				fmt.Fprintln(os.Stderr, "e2e setup:", err)
				return 1
			}
		}
		defer teardown()
		return m.Run()
	}()
	os.Exit(code)
}

func need(t *testing.T) {
	t.Helper()
	if skipReason != "" {
		t.Skip(skipReason)
	}
}

// zramBefore: the zram swap devices active before the tests (teardown
// removes the one this suite's serve set up, --zram-size auto).
var zramBefore []zram.Device

func setup() error {
	zramBefore, _ = zram.Active()
	if os.Geteuid() != 0 {
		skipReason = "needs root (runc, mounts, cgroups)"
		return fmt.Errorf("%s", skipReason)
	}
	for _, bin := range []string{"runc", "mkfs.erofs", "busybox"} {
		if _, err := exec.LookPath(bin); err != nil {
			skipReason = "needs " + bin + " installed"
			return fmt.Errorf("%s", skipReason)
		}
	}
	var err error
	if binDir, err = os.MkdirTemp("", "shoal-e2e-bin"); err != nil {
		return err
	}
	builds := [][]string{
		{"go", "build", "-o", filepath.Join(binDir, "shoal"), "../../cmd/shoal"},
		{"go", "build", "-o", filepath.Join(binDir, "shoal-agent"), "../../cmd/shoal-agent"},
		{"go", "build", "-o", filepath.Join(binDir, "hog"), "./testdata/hog"},
		{"go", "build", "-o", filepath.Join(binDir, "portsrv"), "./testdata/portsrv"},
		{"go", "build", "-o", filepath.Join(binDir, "escape"), "./testdata/escape"},
		{"go", "build", "-o", filepath.Join(binDir, "swapper"), "./testdata/swapper"},
		{"go", "build", "-o", filepath.Join(binDir, "memhold"), "./testdata/memhold"},
		{"go", "build", "-o", filepath.Join(binDir, "sysvipc"), "./testdata/sysvipc"},
	}
	for _, b := range builds {
		cmd := exec.Command(b[0], b[1:]...)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("%v: %v\n%s", b, err, out)
		}
	}
	// Short: unix socket paths live under it.
	if dataDir, err = os.MkdirTemp("/tmp", "se"); err != nil {
		return err
	}
	if buildRoot, err = os.MkdirTemp("", "shoal-e2e-build"); err != nil {
		return err
	}
	if err := startServe(); err != nil {
		return err
	}
	key, err := os.ReadFile(filepath.Join(dataDir, "admin.key"))
	if err != nil {
		return err
	}
	apiKey = strings.TrimSpace(string(key))
	rootfs, err := busyboxRootfs()
	if err != nil {
		return err
	}
	defer os.RemoveAll(rootfs)
	if out, code := run(nil, "layer", "build", "--kind", "base", baseRef, rootfs); code != 0 {
		return fmt.Errorf("layer build: %s", out)
	}
	return nil
}

func startServe() error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	addr := ln.Addr().String()
	ln.Close()
	apiURL = "http://" + addr
	log, err := os.OpenFile(filepath.Join(dataDir, "serve.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	// --zram-size at its default (auto): a zram swap for paused
	// sandboxes' memory when the host has no swap (teardown removes one
	// this run made).
	serveCmd = exec.Command(filepath.Join(binDir, "shoal"), "serve", "--data", dataDir, "--listen", addr, "--debug", "--e2b-listen=",
		"--egress-subnet", egressSubnet, "--build-root", buildRoot)
	if l := os.Getenv("SHOAL_E2E_LAUNCHER"); l != "" {
		// native (the default) or runc: the suite against either launcher.
		serveCmd.Args = append(serveCmd.Args, "--launcher", l)
	}
	if k := os.Getenv("SHOAL_VM_KERNEL_DIR"); k != "" {
		// Another guest kernel directory (scripts/vmkernel.sh DIR), as
		// the microvm package's tests take it.
		serveCmd.Args = append(serveCmd.Args, "--vm-kernel", k)
	}
	if l := os.Getenv("SHOAL_VM_LAYERS"); l != "" {
		// pmem or blk: the VM tests with one layer mode (default auto).
		serveCmd.Args = append(serveCmd.Args, "--vm-layers", l)
	}
	serveCmd.Args = append(serveCmd.Args, serveExtra...)
	serveCmd.Stdout, serveCmd.Stderr = log, log
	serveCmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := serveCmd.Start(); err != nil {
		return err
	}
	log.Close()
	// A generous deadline: a loaded host may take a while to recover the
	// sandboxes before serve listens; a serve that exited is seen at once.
	for deadline := time.Now().Add(2 * time.Minute); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if res, err := http.Get(apiURL + "/healthz"); err == nil {
			res.Body.Close()
			return nil
		}
		if serveproc.Exited(serveCmd.Process.Pid) {
			break
		}
	}
	b, _ := os.ReadFile(filepath.Join(dataDir, "serve.log"))
	return fmt.Errorf("shoal serve did not become healthy:\n%s", b)
}

// killServe kills shoal serve with SIGKILL, as a crash would.
// serveExtra: more flags for the next startServe (a test that needs a
// server configured otherwise sets them and restores nil after).
var serveExtra []string

func killServe() {
	serveCmd.Process.Signal(syscall.SIGKILL)
	serveCmd.Wait()
}

func teardown() {
	if serveCmd != nil && serveCmd.Process != nil {
		if c, err := shoal.New(shoal.Options{URL: apiURL, APIKey: apiKey}); err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			if sbs, err := c.List(ctx); err == nil {
				for _, sb := range sbs {
					c.Delete(ctx, sb.Id)
				}
			}
			cancel()
		}
		serveproc.Stop(serveCmd)
	}
	if dataDir != "" {
		// The warm pool's containers, if serve left them (SIGKILL): the
		// sandboxes are gone, so every container left is one of those.
		state := filepath.Join(dataDir, "runc")
		if out, err := exec.Command("runc", "--root", state, "list", "-q").Output(); err == nil {
			for _, id := range strings.Fields(string(out)) {
				exec.Command("runc", "--root", state, "delete", "--force", id).Run()
			}
		}
	}
	var serveLog []byte
	if dataDir != "" {
		serveLog, _ = os.ReadFile(filepath.Join(dataDir, "serve.log"))
		if os.Getenv("SHOAL_E2E_KEEP") == "" {
			unmountUnder(dataDir)
			os.RemoveAll(dataDir)
		} else {
			fmt.Fprintln(os.Stderr, "kept", dataDir)
		}
	}
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	if buildRoot != "" {
		os.RemoveAll(buildRoot)
	}
	if now, err := zram.Active(); err == nil && len(now) > 0 && len(zramBefore) == 0 && os.Getenv("SHOAL_E2E_KEEP") == "" {
		// Only the device this suite's serve set up (its log names it):
		// others on a shared host may have added theirs meanwhile.
		for _, d := range now {
			if !bytes.Contains(serveLog, []byte("zram swap set up for paused sandboxes")) || !bytes.Contains(serveLog, []byte("device="+d.Name+" ")) {
				continue
			}
			if err := zram.Remove(d.Name); err != nil {
				fmt.Fprintln(os.Stderr, "remove the zram swap serve set up:", err)
			}
		}
	}
}

// unmountUnder lazily unmounts everything mounted under dir (deepest first).
func unmountUnder(dir string) {
	for _, m := range mountsUnder(dir) {
		syscall.Unmount(m, syscall.MNT_DETACH)
	}
}

func mountsUnder(dir string) []string {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			out = append([]string{f[4]}, out...)
		}
	}
	return out
}

// busyboxRootfs makes a minimal root file system: busybox with its applets,
// the hog, portsrv, escape and swapper test programs, /etc/passwd (root,
// nobody and user, whose home is /home/user) and the usual directories.
func busyboxRootfs() (string, error) {
	root, err := os.MkdirTemp("", "shoal-e2e-rootfs")
	if err != nil {
		return "", err
	}
	for _, d := range []string{"bin", "etc", "root", "tmp", "proc", "sys", "dev", "work"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			return "", err
		}
	}
	os.Chmod(filepath.Join(root, "tmp"), 0o1777)
	bb, err := exec.LookPath("busybox")
	if err != nil {
		return "", err
	}
	if err := copyFile(bb, filepath.Join(root, "bin", "busybox"), 0o755); err != nil {
		return "", err
	}
	for _, prog := range []string{"hog", "portsrv", "escape", "swapper", "memhold", "sysvipc"} {
		if err := copyFile(filepath.Join(binDir, prog), filepath.Join(root, "bin", prog), 0o755); err != nil {
			return "", err
		}
	}
	out, err := exec.Command(bb, "--list").Output()
	if err != nil {
		return "", err
	}
	for _, applet := range strings.Fields(string(out)) {
		if applet == "busybox" {
			continue
		}
		os.Symlink("busybox", filepath.Join(root, "bin", applet))
	}
	files := map[string]string{
		"etc/passwd":   "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\nuser:x:1000:1000:user:/home/user:/bin/sh\n",
		"etc/group":    "root:x:0:\nnogroup:x:65534:\nuser:x:1000:\nusers:x:100:user\n",
		"etc/hostname": "layer-hostname\n",
	}
	for p, content := range files {
		if err := os.WriteFile(filepath.Join(root, p), []byte(content), 0o644); err != nil {
			return "", err
		}
	}
	// A user account with a home of its own, as E2B's templates have.
	if err := os.MkdirAll(filepath.Join(root, "home", "user"), 0o755); err != nil {
		return "", err
	}
	if err := os.Chown(filepath.Join(root, "home", "user"), 1000, 1000); err != nil {
		return "", err
	}
	return root, nil
}

func copyFile(src, dst string, mode os.FileMode) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, b, mode)
}

// eventually polls cond every 10 ms for up to timeout and reports whether
// it held (waitFor fails the test instead).
func eventually(timeout time.Duration, cond func() bool) bool {
	for deadline := time.Now().Add(timeout); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			return false
		}
	}
	return true
}

// teardownTimeout bounds the wait for what a delete leaves on the host: a
// delete answers before the sandbox's teardown (the node's reaper does it
// once no create is in flight), so that is gone soon after, not at once.
const teardownTimeout = time.Minute

// run runs the shoal CLI and returns its combined output and exit code.
func run(stdin []byte, args ...string) (string, int) {
	stdout, stderr, code := run3(stdin, args...)
	return stdout + stderr, code
}

// run3 runs the shoal CLI and returns stdout, stderr and the exit code.
func run3(stdin []byte, args ...string) (string, string, int) {
	cmd := exec.Command(filepath.Join(binDir, "shoal"), args...)
	cmd.Env = append(os.Environ(), "SHOAL_URL="+apiURL, "SHOAL_API_KEY="+apiKey)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		code = -1
		errb.WriteString(err.Error())
	}
	return out.String(), errb.String(), code
}

func sdk(t *testing.T) *shoal.Client {
	t.Helper()
	c, err := shoal.New(shoal.Options{URL: apiURL, APIKey: apiKey})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// create makes a sandbox through the CLI and deletes it when the test ends.
func create(t *testing.T, extra ...string) string {
	t.Helper()
	stdout, stderr, code := run3(nil, append([]string{"create", "--base", baseRef}, extra...)...)
	if code != 0 {
		t.Fatalf("create: %s %s", stdout, stderr)
	}
	id := strings.TrimSpace(stdout)
	t.Cleanup(func() { run(nil, "rm", id) })
	return id
}

// startExtraServe starts a serve of its own on data (its log in
// data/serve.log) at a free loopback address with args besides --data and
// --listen, stopped (SIGTERM) when the test ends; it returns the address.
func startExtraServe(t *testing.T, data string, args ...string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	log, err := os.Create(filepath.Join(data, "serve.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	srv := exec.Command(filepath.Join(binDir, "shoal"), append([]string{"serve", "--data", data, "--listen", addr}, args...)...)
	srv.Stdout, srv.Stderr = log, log
	srv.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Process.Signal(syscall.SIGTERM); srv.Wait() })
	return addr
}

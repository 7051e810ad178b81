// Package e2b runs the E2B compatibility tests: the stock e2b SDK from npm
// (pinned in package-lock.json, installed with `npm ci` in this directory)
// drives a real `shoal serve` through its E2B endpoint, with nothing but the
// SDK's own settings (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY) pointing it
// at Shoal. The tests themselves are Node scripts (*.test.mjs, node's
// built-in test runner); this Go test builds Shoal, starts serve with a
// busybox base layer and an environment made of it, and runs them.
//
// It needs root, runc, mkfs.erofs, busybox-static, Node >= 20.18.1 and the
// npm packages; without them it skips with the reason, unless
// SHOAL_E2B_REQUIRE=1 (CI) makes a missing Node or npm install a failure.
package e2b

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/test/internal/debroot"
)

const (
	template = "e2b-test"  // a Shoal environment
	baseRef  = "busybox:1" // a base layer
	// An E2B-style template: the same busybox with a "user" account
	// (1000:1000, home /home/user), the default user of E2B requests.
	userTemplate = "e2b-users"
	userBaseRef  = "busybox-users:1"
	// E2B's own kind of template: Debian with python3, bash and sudo, a
	// "user" account that may sudo without a password (debianTree).
	debianTemplate = "e2b-debian"
	debianBaseRef  = "debian-user:1"
	// The busybox template on the microvm backend (the environment's
	// backend), when the node offers it.
	vmTemplate = "e2b-vm"
)

func TestE2BSDK(t *testing.T) {
	requireNode := os.Getenv("SHOAL_E2B_REQUIRE") == "1"
	skipOrFail := func(format string, args ...any) {
		t.Helper()
		if requireNode {
			t.Fatalf(format, args...)
		}
		t.Skipf(format, args...)
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root (runc, mounts, cgroups)")
	}
	for _, bin := range []string{"runc", "mkfs.erofs", "busybox"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Skipf("needs %s installed", bin)
		}
	}
	out, err := exec.Command("node", "--version").Output()
	if err != nil {
		skipOrFail("needs Node.js >= 20.18.1 (the e2b SDK's minimum): %v", err)
	}
	if !nodeOK(strings.TrimSpace(string(out))) {
		skipOrFail("needs Node.js >= 20.18.1 (the e2b SDK's minimum), have %s", strings.TrimSpace(string(out)))
	}
	if _, err := os.Stat("node_modules/e2b/package.json"); err != nil {
		skipOrFail("the e2b SDK is not installed: run `npm ci` in test/e2b (.ci/run does)")
	}

	bin := t.TempDir()
	for _, b := range [][]string{
		{"go", "build", "-o", filepath.Join(bin, "shoal"), "../../cmd/shoal"},
		{"go", "build", "-o", filepath.Join(bin, "shoal-agent"), "../../cmd/shoal-agent"},
	} {
		cmd := exec.Command(b[0], b[1:]...)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%v: %v\n%s", b, err, out)
		}
	}
	// Short: unix socket paths live under it.
	data, err := os.MkdirTemp("/tmp", "sb")
	if err != nil {
		t.Fatal(err)
	}
	apiAddr, e2bAddr := freeAddr(t), freeAddr(t)
	logPath := filepath.Join(data, "serve.log")
	var serve *exec.Cmd
	startServe := func() {
		t.Helper()
		logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		serve = exec.Command(filepath.Join(bin, "shoal"), "serve", "--data", data, "--listen", apiAddr, "--e2b-listen", e2bAddr, "--e2b-default-template", template, "--debug",
			"--egress-subnet", fmt.Sprintf("10.%d.0.0/16", 8+os.Getpid()%120))
		serve.Stdout, serve.Stderr = logf, logf
		serve.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		if err := serve.Start(); err != nil {
			t.Fatal(err)
		}
		logf.Close()
	}
	startServe()
	apiURL, e2bURL := "http://"+apiAddr, "http://"+e2bAddr
	t.Cleanup(func() {
		// Delete what a failed test left, stop serve, clean up.
		key, _ := os.ReadFile(filepath.Join(data, "admin.key"))
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		deleteAll(ctx, apiURL, strings.TrimSpace(string(key)))
		cancel()
		serve.Process.Signal(syscall.SIGTERM)
		serve.Wait()
		if t.Failed() {
			b, _ := os.ReadFile(logPath)
			t.Logf("shoal serve log:\n%s", lastLines(string(b), 80))
		}
		unmountUnder(data)
		os.RemoveAll(data)
	})
	waitHealthy(t, apiURL+"/healthz", logPath)
	waitHealthy(t, e2bURL+"/health", logPath)
	keyb, err := os.ReadFile(filepath.Join(data, "admin.key"))
	if err != nil {
		t.Fatal(err)
	}
	key := strings.TrimSpace(string(keyb))

	rootfs := busyboxRootfs(t)
	cli := func(args ...string) {
		t.Helper()
		cmd := exec.Command(filepath.Join(bin, "shoal"), args...)
		cmd.Env = append(os.Environ(), "SHOAL_URL="+apiURL, "SHOAL_API_KEY="+key)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("shoal %v: %v\n%s", args, err, out)
		}
	}
	cli("layer", "build", "--kind", "base", baseRef, rootfs)
	cli("env", "create", template, "--base", baseRef)
	addUser(t, rootfs)
	cli("layer", "build", "--kind", "base", userBaseRef, rootfs)
	cli("env", "create", userTemplate, "--base", userBaseRef)
	if why := debroot.Needs(); why != "" {
		skipOrFail("the Debian template: %s", why)
	}
	t0 := time.Now()
	debian, err := debianTree()
	if err != nil {
		skipOrFail("the Debian template (from Debian's archive): %v", err)
	}
	cli("layer", "build", "--kind", "base", debianBaseRef, debian)
	cli("env", "create", debianTemplate, "--base", debianBaseRef)
	t.Logf("Debian template ready in %s", time.Since(t0).Round(time.Millisecond))
	// A template whose sandboxes are microVMs: what the SDK calls does not
	// change. Skipped (SHOAL_E2B_VM_TEMPLATE empty) where the node has no
	// VM backend.
	vmTemplateVar := vmTemplate
	cmd := exec.Command(filepath.Join(bin, "shoal"), "env", "create", vmTemplate, "--base", baseRef, "--backend", "microvm")
	cmd.Env = append(os.Environ(), "SHOAL_URL="+apiURL, "SHOAL_API_KEY="+key)
	if out, err := cmd.CombinedOutput(); err != nil {
		if !strings.Contains(string(out), "not available on this node") {
			t.Fatalf("shoal env create %s --backend microvm: %v\n%s", vmTemplate, err, out)
		}
		t.Logf("no microvm template: %s", bytes.TrimSpace(out))
		vmTemplateVar = ""
	}

	// SHOAL_E2B_ONLY=debian runs debian.test.mjs alone (while working on it).
	pattern := "*.test.mjs"
	if only := os.Getenv("SHOAL_E2B_ONLY"); only != "" {
		pattern = only + ".test.mjs"
	}
	files, err := filepath.Glob(pattern)
	if err != nil || len(files) == 0 {
		t.Fatalf("no *.test.mjs: %v", err)
	}
	env := append(os.Environ(),
		// The SDK's own settings: all an E2B user changes.
		"E2B_API_URL="+e2bURL,
		"E2B_SANDBOX_URL="+e2bURL,
		"E2B_API_KEY="+key,
		// Trust the CA Shoal generated, for the host-name (https) tests.
		"NODE_EXTRA_CA_CERTS="+filepath.Join(data, "e2b", "tls", "ca.pem"),
		// For the tests' own checks.
		"SHOAL_URL="+apiURL,
		"SHOAL_E2B_TEMPLATE="+template,
		"SHOAL_E2B_USER_TEMPLATE="+userTemplate,
		"SHOAL_E2B_DEBIAN_TEMPLATE="+debianTemplate,
		"SHOAL_E2B_VM_TEMPLATE="+vmTemplateVar,
		"SHOAL_E2B_BASE="+baseRef,
	)
	nodeRun := func(args ...string) (string, error) {
		cmd := exec.Command("node", args...)
		cmd.Env = env
		var outb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &outb, &outb
		start := time.Now()
		err := cmd.Run()
		t.Logf("node %s (%s):\n%s", strings.Join(args, " "), time.Since(start).Round(time.Millisecond), outb.String())
		return outb.String(), err
	}
	if _, err := nodeRun(append([]string{"--test", "--test-reporter=spec"}, files...)...); err != nil {
		t.Errorf("the e2b SDK tests failed: %v", err)
	}

	// A command started through E2B survives a crash of shoal serve: a new
	// client re-connects to it by pid after the restart.
	beforeOut, err := nodeRun("restart.mjs", "before")
	if err != nil {
		t.Fatalf("restart, before: %v", err)
	}
	var before struct {
		SandboxID string `json:"sandboxId"`
		Pid       int    `json:"pid"`
	}
	if err := json.Unmarshal([]byte(lastLines(strings.TrimSpace(beforeOut), 1)), &before); err != nil || before.Pid == 0 {
		t.Fatalf("restart, before: %q: %v", beforeOut, err)
	}
	serve.Process.Signal(syscall.SIGKILL)
	serve.Wait()
	startServe()
	waitHealthy(t, e2bURL+"/health", logPath)
	if _, err := nodeRun("restart.mjs", "after", before.SandboxID, strconv.Itoa(before.Pid)); err != nil {
		t.Errorf("restart, after: %v", err)
	}
}

var nodeVersion = regexp.MustCompile(`^v(\d+)\.(\d+)\.(\d+)`)

// nodeOK reports whether a `node --version` satisfies the SDK's engines
// (>=20.18.1 <21 || >=22).
func nodeOK(v string) bool {
	m := nodeVersion.FindStringSubmatch(v)
	if m == nil {
		return false
	}
	major, _ := strconv.Atoi(m[1])
	minor, _ := strconv.Atoi(m[2])
	patch, _ := strconv.Atoi(m[3])
	switch {
	case major >= 22:
		return true
	case major == 20:
		return minor > 18 || minor == 18 && patch >= 1
	}
	return false
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

func waitHealthy(t *testing.T, url, logPath string) {
	t.Helper()
	for deadline := time.Now().Add(2 * time.Minute); time.Now().Before(deadline); {
		if res, err := http.Get(url); err == nil {
			res.Body.Close()
			if res.StatusCode < 300 {
				return
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	b, _ := os.ReadFile(logPath)
	t.Fatalf("%s did not answer:\n%s", url, b)
}

// deleteAll deletes every sandbox through Shoal's own API.
func deleteAll(ctx context.Context, apiURL, key string) {
	post := func(method, body string) []byte {
		req, _ := http.NewRequestWithContext(ctx, "POST", apiURL+"/shoal.v1.SandboxService/"+method, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+key)
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			return nil
		}
		defer res.Body.Close()
		var b bytes.Buffer
		b.ReadFrom(res.Body)
		return b.Bytes()
	}
	ids := regexp.MustCompile(`"id":"([a-z2-7]{20})"`).FindAllStringSubmatch(string(post("ListSandboxes", "{}")), -1)
	for _, m := range ids {
		post("DeleteSandbox", fmt.Sprintf(`{"id":%q}`, m[1]))
	}
}

func unmountUnder(dir string) {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	var mounts []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			mounts = append([]string{f[4]}, mounts...)
		}
	}
	for _, m := range mounts {
		syscall.Unmount(m, syscall.MNT_DETACH)
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// addUser gives a root made by busyboxRootfs E2B's "user" account: a
// passwd and group entry (also in group "users") and /home/user.
func addUser(t *testing.T, root string) {
	t.Helper()
	for p, line := range map[string]string{
		"etc/passwd": "user:x:1000:1000:user:/home/user:/bin/sh\n",
		"etc/group":  "user:x:1000:\nusers:x:100:user\n",
	} {
		f, err := os.OpenFile(filepath.Join(root, p), os.O_APPEND|os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		f.WriteString(line)
		f.Close()
	}
	home := filepath.Join(root, "home", "user")
	if err := os.MkdirAll(home, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(home, 1000, 1000); err != nil {
		t.Fatal(err)
	}
}

// debianTree makes (or finds cached) a Debian root with python3, bash,
// coreutils and sudo from Debian's packages, and E2B's "user" account
// (1000:1000, /home/user, /bin/bash) allowed to sudo without a password, as
// E2B's base template has it. The packages' maintainer scripts are not run,
// so what they would make is written here: the PAM stack sudo includes.
func debianTree() (string, error) {
	return debroot.Make(debroot.Tree{
		Name:     "e2b-debian",
		Version:  "v1",
		Packages: []string{"bash", "coreutils", "dash", "python3", "sudo"},
		Finish: func(root string) error {
			files := map[string]string{
				"etc/passwd":                              "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\nuser:x:1000:1000:user:/home/user:/bin/bash\n",
				"etc/group":                               "root:x:0:\nsudo:x:27:user\nusers:x:100:user\nnogroup:x:65534:\nuser:x:1000:\n",
				"etc/sudoers.d/user":                      "user ALL=(ALL:ALL) NOPASSWD: ALL\n",
				"etc/pam.d/common-auth":                   "auth [success=1 default=ignore] pam_unix.so nullok\nauth requisite pam_deny.so\nauth required pam_permit.so\n",
				"etc/pam.d/common-account":                "account required pam_permit.so\n",
				"etc/pam.d/common-session":                "session required pam_permit.so\n",
				"etc/pam.d/common-session-noninteractive": "session required pam_permit.so\n",
				"etc/pam.d/common-password":               "password required pam_deny.so\n",
				"etc/hosts":                               "127.0.0.1 localhost\n",
			}
			for p, content := range files {
				mode := os.FileMode(0o644)
				if strings.HasPrefix(p, "etc/sudoers.d/") {
					mode = 0o440
				}
				if err := os.MkdirAll(filepath.Dir(filepath.Join(root, p)), 0o755); err != nil {
					return err
				}
				if err := os.WriteFile(filepath.Join(root, p), []byte(content), mode); err != nil {
					return err
				}
			}
			if fi, err := os.Stat(filepath.Join(root, "usr/bin/sudo")); err != nil || fi.Mode()&os.ModeSetuid == 0 {
				return fmt.Errorf("no setuid /usr/bin/sudo in the tree: %v", err)
			}
			home := filepath.Join(root, "home", "user")
			if err := os.MkdirAll(home, 0o755); err != nil {
				return err
			}
			return os.Chown(home, 1000, 1000)
		},
	})
}

// busyboxRootfs makes a minimal root: busybox and its applets (sh, httpd,
// nc, ...), /etc/passwd, /root and the usual directories. No bash: the
// SDK's "/bin/bash -l -c" runs with /bin/sh.
func busyboxRootfs(t *testing.T) string {
	t.Helper()
	root := t.TempDir()
	for _, d := range []string{"bin", "etc", "root", "tmp", "proc", "sys", "dev", "work"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	os.Chmod(filepath.Join(root, "tmp"), 0o1777)
	bb, err := exec.LookPath("busybox")
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(bb)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "bin", "busybox"), b, 0o755); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(bb, "--list").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, applet := range strings.Fields(string(out)) {
		if applet != "busybox" {
			os.Symlink("busybox", filepath.Join(root, "bin", applet))
		}
	}
	for p, content := range map[string]string{
		"etc/passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n",
		"etc/group":  "root:x:0:\nnogroup:x:65534:\n",
		"etc/hosts":  "127.0.0.1\tlocalhost\n",
	} {
		if err := os.WriteFile(filepath.Join(root, p), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

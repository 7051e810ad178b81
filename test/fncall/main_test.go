// Package fncall tests the FnCall backend end to end: a real `shoal serve`
// (runc, overlayfs, EROFS, cgroups) judging calls in python, bash, C, C++
// and Go, through the Go SDK and the CLI.
//
// The languages need a real toolchain in a layer. The tests make one from
// Debian's own packages: apt-get downloads python3, bash, coreutils, gcc,
// g++ and golang-go with their dependencies (for an empty system), dpkg-deb
// extracts them into one tree (merged /usr), and that tree becomes the
// base layer "fncall-test:1". The tree is cached under
// $SHOAL_TEST_CACHE (default /var/cache/shoal-test) keyed by the package
// list, so only the first run pays the download (~170 MB, seconds from
// deb.debian.org) and the extraction (~20 s); every run builds the layer
// (~10 s). Without root, runc, mkfs.erofs, apt-get or the archive, every
// test skips with the reason.
package fncall

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/fncall"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
	"github.com/shoal-sandbox/shoal/test/internal/debroot"
	"github.com/shoal-sandbox/shoal/test/internal/serveproc"
)

var (
	skipReason string
	binDir     string
	dataDir    string
	apiURL     string
	apiKey     string
	serveCmd   *exec.Cmd
	raceBuild  bool // set by race_test.go
)

// testBase is the base layer the test languages run on.
const testBase = "fncall-test:1"

// packages make the test toolchain (with their dependencies).
var packages = []string{"bash", "coreutils", "dash", "python3", "gcc", "g++", "golang-go"}

func TestMain(m *testing.M) {
	code := func() int {
		if err := setup(); err != nil {
			if skipReason == "" {
				fmt.Fprintln(os.Stderr, "fncall e2e setup:", err)
				return 1
			}
			fmt.Fprintln(os.Stderr, "fncall e2e: skipping:", skipReason)
		}
		defer teardown()
		code := m.Run()
		if b, _ := os.ReadFile(filepath.Join(dataDir, "serve.log")); bytes.Contains(b, []byte("DATA RACE")) {
			fmt.Fprintf(os.Stderr, "fncall e2e: the server reported a data race:\n%s\n", b)
			code = 1
		}
		return code
	}()
	os.Exit(code)
}

func need(t *testing.T) {
	t.Helper()
	if skipReason != "" {
		t.Skip(skipReason)
	}
}

func setup() error {
	if os.Geteuid() != 0 {
		skipReason = "needs root (runc, mounts, cgroups)"
		return errors.New(skipReason)
	}
	if why := debroot.Needs(); why != "" {
		skipReason = why
		return errors.New(skipReason)
	}
	for _, bin := range []string{"runc", "mkfs.erofs"} {
		if _, err := exec.LookPath(bin); err != nil {
			skipReason = "needs " + bin + " installed"
			return errors.New(skipReason)
		}
	}
	if _, err := os.Stat("/sys/fs/cgroup/memory/memory.max_usage_in_bytes"); err != nil {
		skipReason = "needs the cgroup v1 memory hierarchy (fncall does not support cgroup v2 alone yet)"
		return errors.New(skipReason)
	}
	t0 := time.Now()
	rootfs, err := toolchainRoot()
	if err != nil {
		skipReason = "cannot make the test toolchain from Debian packages: " + err.Error()
		return err
	}
	fmt.Fprintf(os.Stderr, "fncall e2e: toolchain tree ready in %s\n", time.Since(t0).Round(time.Millisecond))
	if binDir, err = os.MkdirTemp("", "shoal-fncall-bin"); err != nil {
		return err
	}
	shoalBuild := []string{"go", "build", "-o", filepath.Join(binDir, "shoal"), "../../cmd/shoal"}
	if raceBuild {
		shoalBuild = []string{"go", "build", "-race", "-o", filepath.Join(binDir, "shoal"), "../../cmd/shoal"}
	}
	for _, b := range [][]string{
		shoalBuild,
		{"go", "build", "-trimpath", "-o", filepath.Join(binDir, "shoal-agent"), "../../cmd/shoal-agent"},
	} {
		cmd := exec.Command(b[0], b[1:]...)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b[2] == "-race" {
			cmd.Env = append(os.Environ(), "CGO_ENABLED=1")
		}
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("%v: %v\n%s", b, err, out)
		}
	}
	if dataDir, err = os.MkdirTemp("/tmp", "sf"); err != nil { // short: socket paths live under it
		return err
	}
	if err := writeConfig(filepath.Join(dataDir, "fncall.json")); err != nil {
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
	t0 = time.Now()
	if out, code := run(nil, "layer", "build", "--kind", "base", testBase, rootfs); code != 0 {
		return fmt.Errorf("layer build: %s", out)
	}
	fmt.Fprintf(os.Stderr, "fncall e2e: layer built in %s\n", time.Since(t0).Round(time.Millisecond))
	return nil
}

// writeConfig gives the test server the default languages on the test
// base, small pools that shrink fast, and two calls at a time.
func writeConfig(path string) error {
	langs := fncall.DefaultLanguages()
	for i := range langs {
		langs[i].Base, langs[i].Toolkits = testBase, nil
	}
	// A language whose pool cannot warm a sandbox up (TestWarmUpFails).
	broken := langs[slices.IndexFunc(langs, func(l fncall.Language) bool { return l.Name == "bash" })]
	broken.Name, broken.Warm = "brokenwarm", []string{"/no/such/warm-up"}
	langs = append(langs, broken)
	b, err := json.MarshalIndent(fncall.ConfigFile{
		MaxConcurrent: 2, IdleTimeout: fncall.Duration(3 * time.Second), ReplaceDefaults: true, Languages: langs,
	}, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o644)
}

// toolchainRoot returns a root file system tree with the packages and
// their dependencies, extracted from Debian's archive (cached).
func toolchainRoot() (string, error) {
	return debroot.Make(debroot.Tree{Name: "fncall", Version: "v2", Packages: packages})
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
	serveCmd = exec.Command(filepath.Join(binDir, "shoal"), "serve", "--data", dataDir, "--listen", addr, "--debug")
	if out, _ := exec.Command(filepath.Join(binDir, "shoal"), "serve", "--help").CombinedOutput(); strings.Contains(string(out), "--e2b-listen") {
		serveCmd.Args = append(serveCmd.Args, "--e2b-listen=") // not needed here; its default port may be taken
	}
	serveCmd.Env = append(os.Environ(), "SHOAL_FNCALL_CONFIG="+filepath.Join(dataDir, "fncall.json"))
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

func teardown() {
	if serveCmd != nil && serveCmd.Process != nil {
		if c, err := shoal.New(shoal.Options{URL: apiURL, APIKey: apiKey}); err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			// Pool sandboxes hold run cgroups: stop the server first
			// (pools keep them), then delete the sandboxes, which a new
			// engine would also do.
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
}

func unmountUnder(dir string) {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	var ms []string
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			ms = append(ms, f[4])
		}
	}
	sort.Sort(sort.Reverse(sort.StringSlice(ms)))
	for _, m := range ms {
		syscall.Unmount(m, syscall.MNT_DETACH)
	}
}

// run runs the shoal CLI and returns its combined output and exit code.
func run(stdin []byte, args ...string) (string, int) {
	stdout, stderr, code := run3(stdin, args...)
	return stdout + stderr, code
}

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
	var ee *exec.ExitError
	if errors.As(err, &ee) {
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

package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestClientBuild: `-tags client` builds the CLI without any of the
// server's packages (only the API and the Go SDK of this module, with its
// subpackages), and its
// `serve` and `bench` execute shoal-server beside it with the same
// arguments, or say what is missing.
func TestClientBuild(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the CLI twice")
	}
	out, err := exec.Command("go", "list", "-deps", "-tags", "client", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for _, p := range strings.Fields(string(out)) {
		rest, ok := strings.CutPrefix(p, "github.com/shoal-sandbox/shoal/")
		if !ok || rest == "cmd/shoal" {
			continue
		}
		if !strings.HasPrefix(rest, "api/") && rest != "sdk/go" && !strings.HasPrefix(rest, "sdk/go/") {
			t.Errorf("the CLI-only build links %s: keep server code out of the client's files (or tag the file //go:build !client)", p)
		}
	}
	dir := t.TempDir()
	for _, b := range [][]string{
		{"go", "build", "-tags", "client", "-o", filepath.Join(dir, "shoal"), "."},
		{"go", "build", "-o", filepath.Join(dir, "shoal-server"), "."},
	} {
		if out, err := exec.Command(b[0], b[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v\n%s", b, err, out)
		}
	}
	// serve's own flags come back: shoal-server parsed them.
	out, err = exec.Command(filepath.Join(dir, "shoal"), "serve", "--help").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--launcher") || !strings.Contains(string(out), "Usage:\n  shoal serve") {
		t.Fatalf("shoal serve --help through the CLI-only build: %v\n%s", err, out)
	}
	// A bad flag is refused by serve, with its exit code.
	cmd := exec.Command(filepath.Join(dir, "shoal"), "bench", "create", "--no-such-flag")
	out, err = cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "no-such-flag") {
		t.Fatalf("bench with a bad flag: %v\n%s", err, out)
	}
	// Without shoal-server: a message that says what to build.
	if err := os.Remove(filepath.Join(dir, "shoal-server")); err != nil {
		t.Fatal(err)
	}
	cmd = exec.Command(filepath.Join(dir, "shoal"), "serve")
	cmd.Env = append(os.Environ(), "PATH="+dir)
	out, err = cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "shoal-server") {
		t.Fatalf("serve without shoal-server: %v\n%s", err, out)
	}
	// The client commands work without it.
	out, err = exec.Command(filepath.Join(dir, "shoal"), "ls", "--help").CombinedOutput()
	if err != nil {
		t.Fatalf("shoal ls --help: %v\n%s", err, out)
	}
}

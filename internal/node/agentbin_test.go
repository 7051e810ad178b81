package node

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestCheckAgentBinary builds the agent both ways: the static build is
// accepted, the cgo build (dynamically linked, as `go build ./cmd/...`
// makes it where a C compiler is installed) is refused with the fix.
func TestCheckAgentBinary(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the agent twice")
	}
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go toolchain on PATH")
	}
	dir := t.TempDir()
	build := func(name string, cgo string) string {
		out := filepath.Join(dir, name)
		cmd := exec.Command(goBin, "build", "-o", out, "github.com/shoal-sandbox/shoal/cmd/shoal-agent")
		cmd.Env = append(os.Environ(), "CGO_ENABLED="+cgo)
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go build (CGO_ENABLED=%s): %v\n%s", cgo, err, b)
		}
		return out
	}
	if err := CheckAgentBinary(build("static", "0")); err != nil {
		t.Errorf("static agent refused: %v", err)
	}
	if _, err := exec.LookPath("gcc"); err == nil {
		err := CheckAgentBinary(build("dynamic", "1"))
		if err == nil || !strings.Contains(err.Error(), "CGO_ENABLED=0") {
			t.Errorf("dynamic agent: %v, want a refusal naming the fix", err)
		}
	} else {
		t.Log("no C compiler: the cgo build is not tried")
	}
	script := filepath.Join(dir, "script")
	os.WriteFile(script, []byte("#!/bin/sh\n"), 0o755)
	if err := CheckAgentBinary(script); err == nil {
		t.Error("a shell script was accepted as the agent")
	}
}

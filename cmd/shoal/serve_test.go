//go:build !client

package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A relative --agent is resolved where serve starts: runc reads a bundle's
// mount source from the bundle directory, where "bin/shoal-agent" named
// nothing and every create failed.
func TestServeAgentPathMadeAbsolute(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "agent"), []byte("not an ELF"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Chdir(dir)
	cmd := serveCmd()
	cmd.SetArgs([]string{"--data", filepath.Join(dir, "data"), "--agent", "agent"})
	cmd.SilenceUsage, cmd.SilenceErrors = true, true
	err := cmd.Execute()
	want := "agent binary " + filepath.Join(dir, "agent") + ":"
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("serve --agent agent: %v, want an error naming %q", err, want)
	}
}

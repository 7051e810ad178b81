//go:build !client

package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
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

// A descriptor serve inherited without close-on-exec reaches none of its
// children (runc, QEMU, a sandbox's agent).
func TestServeInheritedDescriptorsCloseOnExec(t *testing.T) {
	fd, err := unix.Open(os.DevNull, unix.O_RDONLY, 0) // no O_CLOEXEC: as inherited
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := closeInheritedOnExec(); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("/bin/sh", "-c", "ls /proc/self/fd").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range strings.Fields(string(out)) {
		if f == strconv.Itoa(fd) {
			t.Fatalf("the child inherited descriptor %d: %s", fd, out)
		}
	}
}

// --zram-size defaults to auto (a zram swap on a host without swap: pause
// frees memory out of the box); a value that is neither auto nor a size is
// refused before serve touches the host.
func TestServeZramSizeFlag(t *testing.T) {
	cmd := serveCmd()
	if def := cmd.Flags().Lookup("zram-size").DefValue; def != "auto" {
		t.Errorf("--zram-size defaults to %q, want auto", def)
	}
	dir := t.TempDir()
	cmd.SetArgs([]string{"--data", filepath.Join(dir, "data"), "--zram-size", "lots"})
	cmd.SilenceUsage, cmd.SilenceErrors = true, true
	if err := cmd.Execute(); err == nil || !strings.Contains(err.Error(), `--zram-size "lots": want auto, 0 or a size such as 8GiB`) {
		t.Fatalf("serve --zram-size lots: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "data")); err == nil {
		t.Errorf("a refused config made the data dir")
	}
}

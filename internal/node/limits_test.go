package node

import (
	"io"
	"log/slog"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// TestRaiseNofile: a node started with a low open files limit raises its
// own, since it holds descriptors per sandbox: to NodeNofile (or
// fs.nr_open) with CAP_SYS_RESOURCE, else the soft limit to the hard one.
func TestRaiseNofile(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("raising rlimits needs root")
	}
	var saved unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &saved); err != nil {
		t.Fatal(err)
	}
	defer unix.Setrlimit(unix.RLIMIT_NOFILE, &saved)
	// Only the soft limit is lowered: without CAP_SYS_RESOURCE a lowered
	// hard limit could not be restored.
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: 256, Max: saved.Max}); err != nil {
		t.Fatal(err)
	}
	raiseNofile(slog.New(slog.NewTextHandler(io.Discard, nil)))
	want := uint64(NodeNofile)
	if n, err := readSysctl("/proc/sys/fs/nr_open"); err == nil && uint64(n) < want {
		want = uint64(n)
	}
	var rl unix.Rlimit
	unix.Getrlimit(unix.RLIMIT_NOFILE, &rl)
	if rl.Cur < min(want, rl.Max) || rl.Max < min(want, saved.Max) {
		t.Fatalf("NOFILE %d/%d after raiseNofile (was 256/%d), want %d", rl.Cur, rl.Max, saved.Max, want)
	}
	t.Logf("NOFILE %d/%d (hard limit raised: %v)", rl.Cur, rl.Max, rl.Max > saved.Max)
}

package procfs

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestKiB(t *testing.T) {
	free, ok1 := KiB("/proc/meminfo", "MemFree:")
	total, ok2 := KiB("/proc/meminfo", "MemTotal:")
	if !ok1 || !ok2 || free <= 0 || total < free {
		t.Errorf("MemFree %d (%v), MemTotal %d (%v)", free, ok1, total, ok2)
	}
	if rss, ok := KiB("/proc/self/status", "VmRSS:"); !ok || rss <= 0 {
		t.Errorf("VmRSS %d (%v)", rss, ok)
	}
	p := filepath.Join(t.TempDir(), "status")
	os.WriteFile(p, []byte("Name:\tx\nVmSwap:\t    1234 kB\nBad:\tlots kB\n"), 0o600)
	for _, c := range []struct {
		key string
		n   int64
		ok  bool
	}{{"VmSwap:", 1234, true}, {"Bad:", 0, false}, {"NoSuchField:", 0, false}} {
		if n, ok := KiB(p, c.key); n != c.n || ok != c.ok {
			t.Errorf("%s: %d %v, want %d %v", c.key, n, ok, c.n, c.ok)
		}
	}
	if _, ok := KiB(filepath.Join(t.TempDir(), "none"), "VmRSS:"); ok {
		t.Error("a missing file")
	}
}

func TestCgroup2(t *testing.T) {
	if g, err := Cgroup2("self"); err != nil || !strings.HasPrefix(g, "/") {
		t.Errorf("this process's cgroup v2 path %q, %v", g, err)
	}
	if _, err := Cgroup2("0"); err == nil {
		t.Error("a process that does not exist")
	}
}

func TestUnescapeMountinfo(t *testing.T) {
	for in, want := range map[string]string{
		`/a\040b\134c\01`: `/a b\c\01`, // a short escape at the end stays
		`/plain`:          `/plain`,
		`/x\011y\012`:     "/x\ty\n",
		`/end\04`:         `/end\04`,
	} {
		if got := UnescapeMountinfo(in); got != want {
			t.Errorf("UnescapeMountinfo(%q) = %q, want %q", in, got, want)
		}
	}
}

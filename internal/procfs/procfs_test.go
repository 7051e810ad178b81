package procfs

import (
	"os"
	"path/filepath"
	"slices"
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

func TestParseMountinfo(t *testing.T) {
	data := "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n" +
		"40 25 0:31 / /sys/fs/cgroup/memory rw,relatime shared:14 - cgroup cgroup rw,memory\n" +
		`41 36 0:50 / /var/lib/a\040b rw - overlay my\134src rw,lowerdir=/x` + "\n" +
		"42 36 0:51 / /tmp rw - tmpfs tmpfs\n" +
		"garbage line\n" +
		"x 1 0:1 / /y rw - tmpfs tmpfs rw\n"
	ms := ParseMountinfo(data)
	if len(ms) != 4 {
		t.Fatalf("got %d mounts, want 4: %+v", len(ms), ms)
	}
	m := ms[0]
	if m.ID != 36 || m.Parent != 35 || m.Dev != "98:0" || m.Root != "/mnt1" || m.Point != "/mnt2" ||
		!slices.Equal(m.Options, []string{"rw", "noatime"}) || !slices.Equal(m.Optional, []string{"master:1"}) ||
		m.FSType != "ext3" || m.Source != "/dev/root" || !slices.Equal(m.SuperOptions, []string{"rw", "errors=continue"}) {
		t.Errorf("first line: %+v", m)
	}
	if !slices.Contains(ms[1].SuperOptions, "memory") || ms[1].FSType != "cgroup" {
		t.Errorf("cgroup line: %+v", ms[1])
	}
	if ms[2].Point != "/var/lib/a b" || ms[2].Source != `my\src` || len(ms[2].Optional) != 0 {
		t.Errorf("escaped line: %+v", ms[2])
	}
	if ms[3].SuperOptions != nil {
		t.Errorf("no super options: %+v", ms[3])
	}
	self, err := Mountinfo("self")
	if err != nil || len(self) == 0 || !slices.ContainsFunc(self, func(m Mount) bool { return m.Point == "/" }) {
		t.Errorf("Mountinfo(self) = %d mounts, %v; want one at /", len(self), err)
	}
}

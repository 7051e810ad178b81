package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// usernsOrSkip skips when serve runs sandboxes without user namespaces
// (it says why in its log: a kernel without idmapped EROFS or overlayfs
// descriptors).
func usernsOrSkip(t *testing.T) {
	t.Helper()
	log, _ := os.ReadFile(filepath.Join(dataDir, "serve.log"))
	if i := strings.Index(string(log), "sandboxes run without user namespaces"); i >= 0 {
		line, _, _ := strings.Cut(string(log[i:]), "\n")
		t.Skip("serve: " + line)
	}
}

// TestUserNamespace: sandbox root is not host root. Its user namespace maps
// it to an unprivileged host range of its own; its processes and what it
// writes (by exec or through the files API) are owned on the host by that
// range; inside it is root with docker's capabilities over the files of
// its layers; the kernel's knobs and new namespaces or mounts stay refused.
func TestUserNamespace(t *testing.T) {
	need(t)
	usernsOrSkip(t)
	a, b := create(t), create(t)
	hostRoot := func(id string) int {
		f := strings.Fields(sh(t, id, "cat /proc/self/uid_map"))
		if len(f) != 3 || f[0] != "0" || f[1] == "0" || f[2] != "65536" {
			t.Fatalf("uid_map in %s: %q, want 0 mapped to an unprivileged host range of 65536 ids", id, f)
		}
		if g := strings.Fields(sh(t, id, "cat /proc/self/gid_map")); strings.Join(g, " ") != strings.Join(f, " ") {
			t.Errorf("gid_map %q, uid_map %q", g, f)
		}
		h, err := strconv.Atoi(f[1])
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	ha, hb := hostRoot(a), hostRoot(b)
	if ha == hb || ha < 65536 || hb < 65536 {
		t.Fatalf("host ranges %d and %d: want two distinct unprivileged ranges", ha, hb)
	}

	// Seen from the host, the agent and commands run as the range's root.
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", agentPid(t, a)))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(l, "Uid:"); ok {
			if f := strings.Fields(v); len(f) != 4 || f[0] != strconv.Itoa(ha) || f[1] != f[0] || f[2] != f[0] {
				t.Errorf("agent's host uids %q, want %d", f, ha)
			}
		}
	}
	sh(t, a, "sleep 1000 >/dev/null 2>&1 &")
	found := false
	for _, pid := range sandboxProcs(t, a) {
		var st syscall.Stat_t
		if err := syscall.Stat("/proc/"+pid, &st); err != nil {
			continue
		}
		if st.Uid == 0 {
			t.Errorf("sandbox process %s is host root", pid)
		}
		found = true
	}
	if !found {
		t.Fatal("no sandbox process seen from the host")
	}

	// Inside: root, docker's capabilities, the layer's files root's.
	if got := sh(t, a, "id -u; grep CapEff /proc/self/status; grep CapEff /proc/1/status; stat -c %u:%g /etc/passwd /bin/busybox /"); got != "0\nCapEff:\t00000000a80425fb\nCapEff:\t00000000a80425fb\n0:0\n0:0\n0:0\n" {
		t.Errorf("in the sandbox:\n%s", got)
	}
	// What it writes belongs to its range on the host.
	shoalOK(t, "exec", a, "--", "sh", "-c", "touch /work/by-exec && touch /work/by-1000 && chown 1000:1000 /work/by-1000")
	if _, stderr, code := run3([]byte("via the API"), "cp", "-", a+":/work/by-api"); code != 0 {
		t.Fatalf("cp: %s", stderr)
	}
	if got := sh(t, a, "stat -c %u /work/by-api /work/by-exec /work/by-1000"); got != "0\n0\n1000\n" {
		t.Errorf("owners in the sandbox: %q", got)
	}
	upper := upperOf(t, a)
	for name, want := range map[string]int{"work/by-api": ha, "work/by-exec": ha, "work/by-1000": ha + 1000, ".": ha} {
		var st syscall.Stat_t
		if err := syscall.Lstat(filepath.Join(upper, name), &st); err != nil {
			t.Fatal(err)
		}
		if int(st.Uid) != want || int(st.Gid) != want {
			t.Errorf("upper/%s is %d:%d on the host, want %d", name, st.Uid, st.Gid, want)
		}
	}

	// Still refused: the kernel's knobs, new namespaces, mounts.
	for _, script := range []string{
		"echo 1 > /proc/sys/kernel/sysrq",
		"echo 0 > /proc/sys/kernel/randomize_va_space",
		"echo 1 > /proc/sysrq-trigger",
		"unshare -U true",
		"unshare -m true",
		"mount -t tmpfs none /mnt",
		"mknod /tmp/sda b 8 0",
	} {
		if out, code := run(nil, "exec", a, "--", "sh", "-c", script+" 2>&1"); code == 0 {
			t.Errorf("%q succeeded in a sandbox: %s", script, out)
		}
	}
}

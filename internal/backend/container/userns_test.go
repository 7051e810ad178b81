package container

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/forkserver"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// TestUserNS: every sandbox, cold or pooled, runs in a user namespace of its
// own mapped to an unprivileged host range of its own; its layers' files
// are its root's, what it writes is owned on the host by its range, and it
// is as confined as before.
func TestUserNS(t *testing.T) {
	requireRoot(t)
	for _, pooled := range []bool{false, true} {
		t.Run(map[bool]string{false: "cold", true: "pooled"}[pooled], func(t *testing.T) {
			var b *Backend
			if pooled {
				b = newPoolBackend(t, t.TempDir(), 2)
				waitPool(t, b, 2)
			} else {
				b = newBackend(t)
			}
			if b.userns == nil {
				t.Skip("sandboxes run without user namespaces on this host (see the backend's warning)")
			}
			spec1, spec2 := poolSpec(t), poolSpec(t)
			h1, h2 := create(t, b, spec1), create(t, b, spec2)
			if pooled && (h1.Data["pooled"] != "true" || h2.Data["pooled"] != "true") {
				t.Fatalf("not claimed from the pool: %v %v", h1.Data, h2.Data)
			}
			for _, h := range []sandbox.Handle{h1, h2} {
				if h.IDMap == nil || h.IDMap.HostUID == 0 || h.IDMap.Size != usernsSize {
					t.Fatalf("handle idmap %+v", h.IDMap)
				}
			}
			if h1.IDMap.HostUID == h2.IDMap.HostUID {
				t.Fatalf("two sandboxes share the range %d", h1.IDMap.HostUID)
			}
			m := *h1.IDMap
			want := fmt.Sprintf("0 %d %d", m.HostUID, m.Size)
			for _, f := range []string{"uid_map", "gid_map"} {
				out, code := run(t, h1, "cat /proc/self/"+f)
				if got := strings.Join(strings.Fields(out), " "); code != 0 || got != want {
					t.Errorf("%s in the sandbox: %q, want %q", f, got, want)
				}
			}
			// The agent (and so every command) is an unprivileged host uid.
			pid := agentPID(t, b, h1)
			status, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
			if err != nil {
				t.Fatal(err)
			}
			if uids := strings.Fields(statusField(string(status), "Uid")); len(uids) != 4 || uids[0] != strconv.Itoa(int(m.HostUID)) || uids[1] != uids[0] {
				t.Errorf("agent's host uids %v, want %d", uids, m.HostUID)
			}
			// Inside, it is root with docker's capabilities; the layer's
			// files are root's.
			out, code := run(t, h1, "id -u; stat -c %u:%g /etc/lower-file /; touch /mine; mkdir -p /work; touch /work/u1000; chown 1000:1000 /work/u1000; stat -c %u /work/u1000")
			if code != 0 || strings.Fields(out)[0] != "0" || !strings.Contains(out, "0:0\n0:0\n") || !strings.HasSuffix(out, "1000\n") {
				t.Errorf("in the sandbox: %d %q", code, out)
			}
			checkConfined(t, h1)
			// In the upper on the host: the range's ids.
			upper := filepath.Join(h1.Data["dir"], upperDir)
			for name, uid := range map[string]uint32{"mine": m.HostUID, "work/u1000": m.HostUID + 1000, ".": m.HostUID} {
				var st unix.Stat_t
				if err := unix.Lstat(filepath.Join(upper, name), &st); err != nil {
					t.Fatal(err)
				}
				if st.Uid != uid || st.Gid != uid {
					t.Errorf("upper/%s owned by %d:%d on the host, want %d", name, st.Uid, st.Gid, uid)
				}
			}
			// The kernel's knobs stay out of reach.
			for _, script := range []string{
				"echo 1 > /proc/sys/kernel/sysrq",
				"echo 100 > /proc/sys/vm/swappiness",
				"cat /proc/1/environ >/dev/null && echo x > /sys/kernel/uevent_helper",
			} {
				if out, code := run(t, h1, script+" 2>&1"); code == 0 {
					t.Errorf("%q succeeded: %s", script, out)
				}
			}
			// The range is released with the sandbox.
			slot := int((m.HostUID - b.userns.base) / usernsSize)
			if _, err := os.Stat(b.userns.slotFile(slot)); err != nil {
				t.Fatalf("slot file: %v", err)
			}
			if err := b.Delete(context.Background(), h1); err != nil {
				t.Fatal(err)
			}
			// (Another test's backend may have taken it since.)
			if data, err := os.ReadFile(b.userns.slotFile(slot)); err == nil && strings.Contains(string(data), h1.Data["runc_id"]+"\n") {
				t.Errorf("slot %d still reserved after delete: %q", slot, data)
			}
		})
	}
}

// agentPID is the host pid of a sandbox's agent.
func agentPID(t *testing.T, b *Backend, h sandbox.Handle) int {
	t.Helper()
	dir := h.Data["dir"]
	if h.Data["pooled"] == "true" {
		dir = b.claimedDir(h.ID)
	}
	pid, err := strconv.Atoi(readTrim(t, filepath.Join(dir, pidFileName)))
	if err != nil {
		t.Fatal(err)
	}
	return pid
}

// TestUserNSOff: with user namespaces off, sandbox root is host root, as
// before.
func TestUserNSOff(t *testing.T) {
	requireRoot(t)
	b, err := New(Config{StateDir: t.TempDir(), CgroupParent: testCgroupParent, PoolSize: -1, UserNS: UserNSOff})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.agents.close) // the agent binary's tmpfs (agentcopy.go)
	h := create(t, b, poolSpec(t))
	if h.IDMap != nil {
		t.Fatalf("idmap %+v with user namespaces off", h.IDMap)
	}
	out, _ := run(t, h, "cat /proc/self/uid_map")
	if got := strings.Join(strings.Fields(out), " "); got != "0 0 4294967295" {
		t.Errorf("uid_map %q", got)
	}
}

// TestUserNSRangeOfAnotherProcess: a sandbox created by another process
// (the node before a restart) has its range released by Delete.
func TestUserNSRangeOfAnotherProcess(t *testing.T) {
	requireRoot(t)
	state := t.TempDir()
	b1, err := New(Config{StateDir: state, CgroupParent: testCgroupParent, PoolSize: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b1.agents.close) // the agent binary's tmpfs (agentcopy.go)
	if b1.userns == nil {
		t.Skip("sandboxes run without user namespaces on this host")
	}
	b2, err := New(Config{StateDir: state, CgroupParent: testCgroupParent, PoolSize: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b2.agents.close) // the agent binary's tmpfs (agentcopy.go)
	h, err := b1.Create(context.Background(), poolSpec(t))
	if err != nil {
		t.Fatal(err)
	}
	slot := int((h.IDMap.HostUID - b1.userns.base) / usernsSize)
	if err := b2.Delete(context.Background(), h); err != nil {
		t.Fatal(err)
	}
	if data, err := os.ReadFile(b1.userns.slotFile(slot)); err == nil && strings.Contains(string(data), h.ID+"\n") {
		t.Errorf("slot %d still reserved after another backend deleted its sandbox: %q", slot, data)
	}
}

// The user namespace of a slot made through the fork server (the node
// does not fork itself) is a user namespace that idmapped layers work
// with, for the slot's range; a fork server that does not start leaves the
// node's own fork.
func TestUsernsThroughForkServer(t *testing.T) {
	requireRoot(t)
	b := newBackend(t)
	if b.userns == nil {
		t.Skip("sandboxes run without user namespaces on this host (see the backend's warning)")
	}
	m := b.userns.idmap(3)
	for _, bin := range []string{agentBinary, "/bin/true"} {
		fs := forkserver.NewClient(bin)
		fd, err := newUserns(b.userns.helper, m, fs)
		if bin == "/bin/true" {
			if err == nil {
				unix.Close(fd)
				t.Fatal("a user namespace through /bin/true as a fork server")
			}
			fd, err = b.userns.nsFD(3, fs) // falls back on a fork of the node
		}
		if err != nil {
			fs.Close()
			t.Fatalf("%s: %v", bin, err)
		}
		if typ, err := unix.IoctlRetInt(fd, unix.NS_GET_NSTYPE); err != nil || typ != unix.CLONE_NEWUSER {
			t.Errorf("%s: namespace type %#x, %v", bin, typ, err)
		}
		if bin == agentBinary {
			if err := layer.ProbeIDMapped(t.TempDir(), fd, m.HostUID); err != nil {
				t.Errorf("idmapped mount with the fork server's namespace: %v", err)
			}
			unix.Close(fd)
		}
		fs.Close()
	}
}

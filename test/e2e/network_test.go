package e2e

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/vishvananda/netns"
)

// fakeInternet is a network namespace holding addresses outside every
// private range (TEST-NET-3), reached from the host through a veth: what a
// sandbox with egress may or may not reach.
type fakeInternet struct {
	ns     string
	hostIf string
}

const (
	fakeHostIP = "203.0.113.1" // the host's end
	fakeIP     = "203.0.113.2" // servers on 8080 and 8081
	fakeIP2    = "203.0.113.3" // a server on 8080
)

func newFakeInternet(t *testing.T) *fakeInternet {
	t.Helper()
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("needs ip (iproute2) for the fake internet's namespace")
	}
	var r [3]byte
	rand.Read(r[:])
	f := &fakeInternet{ns: "shoal-fake-" + hex.EncodeToString(r[:]), hostIf: "fk" + hex.EncodeToString(r[:])}
	ip := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	if out, err := exec.Command("ip", "netns", "add", f.ns).CombinedOutput(); err != nil {
		t.Skipf("cannot make a network namespace: %v: %s", err, out)
	}
	t.Cleanup(func() {
		exec.Command("ip", "link", "del", f.hostIf).Run()
		exec.Command("ip", "netns", "del", f.ns).Run()
	})
	ip("link", "add", f.hostIf, "type", "veth", "peer", "name", "eth0", "netns", f.ns)
	ip("addr", "add", fakeHostIP+"/24", "dev", f.hostIf)
	ip("link", "set", f.hostIf, "up")
	ip("-n", f.ns, "addr", "add", fakeIP+"/24", "dev", "eth0")
	ip("-n", f.ns, "addr", "add", fakeIP2+"/24", "dev", "eth0")
	ip("-n", f.ns, "link", "set", "eth0", "up")
	ip("-n", f.ns, "link", "set", "lo", "up")
	ip("-n", f.ns, "route", "add", "default", "via", fakeHostIP)
	for _, a := range []string{fakeIP + ":8080", fakeIP + ":8081", fakeIP2 + ":8080"} {
		f.serve(t, a)
	}
	return f
}

// serve answers "hello from ADDR" on addr, in the fake namespace.
func (f *fakeInternet) serve(t *testing.T, addr string) {
	t.Helper()
	ns, err := netns.GetFromName(f.ns)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	var ln net.Listener
	func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		orig, err := netns.Get()
		if err != nil {
			t.Fatal(err)
		}
		defer orig.Close()
		if err := netns.Set(ns); err != nil {
			t.Fatal(err)
		}
		ln, err = net.Listen("tcp", addr)
		if serr := netns.Set(orig); serr != nil {
			panic(serr) // this thread must not go back to the pool in the wrong namespace
		}
		if err != nil {
			t.Fatal(err)
		}
	}()
	t.Cleanup(func() { ln.Close() })
	go answer(ln, "hello from "+addr)
}

func answer(ln net.Listener, msg string) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		fmt.Fprintln(c, msg)
		c.Close()
	}
}

// reach tries to connect from a sandbox to each IP:PORT at once (busybox
// nc, 3 s to connect) and returns what each answered ("" when it could not
// connect).
func reach(t *testing.T, id string, targets ...string) map[string]string {
	t.Helper()
	var script strings.Builder
	for i, tg := range targets {
		h, p, _ := strings.Cut(tg, ":")
		fmt.Fprintf(&script, "(nc -w 3 %s %s </dev/null >/tmp/reach.%d 2>/dev/null) &\n", h, p, i)
	}
	script.WriteString("wait\n")
	for i := range targets {
		fmt.Fprintf(&script, "echo \"%d $(head -n1 /tmp/reach.%d)\"\n", i, i)
	}
	out := sh(t, id, script.String())
	got := map[string]string{}
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		var i int
		idx, rest, _ := strings.Cut(sc.Text(), " ")
		fmt.Sscan(idx, &i)
		got[targets[i]] = strings.TrimSpace(rest)
	}
	return got
}

// hostListener listens on every address of the host (root namespace).
func hostListener(t *testing.T) string {
	ln, err := net.Listen("tcp", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go answer(ln, "hello from the host")
	return fmt.Sprint(ln.Addr().(*net.TCPAddr).Port)
}

// egressTable is the nftables table of this run's serve.
func egressTable() *nftables.Table {
	sum := sha256.Sum256([]byte(filepath.Join(dataDir, "runc")))
	return &nftables.Table{Family: nftables.TableFamilyINet, Name: "shoal_" + hex.EncodeToString(sum[:2])}
}

// dispatchRules counts the nftables rules that send a sandbox's packets to
// its chain.
func dispatchRules(t *testing.T, id string) int {
	t.Helper()
	c, err := nftables.New()
	if err != nil {
		t.Fatal(err)
	}
	rules, err := c.GetRules(egressTable(), &nftables.Chain{Name: "from_sandbox", Table: egressTable()})
	if err != nil {
		return 0
	}
	n := 0
	for _, r := range rules {
		if string(r.UserData) == "sandbox:"+id {
			n++
		}
	}
	return n
}

func linkExists(name string) bool {
	return exec.Command("ip", "link", "show", name).Run() == nil
}

// hostIPs are the host's IPv4 addresses outside the egress subnet and
// loopback.
func hostIPs(t *testing.T) []string {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	_, sub, _ := net.ParseCIDR(egressSubnet)
	var out []string
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && !n.IP.IsLoopback() && !sub.Contains(n.IP) {
			out = append(out, n.IP.String())
		}
	}
	return out
}

func TestEgress(t *testing.T) {
	need(t)
	newFakeInternet(t)
	hostPort := hostListener(t)

	// No network by default: loopback only, nothing reachable.
	none := create(t)
	if out := sh(t, none, "ip -o link show | grep -v ': lo:' || true"); strings.TrimSpace(out) != "" {
		t.Errorf("a sandbox without egress has links besides lo: %s", out)
	}
	if got := reach(t, none, fakeIP+":8080"); got[fakeIP+":8080"] != "" {
		t.Errorf("a sandbox without egress reached the fake internet: %q", got)
	}

	// One address and port allowed: that, and nothing else.
	allowed := create(t, "--allow-out", fakeIP+":8080")
	inspect := sdkInspect(t, allowed)
	sbIP, hostIf := inspect["egress_addr"], inspect["egress_if"]
	if sbIP == "" || hostIf == "" || !linkExists(hostIf) {
		t.Fatalf("sandbox with egress: runtime %v, link %s exists: %v", inspect, hostIf, linkExists(hostIf))
	}
	hostEnd := net.ParseIP(sbIP).To4()
	hostEnd[3]--
	other := create(t, "--internet")
	otherIP := sdkInspect(t, other)["egress_addr"]
	sh(t, other, "(nc -lk -p 9000 -e echo hello from a sandbox </dev/null >/dev/null 2>&1 &)")

	checkAllowedOnly(t, "a sandbox", allowed, hostEnd.String(), hostPort, otherIP+":9000", "127.0.0.1:"+hostPort)

	// The internet: every public address, still not the host, other
	// sandboxes or metadata.
	targets := []string{fakeIP + ":8081", fakeIP2 + ":8080", "169.254.169.254:80", sbIP + ":9000", hostEnd.String() + ":" + hostPort}
	sh(t, allowed, "(nc -lk -p 9000 -e echo hello from a sandbox </dev/null >/dev/null 2>&1 &)")
	got := reach(t, other, targets...)
	for i, tg := range targets {
		want := ""
		if i < 2 {
			want = "hello from " + tg
		}
		if got[tg] != want {
			t.Errorf("sandbox with --internet reaching %s: got %q, want %q", tg, got[tg], want)
		}
	}
	if n := dispatchRules(t, allowed); n != 1 {
		t.Errorf("%d dispatch rules for sandbox %s, want 1", n, allowed)
	}

	// A restart of serve keeps it all: the link, the allowance, the rules.
	killServe()
	if err := startServe(); err != nil {
		t.Fatal(err)
	}
	got = reach(t, allowed, fakeIP+":8080", fakeIP+":8081")
	if got[fakeIP+":8080"] == "" || got[fakeIP+":8081"] != "" {
		t.Errorf("after a restart: %q", got)
	}

	// Delete removes the link and the rules.
	deleteAndCheckGone(t, allowed, hostIf)

	// Bad policies are refused before anything is made.
	for _, bad := range [][]string{{"--allow-out", "example.com"}, {"--allow-out", "2001:db8::1"}, {"--allow-out", "1.2.3.4:0"}} {
		out, code := run(nil, append([]string{"create", "--base", baseRef}, bad...)...)
		if code == 0 || !strings.Contains(out, "invalid") {
			t.Errorf("create %v: exit %d: %s", bad, code, out)
		}
	}
}

// checkAllowedOnly checks that sandbox id, allowed fakeIP:8080 only,
// reaches that and not the fake internet's other port or address, its
// link's host end, metadata, any of the host's addresses, nor the extra
// targets.
func checkAllowedOnly(t *testing.T, what, id, hostEnd, hostPort string, extra ...string) {
	t.Helper()
	targets := append([]string{fakeIP + ":8080", fakeIP + ":8081", fakeIP2 + ":8080", hostEnd + ":" + hostPort, "169.254.169.254:80"}, extra...)
	for _, ip := range hostIPs(t) {
		targets = append(targets, ip+":"+hostPort)
	}
	got := reach(t, id, targets...)
	for _, tg := range targets {
		want := ""
		if tg == fakeIP+":8080" {
			want = "hello from " + fakeIP + ":8080"
		}
		if got[tg] != want {
			t.Errorf("%s allowed %s:8080 reaching %s: got %q, want %q", what, fakeIP, tg, got[tg], want)
		}
	}
}

// deleteAndCheckGone deletes sandbox id and checks that its link (the host
// end hostIf) and its rules went with it.
func deleteAndCheckGone(t *testing.T, id, hostIf string) {
	t.Helper()
	shoalOK(t, "rm", id)
	// After the sandbox's teardown, which follows its delete (the reaper).
	if !eventually(teardownTimeout, func() bool { return !linkExists(hostIf) }) {
		t.Errorf("link %s of %s left after delete", hostIf, id)
	}
	if !eventually(teardownTimeout, func() bool { return dispatchRules(t, id) == 0 }) {
		t.Errorf("%d dispatch rules of %s left after delete", dispatchRules(t, id), id)
	}
}

func sdkInspect(t *testing.T, id string) map[string]string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sb, err := sdk(t).Get(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	return sb.Runtime
}

// A microVM with egress reaches what its policy allows and nothing else
// (the same rules as a container's, on its tap), keeps it across a pause
// (QEMU ends, the tap stays) and a resume; one without egress has no
// network device; a delete removes the tap and the rules. Skips when this
// node offers no microvm backend.
func TestMicroVMEgress(t *testing.T) {
	need(t)
	newFakeInternet(t)
	hostPort := hostListener(t)
	id := createMicroVM(t, "--allow-out", fakeIP+":8080")
	t.Cleanup(func() { run(nil, "rm", id) })
	inspect := sdkInspect(t, id)
	sbIP, hostIf := inspect["egress_addr"], inspect["egress_if"]
	if sbIP == "" || hostIf == "" || !linkExists(hostIf) {
		t.Fatalf("microVM with egress: runtime %v, link %s exists: %v", inspect, hostIf, linkExists(hostIf))
	}
	hostEnd := net.ParseIP(sbIP).To4()
	hostEnd[3]--
	checkAllowedOnly(t, "a microVM", id, hostEnd.String(), hostPort)
	if out := sh(t, id, "ls /sys/class/net; grep -c '"+sbIP+"' /proc/net/fib_trie"); !strings.Contains(out, "eth0") || strings.HasSuffix(strings.TrimSpace(out), "\n0") {
		t.Errorf("the guest's eth0 and its address %s: %q", sbIP, out)
	}
	if n := dispatchRules(t, id); n != 1 {
		t.Errorf("%d dispatch rules for microVM %s, want 1", n, id)
	}
	shoalOK(t, "pause", id)
	if !linkExists(hostIf) {
		t.Errorf("tap %s gone while its VM is paused", hostIf)
	}
	shoalOK(t, "resume", id)
	checkAllowedOnly(t, "a microVM after a pause and resume", id, hostEnd.String(), hostPort)

	// Without egress: no network device at all.
	none := createMicroVM(t)
	t.Cleanup(func() { run(nil, "rm", none) })
	if out := sh(t, none, "ls /sys/class/net"); strings.TrimSpace(out) != "lo" {
		t.Errorf("a microVM without egress has network devices: %q", out)
	}

	deleteAndCheckGone(t, id, hostIf)
}

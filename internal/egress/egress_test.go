package egress

import (
	"errors"
	"log/slog"
	"os"
	"testing"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"

	"github.com/shoal-sandbox/shoal/internal/netpolicy"
)

// dispatch counts the rules that send sandbox id's packets to its chain.
func dispatch(t *testing.T, e *Egress, id string) int {
	t.Helper()
	c, err := nftables.New()
	if err != nil {
		t.Fatal(err)
	}
	rules, err := c.GetRules(e.table, &nftables.Chain{Name: chainFrom, Table: e.table})
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

// Attach adds a sandbox's rules before its link is made (by the backend's
// connect, here a tap as a VM's), addresses the host's end and returns
// the handle's data; a connect that fails leaves nothing; Recover (a new
// process: the table rebuilt) adds the rules again from the data, LinkOf
// names the same link; Detach removes the link and the rules and frees
// the slot; Close drops the table once no sandbox has egress.
func TestAttachDetach(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (nftables, links)")
	}
	if _, err := nftables.New(); err != nil {
		t.Skipf("no nftables: %v", err)
	}
	instance := t.TempDir()
	e, err := New("10.251.0.0/24", instance, t.TempDir(), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	req := &netpolicy.Request{AllowOut: []string{"203.0.113.7:443"}}
	tap := func(l *Link) error {
		la := netlink.NewLinkAttrs()
		la.Name = l.HostIf
		if err := netlink.LinkAdd(&netlink.Tuntap{LinkAttrs: la, Mode: netlink.TUNTAP_MODE_TAP, Flags: netlink.TUNTAP_NO_PI}); err != nil {
			return err
		}
		return SetUpHostEnd(l)
	}

	// A connect that fails: no rules, no slot taken.
	if _, err := e.Attach("sb-fail", req, func(l *Link) error {
		if n := dispatch(t, e, "sb-fail"); n != 1 {
			t.Errorf("%d dispatch rules while connecting, want 1 (rules first)", n)
		}
		return errors.New("no link")
	}); err == nil {
		t.Fatal("attach with a failing connect succeeded")
	}
	if n := dispatch(t, e, "sb-fail"); n != 0 || e.alloc.InUse() != 0 {
		t.Fatalf("after a failed attach: %d rules, %d slots in use", n, e.alloc.InUse())
	}

	data, err := e.Attach("sb-1", req, tap)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Detach("sb-1", data) })
	if !Has(data) || data[DataAddr] == "" {
		t.Fatalf("data %v", data)
	}
	lk, err := netlink.LinkByName(data[DataIf])
	if err != nil {
		t.Fatal(err)
	}
	addrs, _ := netlink.AddrList(lk, netlink.FAMILY_V4)
	l, err := e.LinkOf("sb-1", data)
	if err != nil {
		t.Fatal(err)
	}
	if len(addrs) != 1 || addrs[0].IP.String() != l.HostIP.String() || l.SandboxIP.String() != data[DataAddr] {
		t.Errorf("host end %v, link %+v, data %v", addrs, l, data)
	}
	if n := dispatch(t, e, "sb-1"); n != 1 {
		t.Errorf("%d dispatch rules, want 1", n)
	}

	// Another process of the same node: the table rebuilt, the rules back.
	e2, err := New("10.251.0.0/24", instance, t.TempDir(), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	if n := dispatch(t, e2, "sb-1"); n != 0 {
		t.Errorf("%d dispatch rules after the rebuild, want 0 until Recover", n)
	}
	if err := e2.Recover("sb-1", data); err != nil {
		t.Fatal(err)
	}
	if n := dispatch(t, e2, "sb-1"); n != 1 || e2.alloc.InUse() != 1 {
		t.Errorf("after Recover: %d dispatch rules, %d slots", n, e2.alloc.InUse())
	}
	if err := e2.Close(); err != nil {
		t.Fatal(err)
	}
	if n := dispatch(t, e2, "sb-1"); n != 1 {
		t.Errorf("Close with a sandbox attached dropped its rules")
	}
	if err := e2.Detach("sb-1", data); err != nil {
		t.Fatal(err)
	}
	if _, err := netlink.LinkByName(data[DataIf]); err == nil {
		t.Errorf("link %s left after Detach", data[DataIf])
	}
	if n := dispatch(t, e2, "sb-1"); n != 0 || e2.alloc.InUse() != 0 {
		t.Errorf("after Detach: %d dispatch rules, %d slots", n, e2.alloc.InUse())
	}
	if err := e2.Close(); err != nil {
		t.Fatal(err)
	}
	c, _ := nftables.New()
	if _, err := c.ListTableOfFamily(e2.table.Name, e2.table.Family); err == nil {
		t.Errorf("table %s left after Close with no sandbox", e2.table.Name)
	}
}

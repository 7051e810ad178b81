package container

// Egress: opt-in network for a sandbox (internal/egress, shared by the
// node's backends; see internal/netpolicy for the model).
//
// A sandbox's network namespace holds only loopback, and pool containers
// are started before anyone knows what their sandbox will ask for, so
// egress is attached to the running container after its claim (or cold
// start), through its init's network namespace (/proc/PID/ns/net, opened
// and then checked to still belong to the init runc recorded): a veth
// pair, the host's end named by the egress link, the sandbox's end
// created straight in the sandbox's namespace as eth0 with its address
// and a default route via the host's end. The sandbox has no
// CAP_NET_ADMIN: it cannot change either.

import (
	"fmt"
	"net"
	"strconv"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/shoal-sandbox/shoal/internal/egress"
	"github.com/shoal-sandbox/shoal/internal/netpolicy"
)

// attachEgress gives the running sandbox (runc container runcID) its link
// and rules. On failure nothing of it is left.
func (b *Backend) attachEgress(id, runcID string, req *netpolicy.Request) (map[string]string, error) {
	return b.egress.Attach(id, req, func(l *egress.Link) error {
		ns, err := b.openNetns(runcID)
		if err != nil {
			return err
		}
		defer ns.Close()
		return makeVeth(l, ns)
	})
}

// openNetns opens the network namespace of the container's init, checked
// to be the process runc started (not a reused pid).
func (b *Backend) openNetns(runcID string) (netns.NsHandle, error) {
	pid, start, err := b.initProcess(runcID)
	if err != nil {
		return -1, fmt.Errorf("container init: %w", err)
	}
	ns, err := netns.GetFromPath("/proc/" + strconv.Itoa(pid) + "/ns/net")
	if err != nil {
		return -1, fmt.Errorf("open network namespace of pid %d: %w", pid, err)
	}
	now, dead, err := processStart(pid)
	if err != nil || dead || now != start {
		ns.Close()
		return -1, fmt.Errorf("container init (pid %d) is gone", pid)
	}
	return ns, nil
}

// makeVeth creates the veth pair, the sandbox's end straight in ns.
func makeVeth(l *egress.Link, ns netns.NsHandle) error {
	la := netlink.NewLinkAttrs()
	la.Name = l.HostIf
	veth := &netlink.Veth{LinkAttrs: la, PeerName: "eth0", PeerNamespace: netlink.NsFd(int(ns))}
	if err := netlink.LinkAdd(veth); err != nil {
		return fmt.Errorf("create veth %s: %w", l.HostIf, err)
	}
	if err := egress.SetUpHostEnd(l); err != nil {
		return err
	}
	nh, err := netlink.NewHandleAt(ns)
	if err != nil {
		return fmt.Errorf("netlink in the sandbox's namespace: %w", err)
	}
	defer nh.Close()
	sb, err := nh.LinkByName("eth0")
	if err != nil {
		return fmt.Errorf("sandbox eth0: %w", err)
	}
	if err := nh.AddrAdd(sb, &netlink.Addr{IPNet: egress.IPNet(l.SandboxIP)}); err != nil {
		return fmt.Errorf("sandbox address: %w", err)
	}
	if err := nh.LinkSetUp(sb); err != nil {
		return fmt.Errorf("set sandbox eth0 up: %w", err)
	}
	if err := nh.RouteAdd(&netlink.Route{LinkIndex: sb.Attrs().Index, Gw: net.IP(l.HostIP.AsSlice())}); err != nil {
		return fmt.Errorf("sandbox default route: %w", err)
	}
	return nil
}

package container

// Egress: opt-in network for a sandbox (see internal/netpolicy for the
// model).
//
// A sandbox's network namespace holds only loopback, and pool containers
// are started before anyone knows what their sandbox will ask for, so
// egress is attached to the running container after its claim (or cold
// start), through its init's network namespace (/proc/PID/ns/net, opened
// and then checked to still belong to the init runc recorded):
//
//   - a veth pair: the host's end "shxHHHHN" (HHHH: this backend's
//     instance, N: the link's slot) in the root namespace with the slot's
//     even address of the egress subnet, /31; the sandbox's end created
//     straight in the sandbox's namespace as eth0 with the odd address and
//     a default route via the host's end. The sandbox has no CAP_NET_ADMIN:
//     it cannot change either.
//   - nftables, in the table inet shoal_HHHH (rebuilt atomically when the
//     backend starts; each sandbox's rules added again by Recover):
//     input drops everything that comes in from a sandbox's veth (no host
//     service, at any host address, is reachable); forward sends what
//     comes from a sandbox to from_sandbox, which drops IPv6, the
//     always-forbidden ranges and the node subnet (other sandboxes), then
//     goes to the chain of the sandbox whose veth and source address the
//     packet has (a spoofed source matches none: dropped), which accepts
//     the sandbox's allowed ranges and drops the rest; what goes to a
//     sandbox's veth is accepted only as a reply (ct established/related);
//     postrouting masquerades the subnet out of any other interface.
//   - IPv4 forwarding (net.ipv4.ip_forward) is turned on at the first
//     egress sandbox. When it was off, the table inet shoal_guard drops
//     forwarding between the host's other interfaces, so the host routes
//     for sandboxes and nothing else; the original value is kept in
//     /run/shoal/ip_forward.orig.
//
// The allocation (slot, addresses, interface) and the policy are in the
// sandbox's handle, persisted by the node. Delete removes the veth (the
// kernel would on the namespace's end too), the sandbox's rules and frees
// the slot; a create whose attach fails is deleted whole.

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/netpolicy"
)

// DefaultEgressSubnet is the node subnet sandboxes' links are taken from.
const DefaultEgressSubnet = "10.88.0.0/16"

// Handle.Data keys of an egress sandbox.
const (
	dataEgressSlot   = "egress_slot"
	dataEgressIf     = "egress_if"
	dataEgressAddr   = "egress_addr"
	dataEgressPolicy = "egress_policy"
)

const (
	guardTable   = "shoal_guard"
	ifPrefixBase = "shx" // every instance's host-side veth names start with it
	chainFrom    = "from_sandbox"
	chainTo      = "to_sandbox"
)

// egress attaches and detaches sandboxes' networks; see the top of the file.
type egress struct {
	log      *slog.Logger
	alloc    *netpolicy.Allocator
	ifPrefix string // "shx" + 4 hex digits of the instance
	table    *nftables.Table
	runDir   string // where ip_forward.orig is kept

	mu      sync.Mutex // serializes rule changes
	built   bool       // guarded by mu: the table is this process's
	fwdDone bool       // guarded by mu: forwarding is on
}

// newEgress builds the backend's nftables table afresh (dropping the rules
// of an earlier process: Recover adds those of live sandboxes again) over
// the given subnet. instance names this backend (its state dir), so that
// several nodes on one host (tests) keep apart: give each its own subnet.
func newEgress(subnet, instance, runDir string, log *slog.Logger) (*egress, error) {
	pf, err := netip.ParsePrefix(subnet)
	if err != nil {
		return nil, fmt.Errorf("egress subnet %q: %w", subnet, err)
	}
	if pf.Masked() != pf {
		return nil, fmt.Errorf("egress subnet %s: host bits set (want %s)", pf, pf.Masked())
	}
	for _, f := range netpolicy.AlwaysForbidden {
		if f.Overlaps(pf) {
			return nil, fmt.Errorf("egress subnet %s overlaps %s", pf, f)
		}
	}
	alloc, err := netpolicy.NewAllocator(pf)
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256([]byte(instance))
	h := hex.EncodeToString(sum[:2])
	e := &egress{
		log:      log,
		alloc:    alloc,
		ifPrefix: ifPrefixBase + h,
		table:    &nftables.Table{Family: nftables.TableFamilyINet, Name: "shoal_" + h},
		runDir:   runDir,
	}
	// The table of an earlier process is rebuilt now (its sandboxes'
	// rules are added again by Recover); otherwise it is made by the first
	// egress sandbox, so that a node that never gives egress changes
	// nothing of the host's network.
	c, err := nftables.New()
	if err != nil {
		return nil, fmt.Errorf("egress: nftables: %w", err)
	}
	if _, err := c.ListTableOfFamily(e.table.Name, e.table.Family); err == nil {
		if err := e.buildTable(); err != nil {
			return nil, fmt.Errorf("egress: %w", err)
		}
		e.built = true
	}
	return e, nil
}

// ensure builds the table and turns forwarding on, once.
func (e *egress) ensure() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if !e.built {
		if err := e.buildTable(); err != nil {
			return err
		}
		e.built = true
	}
	return e.ensureForwarding()
}

// Interface-name matches: nft compares the bytes given, so a name without
// its NUL padding matches as a prefix.
func ifname(key expr.MetaKey, op expr.CmpOp, name string, exact bool) []expr.Any {
	data := []byte(name)
	if exact {
		data = make([]byte, unix.IFNAMSIZ)
		copy(data, name)
	}
	return []expr.Any{&expr.Meta{Key: key, Register: 1}, &expr.Cmp{Op: op, Register: 1, Data: data}}
}

func verdict(k expr.VerdictKind, chain string) *expr.Verdict {
	return &expr.Verdict{Kind: k, Chain: chain}
}

func be32(v uint32) []byte { return binary.BigEndian.AppendUint32(nil, v) }
func be16(v uint16) []byte { return binary.BigEndian.AppendUint16(nil, v) }

// ipField loads the IPv4 source (offset 12) or destination (16) address.
func ipField(off uint32) *expr.Payload {
	return &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: 4}
}

func ipv4Only() []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.NFPROTO_IPV4}},
	}
}

func daddrIn(r netpolicy.Range) []expr.Any {
	return []expr.Any{ipField(16), &expr.Range{Op: expr.CmpOpEq, Register: 1, FromData: be32(r.Lo), ToData: be32(r.Hi)}}
}

func prefixRange(pf netip.Prefix) netpolicy.Range {
	a := pf.Masked().Addr().As4()
	lo := binary.BigEndian.Uint32(a[:])
	return netpolicy.Range{Lo: lo, Hi: lo + uint32(uint64(1)<<(32-pf.Bits())-1)}
}

// baseRules are the table's fixed chains and rules (without the table).
func (e *egress) baseRules(c *nftables.Conn) {
	t := e.table
	accept := nftables.ChainPolicyAccept
	input := c.AddChain(&nftables.Chain{Name: "input", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter, Policy: &accept})
	forward := c.AddChain(&nftables.Chain{Name: "forward", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: &accept})
	post := c.AddChain(&nftables.Chain{Name: "postrouting", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource, Policy: &accept})
	from := c.AddChain(&nftables.Chain{Name: chainFrom, Table: t})
	to := c.AddChain(&nftables.Chain{Name: chainTo, Table: t})
	rule := func(ch *nftables.Chain, exprs ...any) {
		var out []expr.Any
		for _, x := range exprs {
			switch v := x.(type) {
			case expr.Any:
				out = append(out, v)
			case []expr.Any:
				out = append(out, v...)
			}
		}
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: out})
	}
	// No host service is reachable from a sandbox, at any host address.
	rule(input, ifname(expr.MetaKeyIIFNAME, expr.CmpOpEq, e.ifPrefix, false), verdict(expr.VerdictDrop, ""))
	rule(forward, ifname(expr.MetaKeyIIFNAME, expr.CmpOpEq, e.ifPrefix, false), verdict(expr.VerdictJump, chainFrom))
	rule(forward, ifname(expr.MetaKeyOIFNAME, expr.CmpOpEq, e.ifPrefix, false), verdict(expr.VerdictJump, chainTo))
	// Into a sandbox: replies only.
	rule(to, &expr.Ct{Register: 1, Key: expr.CtKeySTATE},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(expr.CtStateBitESTABLISHED | expr.CtStateBitRELATED), Xor: make([]byte, 4)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: make([]byte, 4)},
		verdict(expr.VerdictAccept, ""))
	rule(to, verdict(expr.VerdictDrop, ""))
	// Out of a sandbox: IPv4 only, never the forbidden ranges nor the node
	// subnet; then the sandbox's own chain (rules added per sandbox, before
	// the final drop, by attach).
	rule(from, &expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{unix.NFPROTO_IPV4}}, verdict(expr.VerdictDrop, ""))
	for _, pf := range append(append([]netip.Prefix(nil), netpolicy.AlwaysForbidden...), e.alloc.Subnet()) {
		rule(from, daddrIn(prefixRange(pf)), verdict(expr.VerdictDrop, ""))
	}
	rule(from, verdict(expr.VerdictDrop, "")) // stays last: per-sandbox rules are inserted before it
	// Masquerade the subnet out of every other interface.
	rule(post, ipv4Only(), ipField(12),
		&expr.Range{Op: expr.CmpOpEq, Register: 1, FromData: be32(prefixRange(e.alloc.Subnet()).Lo), ToData: be32(prefixRange(e.alloc.Subnet()).Hi)},
		ifname(expr.MetaKeyOIFNAME, expr.CmpOpNeq, e.ifPrefix, false), &expr.Masq{})
}

// buildTable replaces the table with its base chains, in one transaction.
func (e *egress) buildTable() error {
	c, err := nftables.New()
	if err != nil {
		return fmt.Errorf("nftables: %w", err)
	}
	c.AddTable(e.table) // so that the delete cannot fail
	c.DelTable(e.table)
	c.AddTable(e.table)
	e.baseRules(c)
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables: build table %s: %w", e.table.Name, err)
	}
	return nil
}

// close removes the table when no sandbox has egress (nothing to keep
// closed); otherwise the rules stay, closed, for the sandboxes that outlive
// this process.
func (e *egress) close() error {
	if e.alloc.InUse() > 0 {
		return nil
	}
	c, err := nftables.New()
	if err != nil {
		return err
	}
	c.DelTable(e.table)
	if err := c.Flush(); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("nftables: delete table %s: %w", e.table.Name, err)
	}
	return nil
}

// ensureForwarding turns IPv4 forwarding on (once per process), guarding
// the host's other interfaces when it was off.
func (e *egress) ensureForwarding() error {
	if e.fwdDone {
		return nil
	}
	const sysctl = "/proc/sys/net/ipv4/ip_forward"
	cur, err := os.ReadFile(sysctl)
	if err != nil {
		return fmt.Errorf("read %s: %w", sysctl, err)
	}
	orig := filepath.Join(e.runDir, "ip_forward.orig")
	if strings.TrimSpace(string(cur)) == "0" {
		if err := os.MkdirAll(e.runDir, 0o700); err != nil {
			return err
		}
		if err := os.WriteFile(orig, []byte("0\n"), 0o600); err != nil {
			return err
		}
	}
	if data, err := os.ReadFile(orig); err == nil && strings.TrimSpace(string(data)) == "0" {
		// Forwarding was off before Shoal: keep it off for everything but
		// sandboxes.
		if err := e.buildGuard(); err != nil {
			return err
		}
	}
	if strings.TrimSpace(string(cur)) != "1" {
		if err := os.WriteFile(sysctl, []byte("1\n"), 0o644); err != nil {
			return fmt.Errorf("enable IPv4 forwarding: %w", err)
		}
		e.log.Info("egress: IPv4 forwarding enabled (net.ipv4.ip_forward=1)")
	}
	e.fwdDone = true
	return nil
}

func (e *egress) buildGuard() error {
	c, err := nftables.New()
	if err != nil {
		return err
	}
	t := &nftables.Table{Family: nftables.TableFamilyINet, Name: guardTable}
	c.AddTable(t)
	c.DelTable(t)
	c.AddTable(t)
	accept := nftables.ChainPolicyAccept
	ch := c.AddChain(&nftables.Chain{Name: "forward", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: &accept})
	var ex []expr.Any
	ex = append(ex, ifname(expr.MetaKeyIIFNAME, expr.CmpOpNeq, ifPrefixBase, false)...)
	ex = append(ex, ifname(expr.MetaKeyOIFNAME, expr.CmpOpNeq, ifPrefixBase, false)...)
	ex = append(ex, verdict(expr.VerdictDrop, ""))
	c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: ex})
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables: build table %s: %w", guardTable, err)
	}
	return nil
}

// link is one sandbox's attachment.
type link struct {
	id      string
	slot    int
	hostIf  string
	hostIP  netip.Addr
	sbIP    netip.Addr
	allowed []netpolicy.Allowed
	policy  *netpolicy.Request
}

func (e *egress) linkFor(id string, slot int, req *netpolicy.Request) (*link, error) {
	pol, err := netpolicy.Parse(req)
	if err != nil {
		return nil, err
	}
	h, s := e.alloc.Addrs(slot)
	return &link{id: id, slot: slot, hostIf: e.ifPrefix + strconv.Itoa(slot), hostIP: h, sbIP: s,
		allowed: netpolicy.Compile(pol, e.alloc.Subnet()), policy: req}, nil
}

func (l *link) data() map[string]string {
	pol, _ := json.Marshal(l.policy)
	return map[string]string{
		dataEgressSlot:   strconv.Itoa(l.slot),
		dataEgressIf:     l.hostIf,
		dataEgressAddr:   l.sbIP.String(),
		dataEgressPolicy: string(pol),
	}
}

func sandboxChain(slot int) string { return "sb_" + strconv.Itoa(slot) }

// sandboxRules are the rules of a sandbox's chain: its allowances, then drop.
func sandboxRules(allowed []netpolicy.Allowed) [][]expr.Any {
	var out [][]expr.Any
	for _, a := range allowed {
		dst := daddrIn(a.Range)
		if a.PortLo == 0 {
			out = append(out, append(dst, verdict(expr.VerdictAccept, "")))
			continue
		}
		for _, proto := range []byte{unix.IPPROTO_TCP, unix.IPPROTO_UDP} {
			r := append([]expr.Any{}, dst...)
			r = append(r,
				&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
				&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}},
				&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
				&expr.Range{Op: expr.CmpOpEq, Register: 1, FromData: be16(a.PortLo), ToData: be16(a.PortHi)},
				verdict(expr.VerdictAccept, ""))
			out = append(out, r)
		}
	}
	return append(out, []expr.Any{verdict(expr.VerdictDrop, "")})
}

// addRules gives a sandbox its chain, and the dispatch to it (by veth and
// source address) before from_sandbox's final drop, in one transaction.
func (e *egress) addRules(l *link) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	c, err := nftables.New()
	if err != nil {
		return fmt.Errorf("nftables: %w", err)
	}
	from := &nftables.Chain{Name: chainFrom, Table: e.table}
	rules, err := c.GetRules(e.table, from)
	if err != nil {
		return fmt.Errorf("nftables: list %s: %w", chainFrom, err)
	}
	if len(rules) == 0 {
		return fmt.Errorf("nftables: chain %s of table %s is empty", chainFrom, e.table.Name)
	}
	final := rules[len(rules)-1]
	name := sandboxChain(l.slot)
	ch := c.AddChain(&nftables.Chain{Name: name, Table: e.table})
	c.FlushChain(ch)
	for _, r := range sandboxRules(l.allowed) {
		c.AddRule(&nftables.Rule{Table: e.table, Chain: ch, Exprs: r})
	}
	dispatch := ifname(expr.MetaKeyIIFNAME, expr.CmpOpEq, l.hostIf, true)
	dispatch = append(dispatch, ipField(12), &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: l.sbIP.AsSlice()},
		verdict(expr.VerdictGoto, name))
	c.InsertRule(&nftables.Rule{Table: e.table, Chain: from, Position: final.Handle, Exprs: dispatch, UserData: []byte("sandbox:" + l.id)})
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables: add rules of sandbox %s: %w", l.id, err)
	}
	return nil
}

// delRules removes a sandbox's dispatch rule and chain; what is already
// gone is not an error.
func (e *egress) delRules(id string, slot int) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	c, err := nftables.New()
	if err != nil {
		return fmt.Errorf("nftables: %w", err)
	}
	from := &nftables.Chain{Name: chainFrom, Table: e.table}
	rules, err := c.GetRules(e.table, from)
	if err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("nftables: list %s: %w", chainFrom, err)
	}
	for _, r := range rules {
		if string(r.UserData) == "sandbox:"+id {
			if err := c.DelRule(r); err != nil {
				return err
			}
		}
	}
	if err := c.Flush(); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("nftables: delete rules of sandbox %s: %w", id, err)
	}
	ch, err := c.ListChain(e.table, sandboxChain(slot))
	if err != nil {
		return nil // no chain
	}
	c.FlushChain(ch)
	c.DelChain(ch)
	if err := c.Flush(); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("nftables: delete chain of sandbox %s: %w", id, err)
	}
	return nil
}

// attach gives the running sandbox (runc container runcID) its link and
// rules. On failure nothing of it is left.
func (e *egress) attach(b *Backend, id, runcID string, req *netpolicy.Request) (data map[string]string, err error) {
	slot, err := e.alloc.Alloc(id)
	if err != nil {
		return nil, fmt.Errorf("%w%.0w", err, errdefs.ErrResourceExhausted)
	}
	l, err := e.linkFor(id, slot, req)
	if err != nil {
		e.alloc.Free(slot, id)
		return nil, err
	}
	defer func() {
		if err != nil {
			if derr := e.detach(id, l.data()); derr != nil {
				e.log.Error("undo egress", "sandbox_id", id, "err", derr)
			}
		}
	}()
	if err := e.ensure(); err != nil {
		return nil, err
	}
	// The rules first: the link never exists without them.
	if err := e.addRules(l); err != nil {
		return nil, err
	}
	ns, err := b.openNetns(runcID)
	if err != nil {
		return nil, err
	}
	defer ns.Close()
	if err := e.makeLink(l, ns); err != nil {
		return nil, err
	}
	return l.data(), nil
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

// makeLink creates the veth pair, the sandbox's end straight in ns.
func (e *egress) makeLink(l *link, ns netns.NsHandle) error {
	la := netlink.NewLinkAttrs()
	la.Name = l.hostIf
	veth := &netlink.Veth{LinkAttrs: la, PeerName: "eth0", PeerNamespace: netlink.NsFd(int(ns))}
	if err := netlink.LinkAdd(veth); err != nil {
		return fmt.Errorf("create veth %s: %w", l.hostIf, err)
	}
	host, err := netlink.LinkByName(l.hostIf)
	if err != nil {
		return fmt.Errorf("veth %s: %w", l.hostIf, err)
	}
	// No IPv6 on the host's end (the sandbox's is dropped anyway).
	os.WriteFile("/proc/sys/net/ipv6/conf/"+l.hostIf+"/disable_ipv6", []byte("1"), 0o644)
	if err := netlink.AddrAdd(host, &netlink.Addr{IPNet: ipnet(l.hostIP, 31)}); err != nil {
		return fmt.Errorf("address of %s: %w", l.hostIf, err)
	}
	if err := netlink.LinkSetUp(host); err != nil {
		return fmt.Errorf("set %s up: %w", l.hostIf, err)
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
	if err := nh.AddrAdd(sb, &netlink.Addr{IPNet: ipnet(l.sbIP, 31)}); err != nil {
		return fmt.Errorf("sandbox address: %w", err)
	}
	if err := nh.LinkSetUp(sb); err != nil {
		return fmt.Errorf("set sandbox eth0 up: %w", err)
	}
	if err := nh.RouteAdd(&netlink.Route{LinkIndex: sb.Attrs().Index, Gw: net.IP(l.hostIP.AsSlice())}); err != nil {
		return fmt.Errorf("sandbox default route: %w", err)
	}
	return nil
}

func ipnet(a netip.Addr, bits int) *net.IPNet {
	return &net.IPNet{IP: net.IP(a.AsSlice()), Mask: net.CIDRMask(bits, 32)}
}

// detach removes what attach made for a sandbox, from its handle's data;
// a sandbox without egress, or whose link is already gone, is not an error.
func (e *egress) detach(id string, data map[string]string) error {
	s, ok := data[dataEgressSlot]
	if !ok {
		return nil
	}
	slot, err := strconv.Atoi(s)
	if err != nil {
		return fmt.Errorf("egress slot %q: %w", s, err)
	}
	var errs []error
	if name := data[dataEgressIf]; strings.HasPrefix(name, e.ifPrefix) {
		if lk, err := netlink.LinkByName(name); err == nil {
			if err := netlink.LinkDel(lk); err != nil {
				errs = append(errs, fmt.Errorf("delete veth %s: %w", name, err))
			}
		}
	}
	if err := e.delRules(id, slot); err != nil {
		errs = append(errs, err)
	}
	if len(errs) == 0 {
		e.alloc.Free(slot, id)
	}
	return errors.Join(errs...)
}

// recover re-reserves a sandbox's slot and adds its rules again (the table
// was rebuilt when this process started).
func (e *egress) recover(id string, data map[string]string) error {
	s, ok := data[dataEgressSlot]
	if !ok {
		return nil
	}
	slot, err := strconv.Atoi(s)
	if err != nil {
		return fmt.Errorf("egress slot %q: %w", s, err)
	}
	var req netpolicy.Request
	if err := json.Unmarshal([]byte(data[dataEgressPolicy]), &req); err != nil {
		return fmt.Errorf("egress policy: %w", err)
	}
	if err := e.alloc.Reserve(slot, id); err != nil {
		return err
	}
	l, err := e.linkFor(id, slot, &req)
	if err != nil {
		return err
	}
	if l.hostIf != data[dataEgressIf] {
		return fmt.Errorf("egress link %s was made by another node instance (this one names it %s)", data[dataEgressIf], l.hostIf)
	}
	if err := e.ensure(); err != nil {
		return err
	}
	return e.addRules(l)
}

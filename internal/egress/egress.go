// Package egress gives sandboxes opt-in network egress (see
// internal/netpolicy for the model), whatever their backend.
//
// A sandbox holds only loopback until it asks for egress; then it gets a
// point-to-point link to the host that the backend makes (Attach's
// connect: a container's veth pair, its sandbox end straight in the
// container's network namespace; a VM's tap, which QEMU opens), addressed
// from the node's egress subnet:
//
//   - the host's end "shxHHHHN" (HHHH: this node instance, N: the link's
//     slot) in the root namespace with the slot's even address, /31; the
//     sandbox's end with the odd address and a default route via the
//     host's end. The sandbox cannot change the host's end.
//   - nftables, in the table inet shoal_HHHH (rebuilt atomically when the
//     node starts; each sandbox's rules added again by Recover): input
//     drops everything that comes in from a sandbox's link (no host
//     service, at any host address, is reachable); forward sends what
//     comes from a sandbox to from_sandbox, which drops IPv6, the
//     always-forbidden ranges and the node subnet (other sandboxes), then
//     goes to the chain of the sandbox whose link and source address the
//     packet has (a spoofed source matches none: dropped), which accepts
//     the sandbox's allowed ranges and drops the rest; what goes to a
//     sandbox's link is accepted only as a reply (ct established/related);
//     postrouting masquerades the subnet out of any other interface.
//   - IPv4 forwarding (net.ipv4.ip_forward) is turned on at the first
//     egress sandbox. When it was off, the table inet shoal_guard drops
//     forwarding between the host's other interfaces, so the host routes
//     for sandboxes and nothing else; the original value is kept in
//     /run/shoal/ip_forward.orig.
//
// The allocation (slot, addresses, interface) and the policy are in the
// sandbox's handle (Attach's data), persisted by the node. Detach removes
// the host's interface, the sandbox's rules and frees the slot; a create
// whose attach fails is deleted whole.
package egress

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
	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/netpolicy"
)

// DefaultSubnet is the node subnet sandboxes' links are taken from.
const DefaultSubnet = "10.88.0.0/16"

// Handle.Data keys of an egress sandbox (Attach returns them).
const (
	DataSlot   = "egress_slot"
	DataIf     = "egress_if"
	DataAddr   = "egress_addr"
	DataPolicy = "egress_policy"
)

const (
	guardTable   = "shoal_guard"
	ifPrefixBase = "shx" // every instance's host-side veth names start with it
	chainFrom    = "from_sandbox"
	chainTo      = "to_sandbox"
)

// Egress attaches and detaches sandboxes' networks; see the package
// comment. One serves every backend of a node (one allocator, one table).
type Egress struct {
	log      *slog.Logger
	alloc    *netpolicy.Allocator
	ifPrefix string // "shx" + 4 hex digits of the instance
	table    *nftables.Table
	runDir   string // where ip_forward.orig is kept

	mu      sync.Mutex // serializes rule changes
	built   bool       // guarded by mu: the table is this process's
	fwdDone bool       // guarded by mu: forwarding is on
}

// New builds the backend's nftables table afresh (dropping the rules
// of an earlier process: Recover adds those of live sandboxes again) over
// the given subnet. instance names this backend (its state dir), so that
// several nodes on one host (tests) keep apart: give each its own subnet.
func New(subnet, instance, runDir string, log *slog.Logger) (*Egress, error) {
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
	e := &Egress{
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
func (e *Egress) ensure() error {
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
func (e *Egress) baseRules(c *nftables.Conn) {
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
func (e *Egress) buildTable() error {
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

// Close removes the table when no sandbox has egress (nothing to keep
// closed); otherwise the rules stay, closed, for the sandboxes that outlive
// this process.
func (e *Egress) Close() error {
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
func (e *Egress) ensureForwarding() error {
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

func (e *Egress) buildGuard() error {
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

// Link is one sandbox's attachment: the host's end of its link (an
// interface the backend makes: a veth, a tap) and the two addresses.
type Link struct {
	ID        string
	Slot      int
	HostIf    string     // the host's interface, named by the node (its prefix is what the rules match)
	HostIP    netip.Addr // the host's end, the sandbox's gateway (/31)
	SandboxIP netip.Addr // the sandbox's address (/31)
	allowed   []netpolicy.Allowed
	policy    *netpolicy.Request
}

func (e *Egress) linkFor(id string, slot int, req *netpolicy.Request) (*Link, error) {
	pol, err := netpolicy.Parse(req)
	if err != nil {
		return nil, err
	}
	h, s := e.alloc.Addrs(slot)
	return &Link{ID: id, Slot: slot, HostIf: e.ifPrefix + strconv.Itoa(slot), HostIP: h, SandboxIP: s,
		allowed: netpolicy.Compile(pol, e.alloc.Subnet()), policy: req}, nil
}

func (l *Link) data() map[string]string {
	pol, _ := json.Marshal(l.policy)
	return map[string]string{
		DataSlot:   strconv.Itoa(l.Slot),
		DataIf:     l.HostIf,
		DataAddr:   l.SandboxIP.String(),
		DataPolicy: string(pol),
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
func (e *Egress) addRules(l *Link) error {
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
	name := sandboxChain(l.Slot)
	ch := c.AddChain(&nftables.Chain{Name: name, Table: e.table})
	c.FlushChain(ch)
	for _, r := range sandboxRules(l.allowed) {
		c.AddRule(&nftables.Rule{Table: e.table, Chain: ch, Exprs: r})
	}
	dispatch := ifname(expr.MetaKeyIIFNAME, expr.CmpOpEq, l.HostIf, true)
	dispatch = append(dispatch, ipField(12), &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: l.SandboxIP.AsSlice()},
		verdict(expr.VerdictGoto, name))
	c.InsertRule(&nftables.Rule{Table: e.table, Chain: from, Position: final.Handle, Exprs: dispatch, UserData: []byte("sandbox:" + l.ID)})
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables: add rules of sandbox %s: %w", l.ID, err)
	}
	return nil
}

// delRules removes a sandbox's dispatch rule and chain; what is already
// gone is not an error.
func (e *Egress) delRules(id string, slot int) error {
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

// IPNet is a link's address a with its /31 mask.
func IPNet(a netip.Addr) *net.IPNet {
	return &net.IPNet{IP: net.IP(a.AsSlice()), Mask: net.CIDRMask(31, 32)}
}

// Detach removes what Attach made for a sandbox, from its handle's data;
// a sandbox without egress, or whose link is already gone, is not an error.
func (e *Egress) Detach(id string, data map[string]string) error {
	s, ok := data[DataSlot]
	if !ok {
		return nil
	}
	slot, err := strconv.Atoi(s)
	if err != nil {
		return fmt.Errorf("egress slot %q: %w", s, err)
	}
	var errs []error
	if name := data[DataIf]; strings.HasPrefix(name, e.ifPrefix) {
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

// Recover re-reserves a sandbox's slot and adds its rules again (the table
// was rebuilt when this process started).
func (e *Egress) Recover(id string, data map[string]string) error {
	if !Has(data) {
		return nil
	}
	l, err := e.LinkOf(id, data)
	if err != nil {
		return err
	}
	if err := e.alloc.Reserve(l.Slot, id); err != nil {
		return err
	}
	if err := e.ensure(); err != nil {
		return err
	}
	return e.addRules(l)
}

// Attach gives sandbox id its link and rules: the rules first (the link
// never exists without them), then connect makes the host's interface
// l.HostIf and the sandbox's end, and SetUpHostEnd addresses the host's.
// It returns what goes into the sandbox's handle. On failure nothing of it
// is left.
func (e *Egress) Attach(id string, req *netpolicy.Request, connect func(l *Link) error) (data map[string]string, err error) {
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
			if derr := e.Detach(id, l.data()); derr != nil {
				e.log.Error("undo egress", "sandbox_id", id, "err", derr)
			}
		}
	}()
	if err := e.ensure(); err != nil {
		return nil, err
	}
	if err := e.addRules(l); err != nil {
		return nil, err
	}
	if err := connect(l); err != nil {
		return nil, err
	}
	return l.data(), nil
}

// SetUpHostEnd addresses the host's end of l (made by the backend) and
// sets it up, without IPv6 (the sandbox's is dropped anyway).
func SetUpHostEnd(l *Link) error {
	host, err := netlink.LinkByName(l.HostIf)
	if err != nil {
		return fmt.Errorf("link %s: %w", l.HostIf, err)
	}
	os.WriteFile("/proc/sys/net/ipv6/conf/"+l.HostIf+"/disable_ipv6", []byte("1"), 0o644)
	if err := netlink.AddrAdd(host, &netlink.Addr{IPNet: IPNet(l.HostIP)}); err != nil {
		return fmt.Errorf("address of %s: %w", l.HostIf, err)
	}
	if err := netlink.LinkSetUp(host); err != nil {
		return fmt.Errorf("set %s up: %w", l.HostIf, err)
	}
	return nil
}

// Has reports whether a sandbox's handle data has egress.
func Has(data map[string]string) bool { return data[DataSlot] != "" }

// LinkOf returns the link recorded in a sandbox's handle data (Attach's),
// for a backend that connects it again (a VM's new QEMU on resume).
func (e *Egress) LinkOf(id string, data map[string]string) (*Link, error) {
	slot, err := strconv.Atoi(data[DataSlot])
	if err != nil {
		return nil, fmt.Errorf("egress slot %q: %w", data[DataSlot], err)
	}
	var req netpolicy.Request
	if err := json.Unmarshal([]byte(data[DataPolicy]), &req); err != nil {
		return nil, fmt.Errorf("egress policy: %w", err)
	}
	l, err := e.linkFor(id, slot, &req)
	if err != nil {
		return nil, err
	}
	if l.HostIf != data[DataIf] {
		return nil, fmt.Errorf("egress link %s was made by another node instance (this one names it %s)", data[DataIf], l.HostIf)
	}
	return l, nil
}

// Package netpolicy is a sandbox's network egress policy: what a create
// asks for (Request: the public internet, CIDRs with optional ports, CIDRs
// denied), checked and bounded (Parse), and compiled into the address
// ranges a node lets the sandbox's packets go to (Compile). It also
// allocates each egress sandbox its point-to-point /31 from the node's
// egress subnet (Allocator). It is pure: no system calls; the container
// backend (internal/backend/container/network.go) realizes it with a veth
// pair and nftables.
//
// The model (README "Network"): a sandbox has no network but loopback
// unless its create asks for egress. Then packets may leave it only to the
// allowed ranges, IPv4 only, and never to
//
//   - the node's egress subnet (other sandboxes) nor any address of the host
//     (the node drops them before routing, whatever the policy says);
//   - the always-forbidden ranges (AlwaysForbidden: this network 0/8,
//     loopback, link-local 169.254/16 with cloud metadata services,
//     multicast, reserved and broadcast);
//   - private ranges (Private: RFC 1918, carrier-grade NAT, benchmarking)
//     unless an AllowOut entry names a range inside one of them: "the
//     internet" and 0.0.0.0/0 do not include the node's LAN.
package netpolicy

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
)

// Bounds of a request.
const (
	MaxEntries    = 64 // AllowOut and DenyOut, each
	maxEntryBytes = 64
)

// Request is the network part of a create, as the API carries it. The zero
// value (and nil) means no network: loopback only.
type Request struct {
	// Internet allows the public IPv4 internet: every address but the
	// always-forbidden and private ranges, and DenyOut.
	Internet bool `json:"internet,omitempty"`
	// AllowOut are "CIDR", "IP", "CIDR:PORT" or "CIDR:LOW-HIGH" (TCP and
	// UDP ports; no port: every protocol). They are allowed even when
	// DenyOut covers them (E2B's precedence), and may name private ranges.
	AllowOut []string `json:"allow_out,omitempty"`
	// DenyOut are CIDRs or IPs taken out of Internet.
	DenyOut []string `json:"deny_out,omitempty"`
}

// Egress reports whether the request asks for any network beyond loopback.
func (r *Request) Egress() bool {
	return r != nil && (r.Internet || len(r.AllowOut) > 0)
}

// Rule is one parsed AllowOut entry.
type Rule struct {
	Prefix         netip.Prefix
	PortLo, PortHi uint16 // 0, 0: any protocol and port
}

// Policy is a checked Request.
type Policy struct {
	Internet bool
	Allow    []Rule
	Deny     []netip.Prefix
}

// ErrInvalid wraps every error of Parse.
var ErrInvalid = errors.New("invalid network policy")

// Parse checks a request: at most MaxEntries entries of each list, each an
// IPv4 address or CIDR (with a port or port range for AllowOut). A nil
// request gives a zero Policy.
func Parse(r *Request) (Policy, error) {
	var p Policy
	if r == nil {
		return p, nil
	}
	if len(r.AllowOut) > MaxEntries || len(r.DenyOut) > MaxEntries {
		return p, fmt.Errorf("%w: at most %d allow_out and %d deny_out entries", ErrInvalid, MaxEntries, MaxEntries)
	}
	p.Internet = r.Internet
	for _, s := range r.AllowOut {
		rule, err := parseRule(s)
		if err != nil {
			return Policy{}, err
		}
		p.Allow = append(p.Allow, rule)
	}
	for _, s := range r.DenyOut {
		pf, err := parsePrefix(s)
		if err != nil {
			return Policy{}, fmt.Errorf("deny_out: %w", err)
		}
		p.Deny = append(p.Deny, pf)
	}
	return p, nil
}

func parseRule(s string) (Rule, error) {
	var r Rule
	addr, port, hasPort := s, "", false
	if i := strings.LastIndexByte(s, ':'); i >= 0 {
		addr, port, hasPort = s[:i], s[i+1:], true
	}
	pf, err := parsePrefix(addr)
	if err != nil {
		return r, fmt.Errorf("allow_out: %w", err)
	}
	r.Prefix = pf
	if hasPort {
		lo, hi := port, port
		if a, b, ok := strings.Cut(port, "-"); ok {
			lo, hi = a, b
		}
		l, err1 := strconv.ParseUint(lo, 10, 16)
		h, err2 := strconv.ParseUint(hi, 10, 16)
		if err1 != nil || err2 != nil || l == 0 || h < l {
			return r, fmt.Errorf("%w: allow_out %q: the port must be 1-65535 or a range LOW-HIGH", ErrInvalid, s)
		}
		r.PortLo, r.PortHi = uint16(l), uint16(h)
	}
	return r, nil
}

func parsePrefix(s string) (netip.Prefix, error) {
	if len(s) > maxEntryBytes {
		return netip.Prefix{}, fmt.Errorf("%w: entry longer than %d bytes", ErrInvalid, maxEntryBytes)
	}
	var pf netip.Prefix
	var err error
	if strings.Contains(s, "/") {
		pf, err = netip.ParsePrefix(s)
	} else {
		var a netip.Addr
		a, err = netip.ParseAddr(s)
		if err == nil {
			pf = netip.PrefixFrom(a, a.BitLen())
		}
	}
	if err != nil {
		return pf, fmt.Errorf("%w: %q is not an IPv4 address or CIDR (host names are not supported: give addresses)", ErrInvalid, s)
	}
	if !pf.Addr().Is4() {
		return pf, fmt.Errorf("%w: %q: only IPv4 egress is supported", ErrInvalid, s)
	}
	return pf.Masked(), nil
}

// Range is an inclusive range of IPv4 addresses, as numbers.
type Range struct{ Lo, Hi uint32 }

func (r Range) String() string {
	return addrOf(r.Lo).String() + "-" + addrOf(r.Hi).String()
}

// Allowed is one compiled allowance: destinations Lo-Hi, and TCP/UDP ports
// PortLo-PortHi (0, 0: every protocol and port).
type Allowed struct {
	Range
	PortLo, PortHi uint16
}

func (a Allowed) String() string {
	if a.PortLo == 0 {
		return a.Range.String()
	}
	return fmt.Sprintf("%s:%d-%d", a.Range, a.PortLo, a.PortHi)
}

func mustPrefixes(ss ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParsePrefix(s)
	}
	return out
}

var (
	// AlwaysForbidden are never reachable from a sandbox, whatever its
	// policy (the node drops them before looking at the policy).
	AlwaysForbidden = mustPrefixes("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4")
	// Private are reachable only through an AllowOut entry inside one of
	// them.
	Private = mustPrefixes("10.0.0.0/8", "100.64.0.0/10", "172.16.0.0/12", "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15")
)

// Compile turns a policy into the destination ranges a sandbox may reach
// from a node whose egress subnet is nodeSubnet: Internet (everything but
// AlwaysForbidden, Private, the node subnet and Deny) and each AllowOut rule
// (its range minus AlwaysForbidden, the node subnet and the Private ranges
// that do not contain it). The result is sorted and bounded by the input.
func Compile(p Policy, nodeSubnet netip.Prefix) []Allowed {
	hard := append(slices.Clone(AlwaysForbidden), nodeSubnet)
	var out []Allowed
	if p.Internet {
		excl := slices.Concat(hard, Private, p.Deny)
		for _, r := range subtract([]Range{{0, ^uint32(0)}}, excl) {
			out = append(out, Allowed{Range: r})
		}
	}
	for _, rule := range p.Allow {
		excl := slices.Clone(hard)
		for _, pv := range Private {
			if !(pv.Bits() <= rule.Prefix.Bits() && pv.Contains(rule.Prefix.Addr())) {
				excl = append(excl, pv)
			}
		}
		for _, r := range subtract([]Range{rangeOf(rule.Prefix)}, excl) {
			out = append(out, Allowed{Range: r, PortLo: rule.PortLo, PortHi: rule.PortHi})
		}
	}
	slices.SortFunc(out, func(a, b Allowed) int {
		switch {
		case a.Lo != b.Lo:
			return cmp(a.Lo, b.Lo)
		case a.PortLo != b.PortLo:
			return cmp(a.PortLo, b.PortLo)
		default:
			return cmp(a.Hi, b.Hi)
		}
	})
	return slices.Compact(out)
}

func cmp[T uint16 | uint32](a, b T) int {
	if a < b {
		return -1
	}
	if a > b {
		return 1
	}
	return 0
}

// subtract removes every prefix of excl from the ranges rs.
func subtract(rs []Range, excl []netip.Prefix) []Range {
	for _, pf := range excl {
		x := rangeOf(pf)
		var next []Range
		for _, r := range rs {
			if x.Hi < r.Lo || x.Lo > r.Hi {
				next = append(next, r)
				continue
			}
			if x.Lo > r.Lo {
				next = append(next, Range{r.Lo, x.Lo - 1})
			}
			if x.Hi < r.Hi {
				next = append(next, Range{x.Hi + 1, r.Hi})
			}
		}
		rs = next
	}
	return rs
}

func rangeOf(pf netip.Prefix) Range {
	a := pf.Masked().Addr().As4()
	lo := uint32(a[0])<<24 | uint32(a[1])<<16 | uint32(a[2])<<8 | uint32(a[3])
	size := uint64(1) << (32 - pf.Bits())
	return Range{lo, uint32(uint64(lo) + size - 1)}
}

func addrOf(v uint32) netip.Addr {
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

// Addr4 returns v as an address.
func Addr4(v uint32) netip.Addr { return addrOf(v) }

package netpolicy

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"
)

var node = netip.MustParsePrefix("10.88.0.0/16")

func compile(t *testing.T, r *Request) []string {
	t.Helper()
	p, err := Parse(r)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, a := range Compile(p, node) {
		out = append(out, a.String())
	}
	return out
}

func TestCompile(t *testing.T) {
	for _, tc := range []struct {
		name string
		req  Request
		want string
	}{
		{"one host and port", Request{AllowOut: []string{"203.0.113.7:8080"}}, "203.0.113.7-203.0.113.7:8080-8080"},
		{"a port range", Request{AllowOut: []string{"203.0.113.0/24:8000-8100"}}, "203.0.113.0-203.0.113.255:8000-8100"},
		{"explicit private range", Request{AllowOut: []string{"192.168.1.0/24"}}, "192.168.1.0-192.168.1.255"},
		{"metadata is never allowed", Request{AllowOut: []string{"169.254.169.254"}}, ""},
		{"the node subnet is never allowed", Request{AllowOut: []string{"10.88.0.4/30"}}, ""},
		{"a wide range loses the private ranges", Request{AllowOut: []string{"172.0.0.0/8:443"}},
			"172.0.0.0-172.15.255.255:443-443 172.32.0.0-172.255.255.255:443-443"},
		{"internet", Request{Internet: true},
			"1.0.0.0-9.255.255.255 11.0.0.0-100.63.255.255 100.128.0.0-126.255.255.255 128.0.0.0-169.253.255.255 " +
				"169.255.0.0-172.15.255.255 172.32.0.0-191.255.255.255 192.0.1.0-192.167.255.255 192.169.0.0-198.17.255.255 198.20.0.0-223.255.255.255"},
		{"internet minus a deny, plus an allow that wins", Request{Internet: true, DenyOut: []string{"128.0.0.0/1"}, AllowOut: []string{"203.0.113.9"}},
			"1.0.0.0-9.255.255.255 11.0.0.0-100.63.255.255 100.128.0.0-126.255.255.255 203.0.113.9-203.0.113.9"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := strings.Join(compile(t, &tc.req), " "); got != tc.want {
				t.Errorf("got  %s\nwant %s", got, tc.want)
			}
		})
	}
}

func TestParseRefuses(t *testing.T) {
	many := make([]string, MaxEntries+1)
	for i := range many {
		many[i] = fmt.Sprintf("203.0.113.%d", i)
	}
	for _, r := range []Request{
		{AllowOut: []string{"example.com"}},
		{AllowOut: []string{"2001:db8::1"}},
		{AllowOut: []string{"1.2.3.4:0"}},
		{AllowOut: []string{"1.2.3.4:70000"}},
		{AllowOut: []string{"1.2.3.4:90-80"}},
		{AllowOut: []string{"1.2.3.4/33"}},
		{DenyOut: []string{"1.2.3.4:80"}},
		{AllowOut: many},
		{AllowOut: []string{strings.Repeat("1", 100)}},
	} {
		if _, err := Parse(&r); !errors.Is(err, ErrInvalid) {
			t.Errorf("Parse(%v) = %v, want ErrInvalid", r, err)
		}
	}
}

func TestEgress(t *testing.T) {
	var nilReq *Request
	if nilReq.Egress() || (&Request{DenyOut: []string{"1.1.1.1"}}).Egress() {
		t.Error("egress without an allowance")
	}
	if !(&Request{Internet: true}).Egress() || !(&Request{AllowOut: []string{"1.1.1.1"}}).Egress() {
		t.Error("no egress with an allowance")
	}
}

func TestAllocator(t *testing.T) {
	a, err := NewAllocator(netip.MustParsePrefix("10.9.0.0/29")) // 4 links
	if err != nil {
		t.Fatal(err)
	}
	var slots []int
	for i := range 4 {
		s, err := a.Alloc(fmt.Sprint("sb", i))
		if err != nil {
			t.Fatal(err)
		}
		slots = append(slots, s)
	}
	if _, err := a.Alloc("sb4"); !errors.Is(err, ErrExhausted) {
		t.Fatalf("fifth alloc: %v, want ErrExhausted", err)
	}
	h, s := a.Addrs(slots[3])
	if h.String() != "10.9.0.6" || s.String() != "10.9.0.7" {
		t.Errorf("slot 3: %s %s", h, s)
	}
	a.Free(slots[1], "someone else")
	if _, err := a.Alloc("sb5"); err == nil {
		t.Fatal("a free by another id released the slot")
	}
	a.Free(slots[1], "sb1")
	if s, err := a.Alloc("sb5"); err != nil || s != slots[1] {
		t.Fatalf("after free: %d %v", s, err)
	}
	if err := a.Reserve(slots[0], "intruder"); err == nil {
		t.Fatal("reserved a held slot")
	}
	if err := a.Reserve(slots[0], "sb0"); err != nil {
		t.Fatal(err)
	}
	if _, err := NewAllocator(netip.MustParsePrefix("10.0.0.0/31")); err == nil {
		t.Fatal("a /31 subnet accepted")
	}
}

//go:build !client

package main

import (
	"net"
	"strings"
	"testing"
)

// TestE2BURL: what a node publishes as its E2B endpoint.
func TestE2BURL(t *testing.T) {
	tcp := func(s string) net.Addr { a, _ := net.ResolveTCPAddr("tcp", s); return a }
	for _, c := range []struct {
		advertise string
		addr      net.Addr
		want, err string
	}{
		{"", nil, "", ""}, // no E2B endpoint: none published
		{"", tcp("127.0.0.1:7481"), "http://127.0.0.1:7481", ""}, // where it listens
		{"", tcp("0.0.0.0:7481"), "", "give --e2b-advertise"},    // every address: which one?
		{"http://10.0.0.7:7481", tcp("0.0.0.0:7481"), "http://10.0.0.7:7481", ""},
		{"10.0.0.7:7481", tcp("0.0.0.0:7481"), "", "want http://HOST:PORT"},
		{"http://10.0.0.7:7481", nil, "", "serves no E2B endpoint"},
	} {
		cc := clusterConfig{E2BAdvertise: c.advertise}
		got, err := cc.e2bURL(c.addr)
		if got != c.want || (c.err == "") != (err == nil) || err != nil && !strings.Contains(err.Error(), c.err) {
			t.Errorf("e2bURL(advertise %q, %v) = %q, %v; want %q, error with %q", c.advertise, c.addr, got, err, c.want, c.err)
		}
	}
}

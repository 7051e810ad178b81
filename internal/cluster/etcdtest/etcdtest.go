// Package etcdtest runs an embedded etcd server for tests (etcd's embed
// package: the real server, in the test's process, on a free loopback
// port, its data in a temporary directory).
package etcdtest

import (
	"errors"
	"net"
	"net/url"
	"syscall"
	"testing"
	"time"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// Start starts an etcd server that stops with the test, and returns its
// client endpoint (http://127.0.0.1:PORT).
func Start(t testing.TB) string {
	t.Helper()
	return start(t, nil)
}

// TLS is what StartTLS's etcd serves with: its certificate and key, and
// the CA whose client certificates it requires (PEM files).
type TLS struct{ Cert, Key, ClientCA string }

// StartTLS is Start with TLS on the client endpoint (https://) and client
// certificates required (etcd's --client-cert-auth).
func StartTLS(t testing.TB, tls TLS) string {
	t.Helper()
	return start(t, &tls)
}

// startAttempts: the free ports are picked, closed, then bound by etcd,
// and another test process may bind one in between (seen in CI: "bind:
// address already in use"); etcd then starts again on other ports.
const startAttempts = 5

func start(t testing.TB, tls *TLS) string {
	for attempt := 1; ; attempt++ {
		url, err := startOnce(t, tls)
		if err == nil {
			return url
		}
		if attempt == startAttempts || !errors.Is(err, syscall.EADDRINUSE) {
			t.Fatalf("start embedded etcd: %v", err)
		}
		t.Logf("start embedded etcd (attempt %d): %v; again on other ports", attempt, err)
	}
}

func startOnce(t testing.TB, tls *TLS) (string, error) {
	cfg := embed.NewConfig()
	cfg.Dir = t.TempDir()
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop()) // its shutdown "errors" are noise
	client, peer := freeURL(t), freeURL(t)
	if tls != nil {
		client.Scheme = "https"
		cfg.ClientTLSInfo = transport.TLSInfo{CertFile: tls.Cert, KeyFile: tls.Key, TrustedCAFile: tls.ClientCA, ClientCertAuth: true}
	}
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{client}, []url.URL{client}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{peer}, []url.URL{peer}
	cfg.InitialCluster = cfg.Name + "=" + peer.String()
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return "", err
	}
	t.Cleanup(e.Close)
	select {
	case <-e.Server.ReadyNotify():
	case <-time.After(60 * time.Second):
		e.Server.Stop()
		t.Fatal("embedded etcd not ready within 60 s")
	}
	return client.String(), nil
}

func freeURL(t testing.TB) url.URL {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return url.URL{Scheme: "http", Host: addr}
}

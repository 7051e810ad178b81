package cluster_test

import (
	"context"
	"crypto/tls"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"connectrpc.com/connect"

	"github.com/shoal-sandbox/shoal/internal/pki"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// The cluster's TLS: one CA (made per run); etcd and the nodes serve with
// the node certificate (server and client: the nodes present it to etcd)
// and require client certificates of the CA; the control replicas present
// the control certificate to etcd and to the nodes, and serve their own
// API in plain HTTP (as behind a load balancer that terminates TLS). The
// test's own calls to nodes present the control certificate.
var (
	certs struct {
		ca                    string
		nodeCert, nodeKey     string
		clientCert, clientKey string
	}
	tlsAddrs sync.Map     // the addresses served over TLS (the nodes')
	apiHTTP  *http.Client // trusts the CA, presents the control certificate
)

func tlsSetup(t *testing.T) {
	t.Helper()
	dir := t.TempDir()
	ca, key, err := pki.LoadOrCreateCA(dir, "cluster test CA")
	if err != nil {
		t.Fatal(err)
	}
	certs.ca = filepath.Join(dir, pki.CACertFile)
	certs.nodeCert, certs.nodeKey = filepath.Join(dir, "node.pem"), filepath.Join(dir, "node.key")
	if err := pki.Issue(ca, key, "node", []string{"127.0.0.1", "localhost"}, pki.Server|pki.Client, certs.nodeCert, certs.nodeKey); err != nil {
		t.Fatal(err)
	}
	certs.clientCert, certs.clientKey = filepath.Join(dir, "control.pem"), filepath.Join(dir, "control.key")
	if err := pki.Issue(ca, key, "control", nil, pki.Client, certs.clientCert, certs.clientKey); err != nil {
		t.Fatal(err)
	}
	cfg, err := shoal.ClientTLS(certs.ca, certs.clientCert, certs.clientKey)
	if err != nil {
		t.Fatal(err)
	}
	apiHTTP = &http.Client{Transport: &http.Transport{TLSClientConfig: cfg, ForceAttemptHTTP2: true}}
}

// nodeTLS are a node's TLS flags; its address is served over TLS from now.
func nodeTLS(n *proc) []string {
	tlsAddrs.Store(n.addr, true)
	return []string{"--tls-cert", certs.nodeCert, "--tls-key", certs.nodeKey, "--tls-client-ca", certs.ca,
		"--etcd-ca", certs.ca, "--etcd-cert", certs.nodeCert, "--etcd-key", certs.nodeKey}
}

// controlTLS are a control replica's TLS flags.
func controlTLS() []string {
	return []string{"--cluster-ca", certs.ca, "--cluster-cert", certs.clientCert, "--cluster-key", certs.clientKey,
		"--etcd-ca", certs.ca, "--etcd-cert", certs.clientCert, "--etcd-key", certs.clientKey}
}

// apiURL is the URL of the API at addr.
func apiURL(addr string) string {
	if _, ok := tlsAddrs.Load(addr); ok {
		return "https://" + addr
	}
	return "http://" + addr
}

// cliEnv is the environment of the shoal CLI (and SDKs) for the API at
// addr.
func cliEnv(addr, key string) []string {
	return []string{"SHOAL_URL=" + apiURL(addr), "SHOAL_API_KEY=" + key,
		"SHOAL_CA=" + certs.ca, "SHOAL_CERT=" + certs.clientCert, "SHOAL_CERT_KEY=" + certs.clientKey}
}

// checkNodeTLS: a node's API and its E2B endpoint refuse a caller
// without a client certificate of the CA, and plain HTTP; their health
// checks need none. (The E2B suite through the replicas shows that they
// reach it.)
func checkNodeTLS(t *testing.T, ctx context.Context, n *proc, key string) {
	t.Helper()
	addr := n.addr
	noCert, err := shoal.New(shoal.Options{URL: "https://" + addr, APIKey: key, CAFile: certs.ca})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := noCert.List(ctx); connect.CodeOf(err) != connect.CodeUnauthenticated || !strings.Contains(err.Error(), "client certificate") {
		t.Errorf("a node's API without a client certificate: %v, want unauthenticated saying why", err)
	}
	plain, err := shoal.New(shoal.Options{URL: "http://" + addr, APIKey: key})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := plain.List(ctx); err == nil {
		t.Error("a node's API answered plain HTTP")
	}
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: noCertTLS(t)}}
	res, err := hc.Get("https://" + addr + "/healthz")
	if err != nil {
		t.Fatalf("a node's health check without a client certificate: %v", err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusOK {
		t.Errorf("a node's health check without a client certificate: %s, want 200", res.Status)
	}
	// Its E2B endpoint: the same.
	get := func(hc *http.Client, url string) (int, string) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		req.Header.Set("X-API-Key", key)
		res, err := hc.Do(req)
		if err != nil {
			return 0, err.Error()
		}
		defer res.Body.Close()
		var b strings.Builder
		io.Copy(&b, io.LimitReader(res.Body, 4096))
		return res.StatusCode, b.String()
	}
	if code, body := get(hc, "https://"+n.e2b+"/sandboxes"); code != http.StatusUnauthorized || !strings.Contains(body, "client certificate") {
		t.Errorf("a node's E2B endpoint without a client certificate: %d %s, want 401 saying why", code, body)
	}
	if code, body := get(apiHTTP, "https://"+n.e2b+"/sandboxes"); code != http.StatusOK {
		t.Errorf("a node's E2B endpoint with the control certificate: %d %s, want 200", code, body)
	}
	if code, _ := get(http.DefaultClient, "http://"+n.e2b+"/health"); code == http.StatusOK {
		t.Error("a node's E2B endpoint answered plain HTTP")
	}
	if code, body := get(hc, "https://"+n.e2b+"/health"); code != http.StatusOK {
		t.Errorf("a node's E2B health check without a client certificate: %d %s, want 200", code, body)
	}
}

func noCertTLS(t *testing.T) *tls.Config {
	cfg, err := shoal.ClientTLS(certs.ca, "", "")
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

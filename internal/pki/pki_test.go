package pki

import (
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// issue makes a CA in dir/NAME-ca and a certificate for name in dir.
func issue(t *testing.T, dir, caName, name string, usage Usage) (caFile, certFile, keyFile string) {
	t.Helper()
	caDir := filepath.Join(dir, caName)
	ca, key, err := LoadOrCreateCA(caDir, caName)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(dir, name+".pem"), filepath.Join(dir, name+".key")
	if err := Issue(ca, key, name, []string{"localhost", "127.0.0.1"}, usage, certFile, keyFile); err != nil {
		t.Fatal(err)
	}
	return filepath.Join(caDir, CACertFile), certFile, keyFile
}

// TestMutualTLS: a server that verifies client certificates of its CA
// sees a client holding one as verified, one without as unverified, and
// refuses one of another CA at the handshake; a client that does not
// trust the server's CA refuses it; plain HTTP is not served.
func TestMutualTLS(t *testing.T) {
	dir := t.TempDir()
	caFile, srvCert, srvKey := issue(t, dir, "cluster", "node", Server|Client)
	_, cliCert, cliKey := issue(t, dir, "cluster", "control", Client)
	otherCA, otherCert, otherKey := issue(t, dir, "other", "intruder", Client)

	cfg, err := ServerConfig(srvCert, srvKey, caFile)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if len(r.TLS.VerifiedChains) == 0 {
			io.WriteString(w, "unverified "+r.URL.Path)
			return
		}
		io.WriteString(w, "ok "+r.URL.Path)
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	url := "https://" + ln.Addr().String()

	get := func(caFile, certFile, keyFile, path string) (int, string, error) {
		t.Helper()
		ccfg, err := shoal.ClientTLS(caFile, certFile, keyFile)
		if err != nil {
			t.Fatal(err)
		}
		hc := &http.Client{Transport: &http.Transport{TLSClientConfig: ccfg}}
		defer hc.CloseIdleConnections()
		resp, err := hc.Get(url + path)
		if err != nil {
			return 0, "", err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b), nil
	}
	if code, body, err := get(caFile, cliCert, cliKey, "/api"); err != nil || code != 200 || body != "ok /api" {
		t.Errorf("with the CA's client certificate: %d %q %v, want 200", code, body, err)
	}
	// Without one, the handshake succeeds unverified (the API's
	// middleware refuses, but for health checks).
	if code, body, err := get(caFile, "", "", "/api"); err != nil || code != 200 || body != "unverified /api" {
		t.Errorf("without a client certificate: %d %q %v, want served unverified", code, body, err)
	}
	// (Go's client does not even send it: the server asks for its CA's.)
	if _, body, err := get(caFile, otherCert, otherKey, "/api"); err == nil && body != "unverified /api" {
		t.Errorf("a client certificate of another CA: %q, want unverified or refused", body)
	}
	// Sent anyway, it fails the handshake.
	other, err := tls.LoadX509KeyPair(otherCert, otherKey)
	if err != nil {
		t.Fatal(err)
	}
	forced, err := shoal.ClientTLS(caFile, "", "")
	if err != nil {
		t.Fatal(err)
	}
	forced.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &other, nil }
	if c, err := tls.Dial("tcp", ln.Addr().String(), forced); err == nil {
		err = c.Handshake()
		if err == nil {
			_, err = c.Read(make([]byte, 1)) // TLS 1.3: the server's refusal comes after
		}
		c.Close()
		if err == nil || !strings.Contains(err.Error(), "certificate") {
			t.Errorf("a forced client certificate of another CA: %v, want a certificate error", err)
		}
	}
	if _, _, err := get(otherCA, cliCert, cliKey, "/api"); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Errorf("a client not trusting the server's CA: %v, want a certificate error", err)
	}
	// Plain HTTP on the TLS port is not served.
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	io.WriteString(c, "GET /api HTTP/1.1\r\nHost: x\r\n\r\n")
	b, _ := io.ReadAll(c)
	c.Close()
	if strings.Contains(string(b), "ok /api") {
		t.Error("plain HTTP was served on the TLS port")
	}
}

// TestLoadOrCreateCert: the certificate is kept while it covers the hosts,
// made again when a host is added; the CA stays.
func TestLoadOrCreateCert(t *testing.T) {
	dir := t.TempDir()
	c1, err := LoadOrCreateCert(dir, "ca", "srv", []string{"localhost", "127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	ca1, _ := os.ReadFile(filepath.Join(dir, CACertFile))
	c2, err := LoadOrCreateCert(dir, "ca", "srv", []string{"localhost"})
	if err != nil {
		t.Fatal(err)
	}
	if c1.Leaf.SerialNumber.Cmp(c2.Leaf.SerialNumber) != 0 {
		t.Error("a certificate covering the hosts was made again")
	}
	c3, err := LoadOrCreateCert(dir, "ca", "srv", []string{"localhost", "*.example.test"})
	if err != nil {
		t.Fatal(err)
	}
	if c3.Leaf.SerialNumber.Cmp(c1.Leaf.SerialNumber) == 0 || !covers(c3.Leaf, []string{"*.example.test"}) {
		t.Error("a certificate not covering a new host was kept")
	}
	if ca3, _ := os.ReadFile(filepath.Join(dir, CACertFile)); string(ca3) != string(ca1) {
		t.Error("the CA was made again")
	}
	if st, err := os.Stat(filepath.Join(dir, "server.key")); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("server key mode: %v %v, want 0600", st.Mode(), err)
	}
}

// TestReload: a server's certificate renewed in place is served from the
// next handshake on, without a restart; a renewal caught half-written
// (a certificate without its key) keeps the last good one.
func TestReload(t *testing.T) {
	dir := t.TempDir()
	caFile, certFile, keyFile := issue(t, dir, "ca", "srv", Server)
	cfg, err := ServerConfig(certFile, keyFile, "")
	if err != nil {
		t.Fatal(err)
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.(*tls.Conn).Handshake()
			c.Close()
		}
	}()
	served := func() string {
		t.Helper()
		ccfg, err := shoal.ClientTLS(caFile, "", "")
		if err != nil {
			t.Fatal(err)
		}
		c, err := tls.Dial("tcp", ln.Addr().String(), ccfg)
		if err != nil {
			t.Fatalf("handshake: %v", err)
		}
		defer c.Close()
		return c.ConnectionState().PeerCertificates[0].SerialNumber.String()
	}
	first := served()
	if again := served(); again != first {
		t.Fatalf("the certificate changed without a renewal: %s then %s", first, again)
	}
	issue(t, dir, "ca", "srv", Server) // renewed in place
	renewed := served()
	if renewed == first {
		t.Fatal("the renewed certificate was not served")
	}
	// Half-written: a new certificate, the old key. The last good stays.
	other := t.TempDir()
	_, otherCert, _ := issue(t, other, "ca", "srv", Server)
	b, _ := os.ReadFile(otherCert)
	if err := os.WriteFile(certFile, b, 0o644); err != nil {
		t.Fatal(err)
	}
	if got := served(); got != renewed {
		t.Errorf("a mismatched certificate and key: served %s, want the last good %s", got, renewed)
	}
}

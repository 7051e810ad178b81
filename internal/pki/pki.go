// Package pki makes and loads the TLS material of Shoal's APIs: a CA, the
// certificates it signs (for servers, clients, or both), and the TLS
// configurations of a server that may require client certificates and of
// a client (the SDK's ClientTLS).
//
// The E2B endpoint signs its own certificates with a CA made at first start
// (LoadOrCreateCert); the Shoal API and the links between control replicas,
// nodes and etcd use files an operator provides (`shoal tls ca`, `shoal tls
// cert`, or any CA of theirs).
package pki

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Files of a CA directory.
const (
	CACertFile = "ca.pem"
	CAKeyFile  = "ca.key"
)

// Validity of what this package makes.
const (
	CAValidity   = 10 * 365 * 24 * time.Hour
	CertValidity = 365 * 24 * time.Hour
	// renewBefore: a certificate LoadOrCreate* finds expiring within this
	// is made again.
	renewBefore = 30 * 24 * time.Hour
)

// Usage says what a certificate may authenticate.
type Usage int

const (
	Server Usage = 1 << iota // a TLS server (serverAuth)
	Client                   // a TLS client (clientAuth)
)

// LoadOrCreateCA returns the CA in dir (ca.pem, ca.key), creating it (name
// its common name) when missing or expiring.
func LoadOrCreateCA(dir, name string) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, nil, err
	}
	certPath, keyPath := filepath.Join(dir, CACertFile), filepath.Join(dir, CAKeyFile)
	if c, err := tls.LoadX509KeyPair(certPath, keyPath); err == nil && c.Leaf != nil && time.Until(c.Leaf.NotAfter) > renewBefore {
		if k, ok := c.PrivateKey.(*ecdsa.PrivateKey); ok {
			return c.Leaf, k, nil
		}
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: name, Organization: []string{"Shoal"}},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(CAValidity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, fmt.Errorf("create CA %q: %w", name, err)
	}
	if err := writeKey(keyPath, key); err != nil {
		return nil, nil, err
	}
	if err := writePEM(certPath, "CERTIFICATE", der, 0o644); err != nil {
		return nil, nil, err
	}
	cert, err := x509.ParseCertificate(der)
	return cert, key, err
}

// Issue signs a certificate for name with the CA, valid for hosts (DNS
// names, wildcards, IP addresses; a server's) and usage, and writes it and
// its key to certPath (0644) and keyPath (0600).
func Issue(ca *x509.Certificate, caKey *ecdsa.PrivateKey, name string, hosts []string, usage Usage, certPath, keyPath string) error {
	if usage == 0 {
		return errors.New("issue certificate: no usage (server, client or both)")
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(CertValidity),
		KeyUsage:     x509.KeyUsageDigitalSignature,
	}
	if usage&Server != 0 {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
	}
	if usage&Client != 0 {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageClientAuth)
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else if h != "" && !slices.Contains(tmpl.DNSNames, h) {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return fmt.Errorf("sign certificate %q: %w", name, err)
	}
	if err := writeKey(keyPath, key); err != nil {
		return err
	}
	return writePEM(certPath, "CERTIFICATE", der, 0o644)
}

// LoadOrCreateCert returns a server certificate for hosts signed by the CA
// in dir (made with caName when missing), making the certificate
// (dir/server.pem, server.key) again when it is missing, expiring, does
// not cover every host or is not the CA's.
func LoadOrCreateCert(dir, caName, name string, hosts []string) (tls.Certificate, error) {
	ca, caKey, err := LoadOrCreateCA(dir, caName)
	if err != nil {
		return tls.Certificate{}, err
	}
	certPath, keyPath := filepath.Join(dir, "server.pem"), filepath.Join(dir, "server.key")
	if c, err := tls.LoadX509KeyPair(certPath, keyPath); err == nil && c.Leaf != nil &&
		time.Until(c.Leaf.NotAfter) > renewBefore && covers(c.Leaf, hosts) && c.Leaf.CheckSignatureFrom(ca) == nil {
		return c, nil
	}
	if err := Issue(ca, caKey, name, hosts, Server, certPath, keyPath); err != nil {
		return tls.Certificate{}, err
	}
	return tls.LoadX509KeyPair(certPath, keyPath)
}

// ServerConfig is the TLS configuration of an API served with the
// certificate certFile and key keyFile (HTTP/2 and HTTP/1.1). With
// clientCAFile, clients may present a certificate signed by that CA, which
// is verified (control.RequireClientCert refuses requests without one).
// The files are read again at the next handshake after they change (see
// Watched): a renewed certificate needs no restart.
func ServerConfig(certFile, keyFile, clientCAFile string) (*tls.Config, error) {
	cert := KeyPair(certFile, keyFile)
	if _, err := cert.Get(); err != nil {
		return nil, err
	}
	base := &tls.Config{NextProtos: []string{"h2", "http/1.1"}, MinVersion: tls.VersionTLS12}
	var pool *Watched[*x509.CertPool]
	if clientCAFile != "" {
		pool = NewWatched([]string{clientCAFile}, func() (*x509.CertPool, error) { return loadPool(clientCAFile) })
		if _, err := pool.Get(); err != nil {
			return nil, err
		}
		// Verified when given; required by the API's middleware
		// (control.RequireClientCert), which lets health checks (load
		// balancers, kubelets) in without one.
		base.ClientAuth = tls.VerifyClientCertIfGiven
	}
	cfg := base.Clone()
	cfg.GetConfigForClient = func(*tls.ClientHelloInfo) (*tls.Config, error) {
		c := base.Clone()
		kp, err := cert.Get()
		if err != nil {
			return nil, err
		}
		c.Certificates = []tls.Certificate{*kp}
		if pool != nil {
			if c.ClientCAs, err = pool.Get(); err != nil {
				return nil, err
			}
		}
		return c, nil
	}
	return cfg, nil
}

// KeyPair is the certificate certFile with its key keyFile, read again
// when they change.
func KeyPair(certFile, keyFile string) *Watched[*tls.Certificate] {
	return NewWatched([]string{certFile, keyFile}, func() (*tls.Certificate, error) {
		c, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("TLS certificate %s and key %s: %w", certFile, keyFile, err)
		}
		return &c, nil
	})
}

// ReloadClientCert makes cfg present certFile (with keyFile) read again
// when the files change, instead of the certificate loaded once.
func ReloadClientCert(cfg *tls.Config, certFile, keyFile string) {
	if cfg == nil || certFile == "" {
		return
	}
	kp := KeyPair(certFile, keyFile)
	cfg.Certificates = nil
	cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return kp.Get() }
}

// Watched is a value loaded from files and loaded again when one of them
// changes (size, modification time or inode): certificates renewed in
// place (by an operator, cert-manager, `shoal tls cert`) take effect at
// the next handshake. While a changed set does not load (a certificate
// written before its key), the last good value stays and the load is
// tried again at the next Get.
type Watched[T any] struct {
	files []string
	load  func() (T, error)
	mu    sync.Mutex
	stamp string // of the files the value was loaded from; "" before the first load
	val   T
}

// NewWatched returns the value of files as load makes it.
func NewWatched[T any](files []string, load func() (T, error)) *Watched[T] {
	return &Watched[T]{files: files, load: load}
}

// Get returns the value, loading it again when the files changed.
func (w *Watched[T]) Get() (T, error) {
	stamp := fileStamp(w.files)
	w.mu.Lock()
	defer w.mu.Unlock()
	if stamp != w.stamp {
		v, err := w.load()
		if err != nil {
			if w.stamp == "" {
				return v, err
			}
			return w.val, nil
		}
		w.val, w.stamp = v, stamp
	}
	return w.val, nil
}

func fileStamp(files []string) string {
	var b strings.Builder
	for _, f := range files {
		var st syscall.Stat_t
		if err := syscall.Stat(f, &st); err != nil {
			b.WriteString("missing;")
			continue
		}
		fmt.Fprintf(&b, "%d:%d:%d.%d;", st.Ino, st.Size, st.Mtim.Sec, st.Mtim.Nsec)
	}
	return b.String()
}

// loadPool reads the PEM certificates of file (the client side is the
// SDK's ClientTLS).
func loadPool(file string) (*x509.CertPool, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("CA certificates: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(b) {
		return nil, fmt.Errorf("CA certificates %s: no PEM certificate in it", file)
	}
	return pool, nil
}

func covers(c *x509.Certificate, hosts []string) bool {
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			if !slices.ContainsFunc(c.IPAddresses, func(x net.IP) bool { return x.Equal(ip) }) {
				return false
			}
		} else if !slices.Contains(c.DNSNames, h) {
			return false
		}
	}
	return true
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	return n
}

func writeKey(path string, key *ecdsa.PrivateKey) error {
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	return writePEM(path, "EC PRIVATE KEY", kb, 0o600)
}

// writePEM writes the file whole or not at all (a temporary file renamed).
func writePEM(path, typ string, der []byte, mode os.FileMode) error {
	var buf bytes.Buffer
	pem.Encode(&buf, &pem.Block{Type: typ, Bytes: der})
	tmp := path + ".tmp"
	os.Remove(tmp) // a leftover keeps its mode through WriteFile
	if err := os.WriteFile(tmp, buf.Bytes(), mode); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

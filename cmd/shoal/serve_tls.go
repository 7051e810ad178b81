//go:build !client

package main

// TLS of the API (every role) and of a cluster's links: control replicas
// to nodes and to each other (--cluster-ca, --cluster-cert), and every
// member to etcd (--etcd-ca, --etcd-cert).

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"

	"github.com/spf13/cobra"

	"github.com/shoal-sandbox/shoal/internal/control"
	"github.com/shoal-sandbox/shoal/internal/pki"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// apiTLS: the API served over TLS, and whether clients must present a
// certificate.
type apiTLS struct {
	Cert, Key string
	// ClientCA: clients must present a certificate this CA signed (a
	// node's API, which only control replicas call); health checks
	// excepted.
	ClientCA string
}

// clusterTLS: what a member of a cluster presents and trusts when it calls
// the others, and etcd.
type clusterTLS struct {
	CA, Cert, Key             string // control replicas to nodes and to each other
	EtcdCA, EtcdCert, EtcdKey string
}

func addTLSFlags(cmd *cobra.Command, t *apiTLS, c *clusterTLS) {
	cmd.Flags().StringVar(&t.Cert, "tls-cert", "", "serve the API over TLS (HTTPS, HTTP/2) with this certificate (PEM; with --tls-key); clients then use https:// and trust its CA (shoal --ca, $SHOAL_CA)")
	cmd.Flags().StringVar(&t.Key, "tls-key", "", "the private key of --tls-cert (PEM)")
	cmd.Flags().StringVar(&t.ClientCA, "tls-client-ca", "", "with --tls-cert: every API request but GET /healthz must come with a client certificate this CA (PEM) signed: a node's API, which control replicas call with --cluster-cert")
	cmd.Flags().StringVar(&c.CA, "cluster-ca", "", "--role control: the CA (PEM) that signed the nodes' and the other replicas' API certificates, for their https:// URLs (default: the system's)")
	cmd.Flags().StringVar(&c.Cert, "cluster-cert", "", "--role control: the client certificate (PEM; with --cluster-key) presented to nodes and other replicas (nodes started with --tls-client-ca require one)")
	cmd.Flags().StringVar(&c.Key, "cluster-key", "", "the private key of --cluster-cert (PEM)")
	cmd.Flags().StringVar(&c.EtcdCA, "etcd-ca", "", "--role node and control: the CA (PEM) of etcd's https:// endpoints (default: the system's)")
	cmd.Flags().StringVar(&c.EtcdCert, "etcd-cert", "", "--role node and control: the client certificate (PEM; with --etcd-key) presented to etcd (etcd's --client-cert-auth)")
	cmd.Flags().StringVar(&c.EtcdKey, "etcd-key", "", "the private key of --etcd-cert (PEM)")
}

func (t apiTLS) validate() error {
	if (t.Cert == "") != (t.Key == "") {
		return errors.New("--tls-cert and --tls-key go together")
	}
	if t.ClientCA != "" && t.Cert == "" {
		return errors.New("--tls-client-ca needs --tls-cert and --tls-key (client certificates are a TLS matter)")
	}
	if t.Cert != "" {
		// Fail at start, not at the first handshake.
		if _, err := pki.ServerConfig(t.Cert, t.Key, t.ClientCA); err != nil {
			return err
		}
	}
	return nil
}

// scheme of the API's URLs.
func (t apiTLS) scheme() string {
	if t.Cert != "" {
		return "https"
	}
	return "http"
}

// wrap serves ln over TLS when configured, h requiring client certificates
// when --tls-client-ca is given, but for GET of the health paths open.
func (t apiTLS) wrap(ln net.Listener, h http.Handler, open ...string) (net.Listener, http.Handler, error) {
	if t.Cert == "" {
		return ln, h, nil
	}
	cfg, err := pki.ServerConfig(t.Cert, t.Key, t.ClientCA)
	if err != nil {
		return nil, nil, err
	}
	if t.ClientCA != "" {
		h = control.RequireClientCert(h, open...)
	}
	return tls.NewListener(ln, cfg), h, nil
}

// nodeE2BClosed: a node whose API requires client certificates serves its
// E2B endpoint to control replicas only, the same way (TLS with its
// --tls-cert, their client certificates), instead of to anyone in plain
// HTTP or with the E2B endpoint's own CA: E2B clients of a cluster go
// through a replica.
func (c *serveConfig) nodeE2BClosed() bool {
	return c.Cluster.Role == roleNode && c.TLS.ClientCA != ""
}

func (c clusterTLS) validate() error {
	if (c.Cert == "") != (c.Key == "") {
		return errors.New("--cluster-cert and --cluster-key go together")
	}
	if (c.EtcdCert == "") != (c.EtcdKey == "") {
		return errors.New("--etcd-cert and --etcd-key go together")
	}
	if _, err := c.nodes(); err != nil {
		return fmt.Errorf("--cluster-ca/--cluster-cert: %w", err)
	}
	if _, err := c.etcd(); err != nil {
		return fmt.Errorf("--etcd-ca/--etcd-cert: %w", err)
	}
	return nil
}

// nodes is the TLS client configuration for calls to nodes and other
// replicas (used for their https:// URLs).
func (c clusterTLS) nodes() (*tls.Config, error) {
	cfg, err := shoal.ClientTLS(c.CA, c.Cert, c.Key)
	pki.ReloadClientCert(cfg, c.Cert, c.Key) // renewed in place: no restart
	return cfg, err
}

// etcd is the TLS client configuration for etcd, nil when none is set
// (then https:// endpoints use the system's roots).
func (c clusterTLS) etcd() (*tls.Config, error) {
	if c.EtcdCA == "" && c.EtcdCert == "" {
		return nil, nil
	}
	cfg, err := shoal.ClientTLS(c.EtcdCA, c.EtcdCert, c.EtcdKey)
	pki.ReloadClientCert(cfg, c.EtcdCert, c.EtcdKey)
	return cfg, err
}

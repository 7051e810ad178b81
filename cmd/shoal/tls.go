//go:build !client

package main

import (
	"fmt"
	"path/filepath"
	"regexp"

	"github.com/spf13/cobra"

	"github.com/shoal-sandbox/shoal/internal/pki"
)

// tlsCmd makes a private CA and the certificates of a deployment's APIs
// (serve --tls-cert, --tls-client-ca, --cluster-cert; clients' --ca).
func tlsCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "tls",
		Short: "Make a private CA and certificates for the API and a cluster's links (serve --tls-cert, --cluster-cert)",
	}
	var dir string
	cmd.PersistentFlags().StringVar(&dir, "dir", ".", "the CA's directory: ca.pem (give it to clients: --ca, $SHOAL_CA) and ca.key (keep it there)")
	ca := &cobra.Command{
		Use:   "ca",
		Short: "Make the CA in --dir (kept when it is there and valid for 30 days more)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, _, err := pki.LoadOrCreateCA(dir, "Shoal CA")
			if err != nil {
				return err
			}
			fmt.Printf("%s (%s, until %s)\n", filepath.Join(dir, pki.CACertFile), c.Subject.CommonName, c.NotAfter.Format("2006-01-02"))
			return nil
		},
	}
	var hosts []string
	var server, client bool
	cert := &cobra.Command{
		Use:   "cert NAME",
		Short: "Sign a certificate NAME.pem and its key NAME.key in --dir with its CA (made if missing), valid a year",
		Long: `Sign a certificate for NAME with the CA of --dir, writing NAME.pem and
NAME.key there. By default it serves both ways: as a server's (an API at
one of --host) and as a client's (a control replica calling nodes, a node
calling etcd). For example, for a node and a control replica:

  shoal tls cert --dir ca node-1 --host node-1.example --host 10.0.0.11
  shoal serve --role node --tls-cert ca/node-1.pem --tls-key ca/node-1.key --tls-client-ca ca/ca.pem ...
  shoal tls cert --dir ca control-1 --host shoal.example
  shoal serve --role control --tls-cert ca/control-1.pem --tls-key ca/control-1.key \
      --cluster-ca ca/ca.pem --cluster-cert ca/control-1.pem --cluster-key ca/control-1.key ...`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			name := args[0]
			if !certName.MatchString(name) {
				return fmt.Errorf("certificate name %q: want letters, digits, '.', '_' or '-' (it names the files)", name)
			}
			var usage pki.Usage
			if server {
				usage |= pki.Server
			}
			if client {
				usage |= pki.Client
			}
			if usage&pki.Server != 0 && len(hosts) == 0 {
				return fmt.Errorf("a server certificate needs --host (the names and addresses its API is reached at)")
			}
			c, key, err := pki.LoadOrCreateCA(dir, "Shoal CA")
			if err != nil {
				return err
			}
			certPath, keyPath := filepath.Join(dir, name+".pem"), filepath.Join(dir, name+".key")
			if err := pki.Issue(c, key, name, hosts, usage, certPath, keyPath); err != nil {
				return err
			}
			fmt.Println(certPath)
			fmt.Println(keyPath)
			return nil
		},
	}
	cert.Flags().StringArrayVar(&hosts, "host", nil, "a DNS name (or *.domain) or IP address the certificate's server is reached at (repeatable)")
	cert.Flags().BoolVar(&server, "server", true, "valid for a TLS server")
	cert.Flags().BoolVar(&client, "client", true, "valid for a TLS client")
	cmd.AddCommand(ca, cert)
	return cmd
}

var certName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`)

//go:build !client

package main

import (
	"crypto/x509"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/docker/cli/cli/config"
	"github.com/docker/cli/cli/config/configfile"
	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/spf13/cobra"

	"github.com/shoal-sandbox/shoal/internal/layer"
)

// registryConfig: how `layer pull` (and a create from an image) reaches
// OCI registries.
type registryConfig struct {
	AuthFile string   // --registry-auth: a docker config.json
	Mirrors  []string // --registry-mirror HOST=URL, in order
	Insecure []string // --insecure-registry HOST
	CAs      []string // --registry-ca FILE
	Stall    time.Duration
	MaxPull  string // --registry-max-pull-bytes
}

func addRegistryFlags(cmd *cobra.Command, c *registryConfig) {
	cmd.Flags().StringVar(&c.AuthFile, "registry-auth", "", "this server's own registry logins: a docker config.json (auths, credsStore, credHelpers), used for a registry a pull brings no login for; never logged nor shown")
	cmd.Flags().StringArrayVar(&c.Mirrors, "registry-mirror", nil, "HOST=URL: pull images of registry HOST (docker.io, ghcr.io, host:port) from this mirror first (repeatable, tried in order, then HOST itself)")
	cmd.Flags().StringArrayVar(&c.Insecure, "insecure-registry", nil, "a registry HOST[:PORT] spoken to over plain HTTP (repeatable; 127.0.0.1 and localhost are tried over HTTP anyway)")
	cmd.Flags().StringArrayVar(&c.CAs, "registry-ca", nil, "a PEM file of certificate authorities registries' certificates are checked against, besides the system's (repeatable)")
	cmd.Flags().DurationVar(&c.Stall, "registry-stall-timeout", layer.DefaultStallTimeout, "a pull ends when a registry sends nothing for this long")
	cmd.Flags().StringVar(&c.MaxPull, "registry-max-pull-bytes", "64G", "uncompressed bytes one image pull may convert (its layers not already here, together)")
}

// layerConfig turns the flags into the layer store's RegistryConfig,
// checking them.
func (c registryConfig) layerConfig() (layer.RegistryConfig, error) {
	rc := layer.RegistryConfig{Mirrors: map[string][]string{}, Insecure: c.Insecure, StallTimeout: c.Stall}
	for _, m := range c.Mirrors {
		host, u, ok := strings.Cut(m, "=")
		if !ok || host == "" || u == "" {
			return rc, fmt.Errorf("--registry-mirror %q: want HOST=URL (e.g. docker.io=https://mirror.example)", m)
		}
		rc.Mirrors[host] = append(rc.Mirrors[host], u)
	}
	if c.MaxPull != "" {
		n, err := parseBytes(c.MaxPull)
		if err != nil || n <= 0 {
			return rc, fmt.Errorf("--registry-max-pull-bytes %q: want a positive size (e.g. 64G)", c.MaxPull)
		}
		rc.MaxPullBytes = n
	}
	if c.Stall <= 0 {
		return rc, fmt.Errorf("--registry-stall-timeout %s: want a positive duration", c.Stall)
	}
	if len(c.CAs) > 0 {
		pool, err := x509.SystemCertPool()
		if err != nil {
			pool = x509.NewCertPool()
		}
		for _, f := range c.CAs {
			pem, err := os.ReadFile(f)
			if err != nil {
				return rc, fmt.Errorf("--registry-ca: %w", err)
			}
			if !pool.AppendCertsFromPEM(pem) {
				return rc, fmt.Errorf("--registry-ca %s: no PEM certificate in it", f)
			}
		}
		rc.RootCAs = pool
	}
	if c.AuthFile != "" {
		f, err := os.Open(c.AuthFile)
		if err != nil {
			return rc, fmt.Errorf("--registry-auth: %w", err)
		}
		defer f.Close()
		cf, err := config.LoadFromReader(f)
		if err != nil {
			return rc, fmt.Errorf("--registry-auth %s: %w", c.AuthFile, err)
		}
		rc.Keychain = fileKeychain{cf}
	}
	if err := rc.Validate(); err != nil {
		return rc, err
	}
	return rc, nil
}

// fileKeychain reads logins from a docker config file, as docker does.
type fileKeychain struct{ cf *configfile.ConfigFile }

func (k fileKeychain) Resolve(r authn.Resource) (authn.Authenticator, error) {
	key := r.RegistryStr()
	if key == name.DefaultRegistry {
		key = authn.DefaultAuthKey
	}
	ac, err := k.cf.GetAuthConfig(key)
	if err != nil {
		return nil, err
	}
	empty := ac.Username == "" && ac.Password == "" && ac.Auth == "" && ac.IdentityToken == "" && ac.RegistryToken == ""
	if empty {
		return authn.Anonymous, nil
	}
	return authn.FromConfig(authn.AuthConfig{
		Username: ac.Username, Password: ac.Password, Auth: ac.Auth,
		IdentityToken: ac.IdentityToken, RegistryToken: ac.RegistryToken,
	}), nil
}

// applyRegistry sets the store's registry configuration and logs it
// (mirrors and insecure registries; of the logins, only the file's name).
func applyRegistry(rc layer.RegistryConfig, c registryConfig, layers *layer.Store, log *slog.Logger) {
	layers.SetRegistry(rc)
	if len(rc.Mirrors) > 0 || len(rc.Insecure) > 0 || c.AuthFile != "" {
		var mirrors []string
		for h, us := range rc.Mirrors {
			mirrors = append(mirrors, h+"="+strings.Join(us, ","))
		}
		slices.Sort(mirrors)
		log.Info("registries", "mirrors", mirrors, "insecure", rc.Insecure, "auth_file", c.AuthFile)
	}
}

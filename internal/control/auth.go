package control

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/shoal-sandbox/shoal/internal/tenant"
)

// AdminKeyFile is the name of the admin API key file in the data directory.
const AdminKeyFile = "admin.key"

// Auth checks API keys: the admin key, written to DATA/admin.key (mode
// 0600) on first start, which is the admin principal; and the tenants' keys
// of a KeyStore (SetKeys): a node's own, or a cluster's in etcd.
type Auth struct {
	key  []byte
	keys keyResolver // nil: the admin key only
	// session resolves a dashboard session token to the API key it was
	// made from (dash.go); set once by New, before serving.
	session func(token string) (key string, ok bool)
}

// keyResolver finds a tenant's key by its plaintext (KeyStore's Resolve),
// from memory.
type keyResolver interface {
	Resolve(plaintext string) (tenant.Key, bool)
}

// SetKeys makes the middleware accept the keys of ks too. Call it before
// serving.
func (a *Auth) SetKeys(ks keyResolver) { a.keys = ks }

// freshResolver is a keyResolver that can make sure, on a miss, that its
// copy is not behind the store it follows (cluster.Tenancy): a key made
// through another process works at the first request that uses it here.
type freshResolver interface {
	ResolveFresh(ctx context.Context, plaintext string) (tenant.Key, bool)
}

// principal resolves a key to its principal, or nil.
func (a *Auth) principal(ctx context.Context, key string) *tenant.Principal {
	if a.session != nil && strings.HasPrefix(key, sessionPrefix) {
		k, ok := a.session(key)
		if !ok {
			return nil
		}
		key = k
	}
	if subtle.ConstantTimeCompare([]byte(key), a.key) == 1 {
		return tenant.Admin()
	}
	if fr, ok := a.keys.(freshResolver); ok {
		if k, ok := fr.ResolveFresh(ctx, key); ok {
			return k.Principal()
		}
	} else if a.keys != nil {
		if k, ok := a.keys.Resolve(key); ok {
			return k.Principal()
		}
	}
	return nil
}

// LoadOrCreateAdminKey reads DATA/admin.key, creating it with a fresh random
// key if it does not exist.
func LoadOrCreateAdminKey(dataDir string) (*Auth, error) {
	path := filepath.Join(dataDir, AdminKeyFile)
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		var raw [24]byte
		if _, err := rand.Read(raw[:]); err != nil {
			return nil, err
		}
		key := "sk_shoal_" + hex.EncodeToString(raw[:])
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return nil, fmt.Errorf("create admin key: %w", err)
		}
		if _, err := f.WriteString(key + "\n"); err != nil {
			f.Close()
			return nil, fmt.Errorf("write admin key: %w", err)
		}
		if err := f.Close(); err != nil {
			return nil, fmt.Errorf("write admin key: %w", err)
		}
		return &Auth{key: []byte(key)}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read admin key: %w", err)
	}
	key := strings.TrimSpace(string(b))
	if len(key) < 16 {
		return nil, fmt.Errorf("admin key in %s is shorter than 16 characters", path)
	}
	return &Auth{key: []byte(key)}, nil
}

// requestKey is the API key a request carries: its "X-API-Key" header
// (E2B's), else the bearer token of its "Authorization" header. X-API-Key
// comes first so that a request to a sandbox's port can carry the key
// there and an Authorization of its own for the app (ports.go).
func requestKey(r *http.Request) string {
	if k := r.Header.Get("X-API-Key"); k != "" {
		return k
	}
	k, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	return k
}

// Middleware lets a request through only with "Authorization: Bearer <key>"
// or "X-API-Key: <key>" (requestKey), with the key's principal in its
// context (tenant.FromContext); public paths pass without one (and no
// principal).
func (a *Auth) Middleware(next http.Handler, public ...string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for _, p := range public {
			if r.URL.Path == p {
				next.ServeHTTP(w, r)
				return
			}
		}
		got := requestKey(r)
		if got == "" {
			writeHTTPError(w, http.StatusUnauthorized, "unauthenticated", "missing API key: send \"Authorization: Bearer <key>\" (the admin key is in DATA/admin.key)")
			return
		}
		p := a.principal(r.Context(), got)
		if p == nil {
			writeHTTPError(w, http.StatusUnauthorized, "unauthenticated", "invalid API key")
			return
		}
		next.ServeHTTP(w, r.WithContext(tenant.WithPrincipal(r.Context(), p)))
	})
}

// RequireClientCert refuses (unauthenticated) a request that came without
// a client certificate the server verified (serve --tls-client-ca: the
// TLS configuration verifies one when given), except GET of the paths in
// open (health checks of load balancers and kubelets).
func RequireClientCert(next http.Handler, open ...string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.TLS == nil || len(r.TLS.VerifiedChains) == 0 {
			if r.Method == http.MethodGet && slices.Contains(open, r.URL.Path) {
				next.ServeHTTP(w, r)
				return
			}
			writeHTTPError(w, http.StatusUnauthorized, "unauthenticated",
				"this API requires a client certificate signed by the CA it was started with (--tls-client-ca): present one (--cert and --cert-key, $SHOAL_CERT and $SHOAL_CERT_KEY)")
			return
		}
		next.ServeHTTP(w, r)
	})
}

package tenant

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"sort"
	"sync"
	"time"

	"go.etcd.io/bbolt"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

var (
	bucketKeys   = []byte("tenant.keys")   // hex sha256(plaintext) → Key
	bucketQuotas = []byte("tenant.quotas") // tenant → Quota
)

// KeyPrefix starts every generated key (as the admin key does); E2B
// clients may send it as "e2b_" instead (internal/e2b's keyAlias).
const KeyPrefix = "sk_shoal_"

// MaxKeys bounds the keys a node stores (each is resolved from memory).
const MaxKeys = 10000

// Key is a stored API key (never its plaintext).
type Key struct {
	Name    string    `json:"name"`
	Tenant  string    `json:"tenant"`
	Scopes  []Scope   `json:"scopes"`
	Created time.Time `json:"created"`
	Hash    string    `json:"hash"` // hex SHA-256 of the plaintext
}

// Principal is who a request made with k is made by.
func (k Key) Principal() *Principal {
	return &Principal{Key: k.Name, Tenant: k.Tenant, Scopes: k.Scopes}
}

// Quota bounds what one tenant's sandboxes on this node may take together;
// a zero field is no bound.
type Quota struct {
	MaxSandboxes int64 `json:"max_sandboxes,omitempty"`
	MaxMemory    int64 `json:"max_memory_bytes,omitempty"`
	MaxMilliCPU  int64 `json:"max_millicpu,omitempty"`
	// CreatesPerSecond refills a token bucket of Burst tokens (Burst 0:
	// max(1, CreatesPerSecond)); each create takes one.
	CreatesPerSecond float64 `json:"creates_per_second,omitempty"`
	Burst            int64   `json:"burst,omitempty"`
}

// Validate checks q.
func (q Quota) Validate() error {
	if q.MaxSandboxes < 0 || q.MaxMemory < 0 || q.MaxMilliCPU < 0 || q.Burst < 0 ||
		q.CreatesPerSecond < 0 || math.IsNaN(q.CreatesPerSecond) || math.IsInf(q.CreatesPerSecond, 0) {
		return errdefs.New(errdefs.ErrInvalidArgument, "quota values must be finite and not negative (0: no bound)")
	}
	if q.CreatesPerSecond > 1e6 || q.Burst > 1e6 {
		return errdefs.New(errdefs.ErrInvalidArgument, "creates per second and burst must be at most 1000000")
	}
	return nil
}

// Store holds the keys and quotas; it resolves keys from memory. It is
// safe for concurrent use.
type Store struct {
	db *bbolt.DB

	mu     sync.RWMutex
	keys   map[string]Key // by Hash; guarded by mu
	quotas map[string]Quota
}

// Open loads the keys and quotas from db, creating their buckets.
func Open(db *bbolt.DB) (*Store, error) {
	s := &Store{db: db, keys: map[string]Key{}, quotas: map[string]Quota{}}
	err := db.Update(func(tx *bbolt.Tx) error {
		kb, err := tx.CreateBucketIfNotExists(bucketKeys)
		if err != nil {
			return err
		}
		qb, err := tx.CreateBucketIfNotExists(bucketQuotas)
		if err != nil {
			return err
		}
		if err := kb.ForEach(func(k, v []byte) error {
			var key Key
			if err := json.Unmarshal(v, &key); err != nil {
				return fmt.Errorf("decode key %x: %w", k, err)
			}
			s.keys[string(k)] = key
			return nil
		}); err != nil {
			return err
		}
		return qb.ForEach(func(k, v []byte) error {
			var q Quota
			if err := json.Unmarshal(v, &q); err != nil {
				return fmt.Errorf("decode quota of %s: %w", k, err)
			}
			s.quotas[string(k)] = q
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("open key store: %w", err)
	}
	return s, nil
}

// HashKey is how a key is stored: the hex SHA-256 of its plaintext.
func HashKey(plaintext string) string {
	h := sha256.Sum256([]byte(plaintext))
	return hex.EncodeToString(h[:])
}

// NewKey makes a key named name for tenant with scopes and returns its
// plaintext (shown once: only its hash is kept) and the Key to store. A key
// with the admin scope may have tenant "" (its creates belong to no
// tenant). Every store (this node's, a cluster's in etcd) makes its keys
// with it.
func NewKey(name, tenant string, scopes []Scope) (string, Key, error) {
	if err := ValidName("key", name); err != nil {
		return "", Key{}, err
	}
	if name == AdminKeyName {
		return "", Key{}, errdefs.New(errdefs.ErrInvalidArgument, "key name %q is the admin key's (DATA/admin.key)", name)
	}
	if tenant == "" {
		if !slices.Contains(scopes, ScopeAdmin) {
			return "", Key{}, errdefs.New(errdefs.ErrInvalidArgument, "a key needs a tenant (--tenant), unless it has the admin scope")
		}
	} else if err := ValidName("tenant", tenant); err != nil {
		return "", Key{}, err
	}
	if len(scopes) == 0 {
		return "", Key{}, errdefs.New(errdefs.ErrInvalidArgument, "a key needs at least one scope")
	}
	for _, sc := range scopes {
		if !slices.Contains(Scopes, sc) {
			return "", Key{}, errdefs.New(errdefs.ErrInvalidArgument, "unknown scope %q", sc)
		}
	}
	var raw [24]byte
	if _, err := rand.Read(raw[:]); err != nil {
		return "", Key{}, err
	}
	plaintext := KeyPrefix + hex.EncodeToString(raw[:])
	k := Key{Name: name, Tenant: tenant, Scopes: scopes, Created: time.Now().UTC().Truncate(time.Second), Hash: HashKey(plaintext)}
	return plaintext, k, nil
}

// Valid checks a stored key (one read back from a store another process
// writes): its names, scopes and hash.
func (k Key) Valid() error {
	if err := ValidName("key", k.Name); err != nil {
		return err
	}
	if k.Tenant != "" {
		if err := ValidName("tenant", k.Tenant); err != nil {
			return err
		}
	} else if !slices.Contains(k.Scopes, ScopeAdmin) {
		return errdefs.New(errdefs.ErrInvalidArgument, "key %q has no tenant and no admin scope", k.Name)
	}
	if len(k.Scopes) == 0 {
		return errdefs.New(errdefs.ErrInvalidArgument, "key %q has no scope", k.Name)
	}
	for _, sc := range k.Scopes {
		if !slices.Contains(Scopes, sc) {
			return errdefs.New(errdefs.ErrInvalidArgument, "key %q: unknown scope %q", k.Name, sc)
		}
	}
	if b, err := hex.DecodeString(k.Hash); err != nil || len(b) != sha256.Size {
		return errdefs.New(errdefs.ErrInvalidArgument, "key %q: its hash is not a hex SHA-256", k.Name)
	}
	return nil
}

// CreateKey makes a key named name for tenant with scopes (NewKey) and
// stores it; it returns the plaintext (shown once: only its hash is kept).
func (s *Store) CreateKey(ctx context.Context, name, tenant string, scopes []Scope) (string, Key, error) {
	plaintext, k, err := NewKey(name, tenant, scopes)
	if err != nil {
		return "", Key{}, err
	}
	b, err := json.Marshal(k)
	if err != nil {
		return "", Key{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, o := range s.keys {
		if o.Name == name {
			return "", Key{}, errdefs.New(errdefs.ErrAlreadyExists, "a key named %q exists (remove it first: shoal key rm %s)", name, name)
		}
	}
	if len(s.keys) >= MaxKeys {
		return "", Key{}, errdefs.New(errdefs.ErrResourceExhausted, "this node holds %d keys, the maximum", MaxKeys)
	}
	if err := s.db.Update(func(tx *bbolt.Tx) error {
		return tx.Bucket(bucketKeys).Put([]byte(k.Hash), b)
	}); err != nil {
		return "", Key{}, fmt.Errorf("store key %s: %w", name, err)
	}
	s.keys[k.Hash] = k
	return plaintext, k, nil
}

// DeleteKey removes the key named name; requests made with it fail from
// now on.
func (s *Store) DeleteKey(ctx context.Context, name string) (Key, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for h, k := range s.keys {
		if k.Name != name {
			continue
		}
		if err := s.db.Update(func(tx *bbolt.Tx) error {
			return tx.Bucket(bucketKeys).Delete([]byte(h))
		}); err != nil {
			return Key{}, fmt.Errorf("remove key %s: %w", name, err)
		}
		delete(s.keys, h)
		return k, nil
	}
	return Key{}, errdefs.New(errdefs.ErrNotFound, "no key named %q", name)
}

// Keys lists the keys by name.
func (s *Store) Keys() []Key {
	s.mu.RLock()
	out := make([]Key, 0, len(s.keys))
	for _, k := range s.keys {
		out = append(out, k)
	}
	s.mu.RUnlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// Resolve returns the key whose plaintext is plaintext.
func (s *Store) Resolve(plaintext string) (Key, bool) {
	h := HashKey(plaintext)
	s.mu.RLock()
	k, ok := s.keys[h]
	s.mu.RUnlock()
	return k, ok
}

// SetQuota sets tenant's quota (a zero Quota removes it).
func (s *Store) SetQuota(ctx context.Context, tenant string, q Quota) error {
	if err := ValidName("tenant", tenant); err != nil {
		return err
	}
	if err := q.Validate(); err != nil {
		return err
	}
	b, err := json.Marshal(q)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.db.Update(func(tx *bbolt.Tx) error {
		if q == (Quota{}) {
			return tx.Bucket(bucketQuotas).Delete([]byte(tenant))
		}
		return tx.Bucket(bucketQuotas).Put([]byte(tenant), b)
	}); err != nil {
		return fmt.Errorf("store quota of %s: %w", tenant, err)
	}
	if q == (Quota{}) {
		delete(s.quotas, tenant)
	} else {
		s.quotas[tenant] = q
	}
	return nil
}

// Quota returns tenant's quota (zero: no bound).
func (s *Store) Quota(tenant string) Quota {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.quotas[tenant]
}

// Tenants lists every tenant that has a key or a quota, by name, with its
// quota.
func (s *Store) Tenants() map[string]Quota {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := map[string]Quota{}
	for _, k := range s.keys {
		if k.Tenant != "" {
			out[k.Tenant] = s.quotas[k.Tenant]
		}
	}
	for t, q := range s.quotas {
		out[t] = q
	}
	return out
}

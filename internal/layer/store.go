package layer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"go.etcd.io/bbolt"
)

// bbolt buckets. The first two hold JSON-encoded Layer values.
var (
	// "name:version" -> the Layer the tag points at.
	tagsBucket = []byte("layer.tags")
	// "sha256:<hex>" -> the Layer as last built with this content, kept after
	// its tag moves on so that the digest stays resolvable.
	blobsBucket = []byte("layer.blobs")
	// environment name -> JSON-encoded Env.
	envsBucket = []byte("layer.envs")
)

// Store keeps the layers of one node: images on disk, tags in bbolt, and the
// read-only mounts of the images in use.
//
// A Store is safe for concurrent use. Builds run in parallel (each in its own
// scratch directory; tags are moved in single bbolt transactions). mu guards
// mounts and serializes every mount and unmount the Store makes, so an
// image is never mounted twice. gcMu keeps image deletion (GC, Remove) apart
// from the window between installing a new image and recording it (builds,
// commits, imports and tags hold it shared; deletions exclusively); a
// deletion also holds mu, so an image is never deleted while it is mounted
// nor mounted while it is deleted.
type Store struct {
	dir   string // DATA/layers, absolute with symlinks resolved
	blobs string // dir/blobs/sha256
	mnt   string // dir/mnt
	tmp   string // dir/tmp
	db    *bbolt.DB
	log   *slog.Logger

	gcMu sync.RWMutex

	remote *RemoteConfig // set by SetRemote before serving; nil: no layer store
	// registryCfg: how pulls reach OCI registries (pull.go), set by
	// SetRegistry before serving; nil: anonymous, no mirror.
	registryCfg *RegistryConfig
	// cluster: where a node of a cluster moves its tags first (set by
	// SetClusterTags before serving); nil: the tags are this store's own.
	cluster ClusterTags

	mu     sync.Mutex
	mounts map[string]*mount // by digest; guarded by mu; only entries with refs > 0
	// lastUse orders the cache of store images (cache.go); guarded by mu.
	lastUse map[string]time.Time
}

// mount is one mounted image.
type mount struct {
	path    string
	refs    int
	release func() // after unmounting (a lazily loaded image's loop device and FUSE file); may be nil
}

// Open opens the layer store rooted at dir (DATA/layers), creating its
// directories and bbolt buckets as needed and emptying dir/tmp (scratch left
// by an interrupted build). It holds no mount: a node that restarts calls
// Acquire for every layer its live sandboxes use (existing mounts are
// adopted), then Sweep. log may be nil.
func Open(dir string, db *bbolt.DB, log *slog.Logger) (*Store, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("open layer store: %w", err)
	}
	// Mount points are compared with /proc/self/mountinfo, which shows
	// absolute paths with symlinks resolved.
	abs, err := filepath.Abs(dir)
	if err == nil {
		abs, err = filepath.EvalSymlinks(abs)
	}
	if err != nil {
		return nil, fmt.Errorf("open layer store: %w", err)
	}
	s := &Store{
		dir:    abs,
		blobs:  filepath.Join(abs, "blobs", "sha256"),
		mnt:    filepath.Join(abs, "mnt"),
		tmp:    filepath.Join(abs, "tmp"),
		db:     db,
		log:    log,
		mounts: make(map[string]*mount),
	}
	if err := os.RemoveAll(s.tmp); err != nil {
		return nil, fmt.Errorf("open layer store: clean %s: %w", s.tmp, err)
	}
	for _, d := range []string{s.blobs, s.mnt, s.tmp} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, fmt.Errorf("open layer store: %w", err)
		}
	}
	err = db.Update(func(tx *bbolt.Tx) error {
		for _, b := range [][]byte{tagsBucket, blobsBucket, envsBucket} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("open layer store: create buckets: %w", err)
	}
	return s, nil
}

// ImagePath returns the path of the image with the given digest
// (DATA/layers/blobs/sha256/<hex>.erofs), or "" if digest is not of the form
// "sha256:<64 lowercase hex>". It does not check that the image exists.
func (s *Store) ImagePath(digest string) string {
	if validateDigest(digest) != nil {
		return ""
	}
	return filepath.Join(s.blobs, strings.TrimPrefix(digest, "sha256:")+".erofs")
}

// Resolve finds the layer a reference names, as the admin sees it (see
// View.Resolve).
func (s *Store) Resolve(ref string) (Layer, error) { return s.As(AdminOwner).Resolve(ref) }

// Resolve finds the layer a reference names: "name:version" (a tag: the
// owner's own, else a shared one), "name@sha256:<hex>" (a layer of that
// name with that content, tagged or not) or "sha256:<hex>" (owner.go says
// which the owner sees). Malformed references wrap ErrInvalidRef, unknown
// ones (and those of another tenant) ErrNotFound.
func (v View) Resolve(ref string) (Layer, error) {
	s := v.s
	p, err := parseRef(ref)
	if err != nil {
		return Layer{}, fmt.Errorf("resolve layer: %w", err)
	}
	nss := v.o.namespaces(p)
	var l Layer
	found := false
	err = s.db.View(func(tx *bbolt.Tx) error {
		if p.version != "" {
			for _, ns := range nss {
				if found, err = get(tx.Bucket(tagsBucket), p.key(ns), &l); err != nil || found {
					return err
				}
			}
			return nil
		}
		if found, err = get(tx.Bucket(blobsBucket), p.digest, &l); err != nil || !found {
			return err
		}
		if p.name == "" {
			found, err = v.seesDigest(tx, p.digest)
			return err
		}
		// name@digest: a layer of this name, in a namespace the
		// reference allows, with this content.
		named := func(t Layer) bool {
			if p.qualified {
				return t.Name == p.name && t.Tenant == p.tenant && len(nss) > 0
			}
			return t.Name == p.name && v.o.reads(t.Tenant)
		}
		if named(l) {
			return nil
		}
		// The blob was last built under another name: look for a tag of
		// this name that points at it.
		found = false
		return tx.Bucket(tagsBucket).ForEach(func(k, val []byte) error {
			var t Layer
			if err := json.Unmarshal(val, &t); err != nil {
				return fmt.Errorf("decode tag %s: %w", k, err)
			}
			if !found && t.Digest == p.digest && named(t) {
				l, found = t, true
			}
			return nil
		})
	})
	if err != nil {
		return Layer{}, fmt.Errorf("resolve layer %s: %w", ref, err)
	}
	if !found && s.cluster != nil && p.version != "" {
		// A tag is the cluster's: one made a moment ago through another
		// node may not be in this copy yet. Not from the layer store's
		// tags: etcd's are the ones.
		ctx, cancel := context.WithTimeout(context.Background(), clusterTagTimeout)
		defer cancel()
		for _, ns := range nss {
			l, err := s.cluster.LookupTag(ctx, p.key(ns))
			if !errors.Is(err, ErrNotFound) {
				return l, err
			}
		}
		return Layer{}, fmt.Errorf("resolve layer %s: %w", ref, ErrNotFound)
	}
	if !found {
		if s.remote != nil && len(nss) > 0 {
			return v.resolveRemote(p, nss)
		}
		return Layer{}, fmt.Errorf("resolve layer %s: %w", ref, ErrNotFound)
	}
	return l, nil
}

// List returns every tagged layer of every tenant (the admin's view; see
// View.List).
func (s *Store) List() ([]Layer, error) { return s.list() }

// list returns every tag's layer, sorted by name, version, then tenant.
// Blobs whose tag has moved on are not listed (Resolve still finds them by
// digest).
func (s *Store) list() ([]Layer, error) {
	var ls []Layer
	err := s.db.View(func(tx *bbolt.Tx) error {
		return tx.Bucket(tagsBucket).ForEach(func(k, v []byte) error {
			var l Layer
			if err := json.Unmarshal(v, &l); err != nil {
				return fmt.Errorf("decode tag %s: %w", k, err)
			}
			ls = append(ls, l)
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("list layers: %w", err)
	}
	slices.SortFunc(ls, func(a, b Layer) int {
		if c := strings.Compare(a.Name, b.Name); c != 0 {
			return c
		}
		if c := strings.Compare(a.Version, b.Version); c != 0 {
			return c
		}
		return strings.Compare(a.Tenant, b.Tenant)
	})
	return ls, nil
}

// tag points l.Key() (its tenant's tag) at l and records l as the latest
// build of its digest, in one transaction, and returns the layer the tag
// now points at and the digest it pointed at before ("" if none). Rebuilding a tag with the same
// content and kind changes nothing and returns the existing layer. On a
// node of a cluster the image is recorded here, then the tag moved in the
// cluster (which writes this store's copy of it).
func (s *Store) tag(l Layer) (tagged Layer, old string, err error) {
	l.Mirrored = 0
	v, err := json.Marshal(l)
	if err != nil {
		return Layer{}, "", err
	}
	if s.cluster != nil {
		err := s.db.Update(func(tx *bbolt.Tx) error { return tx.Bucket(blobsBucket).Put([]byte(l.Digest), v) })
		if err != nil {
			return Layer{}, "", err
		}
		ctx, cancel := context.WithTimeout(context.Background(), clusterTagTimeout)
		defer cancel()
		return s.cluster.PutTag(ctx, l)
	}
	err = s.db.Update(func(tx *bbolt.Tx) error {
		var prev Layer
		found, err := get(tx.Bucket(tagsBucket), l.Key(), &prev)
		if err != nil {
			return err
		}
		if found {
			old = prev.Digest
			if prev.Digest == l.Digest && prev.Kind == l.Kind {
				tagged = prev
				return nil
			}
		}
		if err := tx.Bucket(tagsBucket).Put([]byte(l.Key()), v); err != nil {
			return err
		}
		tagged = l
		return tx.Bucket(blobsBucket).Put([]byte(l.Digest), v)
	})
	return tagged, old, err
}

// get decodes the JSON value at key into v; found is false if there is none.
func get(b *bbolt.Bucket, key string, v any) (found bool, err error) {
	raw := b.Get([]byte(key))
	if raw == nil {
		return false, nil
	}
	if err := json.Unmarshal(raw, v); err != nil {
		return false, fmt.Errorf("decode %s: %w", key, err)
	}
	return true, nil
}

// ClusterTags is where a node of a cluster moves its tags (internal/
// cluster's LayerMirror): in etcd first, then in this store's copy of the
// cluster's tags (MirrorTag, UnmirrorTag), which every node keeps.
type ClusterTags interface {
	// PutTag points l.Key() at l and returns the layer the tag points at
	// and the digest it pointed at before ("" if none); a tag at l's
	// digest and kind already is left as it is.
	PutTag(ctx context.Context, l Layer) (Layer, string, error)
	// DeleteTag removes a tag (by its key, Layer.Key); an unknown one
	// wraps ErrNotFound.
	DeleteTag(ctx context.Context, key string) error
	// LookupTag reads a tag (by its key) this store's copy does not have
	// (yet) from the cluster, and copies it here; an unknown one wraps
	// ErrNotFound.
	LookupTag(ctx context.Context, key string) (Layer, error)
}

// clusterTagTimeout bounds a tag's move in the cluster.
const clusterTagTimeout = 30 * time.Second

// SetClusterTags makes the store's tags the cluster's: builds, commits,
// imports, pulls, Tag and Remove move them through c, which writes this
// store's copy. Call it before serving.
func (s *Store) SetClusterTags(c ClusterTags) { s.cluster = c }

// MirrorTag points l.Key() at l as the cluster has it (l.Mirrored: the
// revision), replacing what this store had under that tag, without
// checking that the image is here: a create resolves it then (from the
// layer store, if it is not here).
func (s *Store) MirrorTag(l Layer) error {
	if l.Tenant != "" {
		if err := validateTenant(l.Tenant); err != nil {
			return err
		}
	}
	if _, _, err := ParseTag(l.Ref()); err != nil {
		return err
	}
	if err := validateDigest(l.Digest); err != nil {
		return err
	}
	if _, err := ParseKind(string(l.Kind)); err != nil {
		return err
	}
	l.Remote = ""
	v, err := json.Marshal(l)
	if err != nil {
		return err
	}
	return s.db.Update(func(tx *bbolt.Tx) error { return tx.Bucket(tagsBucket).Put([]byte(l.Key()), v) })
}

// UnmirrorTag removes a tag (by its key, Layer.Key) the cluster no longer
// has; one already gone is not an error. The image stays until garbage
// collection.
func (s *Store) UnmirrorTag(key string) error {
	return s.db.Update(func(tx *bbolt.Tx) error { return tx.Bucket(tagsBucket).Delete([]byte(key)) })
}

// Holds says whether this node holds the image of digest: its file is
// here, or it is mounted (from the layer store). Placement's locality
// weighs the tags of the images a node holds, not every tag it knows.
func (s *Store) Holds(digest string) bool {
	if p := s.ImagePath(digest); p != "" {
		if _, err := os.Stat(p); err == nil {
			return true
		}
	}
	return s.Refs(digest) > 0
}

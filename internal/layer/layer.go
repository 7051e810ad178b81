// Package layer builds, stores, mounts and composes Shoal's layers.
//
// A layer is an immutable, content-addressed EROFS image of one kind (base,
// workspace or toolkit), built by mkfs.erofs from a directory, a tarball
// (tar, tar.gz, tar.zst), an OCI image layout or docker-archive tarball
// (flattened, whiteouts applied), or a sandbox's overlay upper directory
// (Commit: its whiteouts and opaque directories kept, so the layer stacked as
// a lower hides what the sandbox deleted). It is named by tags "name:version"
// that point at its digest ("sha256:<hex>" of the image file); a tag moves
// in one bbolt transaction (on a node of a cluster, in one etcd transaction
// first: the Store's ClusterTags, whose copy it keeps in bbolt). Tags and
// environments belong to a tenant or, the admin's, are shared (owner.go:
// a View is the store as one owner sees it). An image made outside Shoal
// (an import) is checked before it is installed (verify.go).
//
// The Store keeps the images under DATA/layers/blobs, the tags, image
// metadata and environments (named stacks) in bbolt (buckets prefixed
// "layer."), and mounts each image at most once per node, read-only and
// file-backed (no loop device), shared by every sandbox that uses it through
// a refcount. Compose stacks mounted layers and a private upper directory
// into one overlayfs root. GC and Remove delete images nothing references;
// what sandboxes use is the caller's knowledge (the node's), passed in.
//
// On disk, under the Store's directory (DATA/layers):
//
//	blobs/sha256/<hex>.erofs   images, never modified once renamed in
//	mnt/<first 16 hex>/        read-only mounts of images in use
//	tmp/                       build scratch space, emptied by Open
package layer

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// Kind is what a layer holds; it decides its place in a stack.
type Kind string

// The kinds of layer. A stack is one base, then workspaces and toolkits.
const (
	KindBase      Kind = "base"      // OS and runtimes
	KindWorkspace Kind = "workspace" // a repository and task data
	KindToolkit   Kind = "toolkit"   // a tool chain
)

var kinds = []Kind{KindBase, KindWorkspace, KindToolkit}

// ParseKind returns the Kind named s, or an error listing the valid kinds.
func ParseKind(s string) (Kind, error) {
	for _, k := range kinds {
		if string(k) == s {
			return k, nil
		}
	}
	return "", fmt.Errorf("unknown layer kind %q: valid kinds are base, workspace, toolkit", s)
}

// Errors returned by the Store; check them with errors.Is. Each is also of
// an errdefs kind (errors.Is(layer.ErrNotFound, errdefs.ErrNotFound)).
var (
	// ErrNotFound: no layer has this tag or digest.
	ErrNotFound = errdefs.Mark(errdefs.ErrNotFound, errors.New("layer not found"))
	// ErrInvalidRef: a reference, name, version or digest is malformed.
	ErrInvalidRef = errdefs.Mark(errdefs.ErrInvalidArgument, errors.New("invalid layer reference"))
	// ErrInUse: the layer is used (by a sandbox, an environment or a
	// mount) or still tagged, so it cannot be removed.
	ErrInUse = errdefs.Mark(errdefs.ErrFailedPrecondition, errors.New("layer in use"))
)

// Layer describes one built image and the tag it was built under.
type Layer struct {
	Name        string    `json:"name"`
	Version     string    `json:"version"`
	Kind        Kind      `json:"kind"`
	Digest      string    `json:"digest"` // "sha256:<hex>" of the image file
	Size        int64     `json:"size"`   // bytes of the image file
	Compression string    `json:"compression"`
	Created     time.Time `json:"created"`
	// Source says what the image was built from, e.g. "dir /src",
	// "tar.zst /x.tar.zst", "oci-layout /img (debian:12)", "commit of sandbox ID".
	Source string `json:"source,omitempty"`
	// Files and ContentBytes describe the tree in the image: its entries
	// (not counting the root) and the bytes of its regular files.
	Files        int64 `json:"files,omitempty"`
	ContentBytes int64 `json:"content_bytes,omitempty"`
	// Remote is the layer store the image is read from when this node
	// holds no copy of it (resolved from the store, not pulled); "" for a
	// local image.
	Remote string `json:"remote,omitempty"`
	// Mirrored: on a node of a cluster, the etcd revision of the tag
	// this copy was mirrored at (internal/cluster's LayerMirror); 0 for
	// a tag made here. Never sent anywhere (push, export).
	Mirrored int64 `json:"mirrored,omitempty"`
	// Tenant owns the tag (its namespace, owner.go); "" for the admin's,
	// which are shared: every tenant reads them. Records written before
	// tenants owned layers have none: they are the admin's.
	Tenant string `json:"tenant,omitempty"`
}

// Ref returns the layer's tag, "name:version".
func (l Layer) Ref() string { return l.Name + ":" + l.Version }

// Key returns the tag qualified by its tenant, "tenant/name:version", or
// "name:version" for a shared one: its key in the store and the cluster.
func (l Layer) Key() string { return nsKey(l.Tenant, l.Ref()) }

var (
	nameRE    = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,127}$`)
	versionRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)
	digestRE  = regexp.MustCompile(`^sha256:[0-9a-f]{64}$`)
)

func validateName(name string) error {
	if !nameRE.MatchString(name) {
		return fmt.Errorf("%w: layer name %q: use 1-128 of a-z 0-9 . _ - starting with a letter or digit", ErrInvalidRef, name)
	}
	return nil
}

func validateVersion(version string) error {
	if !versionRE.MatchString(version) {
		return fmt.Errorf("%w: layer version %q: use 1-128 of A-Z a-z 0-9 . _ - starting with a letter or digit", ErrInvalidRef, version)
	}
	return nil
}

var tenantRE = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,62}$`)

// validateTenant checks a tenant's name as a namespace (internal/tenant's
// ValidName: 1 to 63 of a-z 0-9 . _ -, starting with a letter or digit).
func validateTenant(t string) error {
	if !tenantRE.MatchString(t) {
		return fmt.Errorf("%w: tenant %q", ErrInvalidRef, t)
	}
	return nil
}

func validateDigest(digest string) error {
	if !digestRE.MatchString(digest) {
		return fmt.Errorf("%w: digest %q: want sha256:<64 lowercase hex>", ErrInvalidRef, digest)
	}
	return nil
}

// ParseTag splits a tag "name:version" and validates both parts; a tag
// qualified by a namespace is refused (see ParseTagKey).
func ParseTag(ref string) (name, version string, err error) {
	p, err := parseRef(ref)
	if err != nil {
		return "", "", err
	}
	if p.version == "" {
		return "", "", fmt.Errorf("%w %q: want a tag name:version, not a digest", ErrInvalidRef, ref)
	}
	if p.qualified {
		return "", "", fmt.Errorf("%w %q: want a tag name:version, without a tenant", ErrInvalidRef, ref)
	}
	return p.name, p.version, nil
}

// ParseTagKey splits the key of a tag (Layer.Key): "tenant/name:version"
// or, shared, "name:version" (tenant "").
func ParseTagKey(key string) (tenant, name, version string, err error) {
	p, err := parseRef(key)
	if err != nil {
		return "", "", "", err
	}
	if p.version == "" || p.qualified && p.tenant == "" {
		return "", "", "", fmt.Errorf("%w %q: want the key of a tag, [tenant/]name:version", ErrInvalidRef, key)
	}
	return p.tenant, p.name, p.version, nil
}

// parsedRef is a reference split into its parts; exactly one of version and
// digest is set (a bare digest has no name). qualified says the reference
// named its namespace: tenant, or the shared one ("").
type parsedRef struct {
	name, version, digest string
	tenant                string
	qualified             bool
}

// key is the qualified tag of a "name:version" reference in namespace ns.
func (p parsedRef) key(ns string) string { return nsKey(ns, p.name+":"+p.version) }

// parseRef accepts "name:version", "name@sha256:<hex>" and "sha256:<hex>";
// the first two may be qualified by a namespace: "tenant/name:version"
// (that tenant's), "/name:version" (the shared one).
func parseRef(ref string) (parsedRef, error) {
	if strings.HasPrefix(ref, "sha256:") {
		return parsedRef{digest: ref}, validateDigest(ref)
	}
	if ns, rest, ok := strings.Cut(ref, "/"); ok {
		if ns != "" {
			if err := validateTenant(ns); err != nil {
				return parsedRef{}, err
			}
		}
		if strings.HasPrefix(rest, "sha256:") || strings.Contains(rest, "/") {
			return parsedRef{}, fmt.Errorf("%w %q: at most one tenant/ before name:version or name@sha256:<hex>; a digest alone has none", ErrInvalidRef, ref)
		}
		p, err := parseRef(rest)
		if err != nil {
			return parsedRef{}, err
		}
		p.tenant, p.qualified = ns, true
		return p, nil
	}
	if name, digest, ok := strings.Cut(ref, "@"); ok {
		if err := validateName(name); err != nil {
			return parsedRef{}, err
		}
		return parsedRef{name: name, digest: digest}, validateDigest(digest)
	}
	name, version, ok := strings.Cut(ref, ":")
	if !ok {
		return parsedRef{}, fmt.Errorf("%w %q: no version, give name:version (e.g. %s:1), name@sha256:<hex> or sha256:<hex>", ErrInvalidRef, ref, ref)
	}
	if err := validateName(name); err != nil {
		return parsedRef{}, err
	}
	if err := validateVersion(version); err != nil {
		return parsedRef{}, err
	}
	return parsedRef{name: name, version: version}, nil
}

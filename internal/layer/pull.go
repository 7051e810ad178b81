package layer

// Pulling images from OCI registries through the distribution protocol,
// each OCI layer kept as a layer of its own: an image is a stack, and the
// layers images share are fetched, converted and stored once.
//
// An OCI layer becomes an EROFS layer tagged "oci-base:sha256-<hex>" (the
// bottom layer of an image, kind base) or "oci-layer:sha256-<hex>" (the
// others, kind workspace), where <hex> is the OCI layer's digest (of its
// compressed blob, as the manifest names it). A pull looks the tag up
// first (here, then in the layer store, so a node takes from the store
// what another node converted) and fetches only the layers it does not
// find. The image's own record (its layers, its config) is kept in the
// bbolt bucket "layer.images" under its normalised reference.

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"
	"go.etcd.io/bbolt"
	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/limits"
)

// Tag names of pulled OCI layers (their version: "sha256-<hex>").
const (
	OCIBaseName  = "oci-base"  // an image's bottom layer, kind base
	OCILayerName = "oci-layer" // its other layers, kind workspace
)

// imagesBucket: normalised image reference -> JSON-encoded Image. Made on
// the first pull.
var imagesBucket = []byte("layer.images")

// StageFetch: bytes of one OCI layer coming from a registry.
const StageFetch = "fetch"

// Bounds of a pull.
const (
	// MaxImageLayers: layers of one image (a stack holds at most
	// limits.Layers, and room is left for a sandbox's own).
	MaxImageLayers = 100
	// maxImageRefBytes: the length of an image reference.
	maxImageRefBytes = 512
	// maxImageConfigBytes: an image's config blob (docker's are a few
	// KiB; the largest seen in the wild, with long histories, ~1 MiB).
	maxImageConfigBytes = 8 << 20
	// Bounds of what an image's config gives its sandboxes (kept in every
	// sandbox's record made from it).
	maxImageEnv      = 1024    // Env entries
	maxImageArgs     = 1024    // Entrypoint + Cmd arguments
	maxImageCfgBytes = 1 << 20 // Env, Entrypoint and Cmd together
	// DefaultStallTimeout: a registry that sends nothing for this long
	// (no response, no byte of a blob) ends the pull.
	DefaultStallTimeout = 60 * time.Second
	// DefaultMaxPullBytes: uncompressed bytes one pull may convert, all
	// its layers together.
	DefaultMaxPullBytes = 64 << 30
)

// maxLayerEntries: tar entries of one OCI layer (a variable for the
// tests).
var maxLayerEntries = 4 << 20

// RegistryConfig says how this node reaches OCI registries.
type RegistryConfig struct {
	// Mirrors: registry host ("docker.io", "ghcr.io", "host:port") ->
	// base URLs of mirrors ("https://mirror.example", "http://10.0.0.5:5000"),
	// tried in order before the registry itself, as containerd's hosts.toml
	// does. A mirror serves the same repository paths.
	Mirrors map[string][]string
	// Insecure: registries spoken to over plain HTTP.
	Insecure []string
	// RootCAs: the certificate authorities registries' certificates are
	// checked against (serve --registry-ca, with the system's); nil: the
	// system's.
	RootCAs *x509.CertPool
	// Keychain: this node's own credentials (serve --registry-auth);
	// nil: anonymous, unless a pull brings its own.
	Keychain authn.Keychain
	// StallTimeout: see DefaultStallTimeout (0: that).
	StallTimeout time.Duration
	// MaxPullBytes: see DefaultMaxPullBytes (0: that).
	MaxPullBytes int64
}

// Validate checks the mirrors' URLs and the registries' names.
func (c RegistryConfig) Validate() error {
	for host, urls := range c.Mirrors {
		if _, err := name.NewRegistry(host); err != nil {
			return fmt.Errorf("registry mirror for %q: %w", host, err)
		}
		for _, u := range urls {
			if _, _, err := parseMirror(u); err != nil {
				return fmt.Errorf("registry mirror %s=%s: %w", host, u, err)
			}
		}
	}
	for _, h := range c.Insecure {
		if _, err := name.NewRegistry(h, name.Insecure); err != nil {
			return fmt.Errorf("insecure registry %q: %w", h, err)
		}
	}
	if c.StallTimeout < 0 || c.MaxPullBytes < 0 {
		return errors.New("registry: negative stall timeout or pull size")
	}
	return nil
}

// parseMirror splits a mirror's URL into its registry host and whether it
// is plain HTTP.
func parseMirror(s string) (host string, plain bool, err error) {
	u, err := url.Parse(s)
	if err != nil {
		return "", false, err
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || (u.Path != "" && u.Path != "/") || u.User != nil || u.RawQuery != "" {
		return "", false, errors.New("want http(s)://HOST[:PORT] (no path, no credentials)")
	}
	return u.Host, u.Scheme == "http", nil
}

// SetRegistry sets how the Store reaches registries. Call it before
// serving; without it pulls are anonymous, with no mirror.
func (s *Store) SetRegistry(c RegistryConfig) { s.registryCfg = &c }

func (s *Store) registry() RegistryConfig {
	var rc RegistryConfig
	if s.registryCfg != nil {
		rc = *s.registryCfg
	}
	if rc.StallTimeout == 0 {
		rc.StallTimeout = DefaultStallTimeout
	}
	if rc.MaxPullBytes == 0 {
		rc.MaxPullBytes = DefaultMaxPullBytes
	}
	return rc
}

// Credential is a client's login to one registry, forwarded for one pull
// (from its ~/.docker/config.json or credential helper). It is never
// logged, stored or returned.
type Credential struct {
	Registry      string // "docker.io", "ghcr.io", "host:port"
	Username      string
	Password      string
	IdentityToken string
	RegistryToken string
}

// String hides the secrets from any %v.
func (c Credential) String() string { return "credential for " + c.Registry }

// PullOptions says what to pull.
type PullOptions struct {
	// Image: "[REGISTRY/]REPOSITORY[:TAG|@DIGEST]", Docker Hub's names
	// normalised as docker does ("python:3.12" is
	// docker.io/library/python:3.12).
	Image string
	// Credentials for this pull only, by registry; the node's own
	// (RegistryConfig.Keychain) for a registry not among them.
	Credentials []Credential
	// Progress, if not nil, receives the pull's stages: per OCI layer
	// "fetch" (bytes), then the build's stages of a converted layer.
	Progress func(Progress)
}

// ImageConfig is what an image says about the processes run from it: the
// defaults of the sandboxes made from it (each create and command may
// override them).
type ImageConfig struct {
	Env        []string `json:"env,omitempty"` // KEY=VALUE
	WorkingDir string   `json:"working_dir,omitempty"`
	User       string   `json:"user,omitempty"`
	Entrypoint []string `json:"entrypoint,omitempty"`
	Cmd        []string `json:"cmd,omitempty"`
}

// check bounds what a config gives the sandboxes made from it.
func (c ImageConfig) check() error {
	total := 0
	for _, kv := range c.Env {
		total += len(kv)
	}
	args := len(c.Entrypoint) + len(c.Cmd)
	for _, a := range append(slices.Clip(c.Entrypoint), c.Cmd...) {
		total += len(a)
	}
	switch {
	case len(c.Env) > maxImageEnv:
		return fmt.Errorf("its config has %d environment variables, more than the maximum of %d", len(c.Env), maxImageEnv)
	case args > maxImageArgs:
		return fmt.Errorf("its config's entrypoint and command have %d arguments, more than the maximum of %d", args, maxImageArgs)
	case total > maxImageCfgBytes:
		return fmt.Errorf("its config's environment, entrypoint and command are %d bytes, more than the maximum of %d", total, maxImageCfgBytes)
	case len(c.WorkingDir) > 4096 || len(c.User) > 256:
		return fmt.Errorf("its config's working directory or user is too long (%d, %d bytes)", len(c.WorkingDir), len(c.User))
	}
	return nil
}

// PulledImage is a pulled image: the layers it is made of and its config.
type PulledImage struct {
	Ref      string `json:"ref"`    // the normalised reference pulled ("index.docker.io/library/python:3.12")
	Digest   string `json:"digest"` // of its manifest (for an index: of the platform's image)
	Platform string `json:"platform"`
	// Layers: the tags of its layers, bottom first (oci-base:…, then
	// oci-layer:…).
	Layers    []string    `json:"layers"`
	OCILayers []string    `json:"oci_layers"` // their OCI digests, bottom first
	Config    ImageConfig `json:"config"`
	Pulled    time.Time   `json:"pulled"`
	// Tenant is whose pull this is ("": the admin's, shared); its layers'
	// tags are in the same namespace.
	Tenant string `json:"tenant,omitempty"`
	// Of the last pull (not stored): bytes fetched from the registry, and
	// how many layers were here already (or in the layer store).
	Fetched int64 `json:"-"`
	Reused  int   `json:"-"`
}

// Stack returns the image as a stack: the bottom layer as base, the
// others as workspaces, top first (the order of Env.Workspaces).
func (im PulledImage) Stack() (base string, workspaces []string) {
	if len(im.Layers) == 0 {
		return "", nil
	}
	ws := slices.Clone(im.Layers[1:])
	slices.Reverse(ws)
	return im.Layers[0], ws
}

// ociTag is the tag of an OCI layer of that digest and kind.
func ociTag(kind Kind, digest v1.Hash) string {
	n := OCILayerName
	if kind == KindBase {
		n = OCIBaseName
	}
	return n + ":" + digest.Algorithm + "-" + digest.Hex
}

// ParseImageRef normalises an image reference as docker does; a malformed
// one is marked errdefs.ErrInvalidArgument.
func ParseImageRef(s string) (name.Reference, error) {
	if err := limits.String("image", s, maxImageRefBytes); err != nil {
		return nil, err
	}
	ref, err := name.ParseReference(s)
	if err != nil {
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "image %q: %v (want [REGISTRY/]REPOSITORY[:TAG|@sha256:DIGEST])", s, err)
	}
	return ref, nil
}

// ImageForBase says which image a base (of a create or an environment)
// names, if it names one rather than a layer. The rule: a layer reference
// qualified by its namespace ("/NAME:VERSION", the shared one;
// "TENANT/NAME:VERSION" that resolves) is a layer; any other base with a "/"
// (a registry, or a repository path: "registry.example:5000/swe/task:1",
// "library/python:3.12") is an image (no layer name has one), pulled if
// it was not; any other base is a layer, unless no layer has that
// reference and an image of that name (Docker Hub's: "python:3.12") was
// pulled before, which it then names. Never a network call for a base
// without a "/". pull says whether the image must be pulled first.
func (s *Store) ImageForBase(base string) (image string, pull bool) {
	return s.As(AdminOwner).ImageForBase(base)
}

// ImageForBase is Store.ImageForBase for the view's owner: the images it
// pulled, or the admin did (shared).
func (v View) ImageForBase(base string) (image string, pull bool) {
	if strings.HasPrefix(base, "/") {
		return "", false // "/NAME:VERSION": the shared layer (owner.go), never an image
	}
	if strings.Contains(base, "/") {
		if _, err := v.Resolve(base); err == nil {
			return "", false // "TENANT/NAME:VERSION": a layer the owner may use
		}
		if _, err := v.LookupPulledImage(base); err == nil {
			return base, false
		}
		return base, true
	}
	if _, err := ParseImageRef(base); err != nil {
		return "", false
	}
	if _, found, _ := v.imageRecord(base); !found {
		return "", false
	}
	if _, err := v.Resolve(base); err == nil {
		return "", false // a layer wins
	}
	return base, false
}

// imageKey is the key of the record of image ref pulled into namespace ns
// (a NUL apart: no reference holds one).
func imageKey(ns string, ref name.Reference) []byte {
	if ns == "" {
		return []byte(ref.Name())
	}
	return []byte(ns + "\x00" + ref.Name())
}

// imageRecord returns the record of image as the view's owner sees it:
// its own pull, else the admin's (shared).
func (v View) imageRecord(image string) (im PulledImage, found bool, err error) {
	ref, err := ParseImageRef(image)
	if err != nil {
		return PulledImage{}, false, err
	}
	nss := []string{""}
	if !v.o.Admin && v.o.Tenant != "" {
		nss = []string{v.o.Tenant, ""}
	}
	err = v.s.db.View(func(tx *bbolt.Tx) error {
		b := tx.Bucket(imagesBucket)
		if b == nil {
			return nil
		}
		for _, ns := range nss {
			if raw := b.Get(imageKey(ns, ref)); raw != nil {
				found = true
				return json.Unmarshal(raw, &im)
			}
		}
		return nil
	})
	return im, found, err
}

// PulledImages returns the pulled images, by reference.
func (s *Store) PulledImages() ([]PulledImage, error) {
	var out []PulledImage
	err := s.db.View(func(tx *bbolt.Tx) error {
		b := tx.Bucket(imagesBucket)
		if b == nil {
			return nil
		}
		return b.ForEach(func(k, v []byte) error {
			var im PulledImage
			if err := json.Unmarshal(v, &im); err != nil {
				return fmt.Errorf("decode image %s: %w", k, err)
			}
			out = append(out, im)
			return nil
		})
	})
	return out, err
}

// LookupPulledImage returns the image pulled under that reference (normalised),
// whose layers are all still here (or in the layer store); else it wraps
// ErrNotFound.
func (s *Store) LookupPulledImage(image string) (PulledImage, error) {
	return s.As(AdminOwner).LookupPulledImage(image)
}

// LookupPulledImage is Store.LookupPulledImage for the view's owner: its
// own pull of the image, else the admin's (shared).
func (v View) LookupPulledImage(image string) (PulledImage, error) {
	im, found, err := v.imageRecord(image)
	if err != nil {
		return PulledImage{}, err
	}
	if !found {
		return PulledImage{}, fmt.Errorf("image %s: %w (pull it: shoal layer pull %s)", image, ErrNotFound, image)
	}
	if err := v.hasLayers(im); err != nil {
		return PulledImage{}, fmt.Errorf("image %s: %w", image, err)
	}
	return im, nil
}

// hasLayers checks that every layer of im resolves for the view's owner.
func (v View) hasLayers(im PulledImage) error {
	for _, t := range im.Layers {
		if _, err := v.Resolve(t); err != nil {
			return fmt.Errorf("layer %s: %w", t, err)
		}
	}
	return nil
}

// pulledAlready returns the owner's own record of ref if it was pulled at
// digest and all its layers are still here (or in the layer store).
func (v View) pulledAlready(ref name.Reference, digest string) (PulledImage, bool) {
	home, err := v.o.home()
	if err != nil {
		return PulledImage{}, false
	}
	var im PulledImage
	var found bool
	v.s.db.View(func(tx *bbolt.Tx) error {
		if b := tx.Bucket(imagesBucket); b != nil {
			if raw := b.Get(imageKey(home, ref)); raw != nil {
				found = json.Unmarshal(raw, &im) == nil
			}
		}
		return nil
	})
	if !found || im.Digest != digest || v.hasLayers(im) != nil {
		return PulledImage{}, false
	}
	im.Fetched, im.Reused = 0, len(im.Layers)
	return im, true
}

// PullImage pulls an image from its registry (or a mirror of it): its
// manifest (for an index, the linux image of this machine's architecture),
// its config and each OCI layer not here yet, checked against its digest
// and its config's diff ID, converted into a layer of its own. It records
// the image and returns it. ctx bounds the pull, and a registry that stalls
// ends it (RegistryConfig.StallTimeout). A failed pull leaves no partial
// layer: the layers done so far are kept (a later pull resumes from them),
// the image is recorded only when all are. Errors: a malformed reference
// or a layer that is not a safe tree, errdefs.ErrInvalidArgument; an
// unknown image or platform, errdefs.ErrNotFound; refused credentials,
// errdefs.ErrPermissionDenied; a registry that cannot be reached or
// stalls, errdefs.ErrUnavailable.
func (s *Store) PullImage(ctx context.Context, o PullOptions) (PulledImage, error) {
	return s.As(AdminOwner).PullImage(ctx, o)
}

// PullImage is Store.PullImage for the view's owner: the image's record
// and its layers' tags are the owner's (a tenant's own, the admin's
// shared). A layer another namespace converted already is not fetched
// again: the owner has just read the manifest that names its digest from
// the registry, with its own credentials (containerd's shared content
// policy); the owner gets a tag of its own to it.
func (v View) PullImage(ctx context.Context, o PullOptions) (PulledImage, error) {
	im, err := v.pullImage(ctx, o)
	if err != nil {
		return PulledImage{}, fmt.Errorf("pull %s: %w", o.Image, err)
	}
	return im, nil
}

func (v View) pullImage(ctx context.Context, o PullOptions) (PulledImage, error) {
	s := v.s
	home, err := v.o.home()
	if err != nil {
		return PulledImage{}, err
	}
	start := time.Now()
	rep := newReporter(o.Progress)
	cfg := s.registry()
	ref, err := ParseImageRef(o.Image)
	if err != nil {
		return PulledImage{}, err
	}
	if slices.Contains(cfg.Insecure, ref.Context().RegistryStr()) {
		if ref, err = name.ParseReference(o.Image, name.Insecure); err != nil {
			return PulledImage{}, errdefs.Mark(errdefs.ErrInvalidArgument, err)
		}
	}
	keychain := pullKeychain(o.Credentials, cfg.Keychain)
	opts := []remote.Option{
		remote.WithContext(ctx),
		remote.WithAuthFromKeychain(keychain),
		remote.WithTransport(registryTransport(cfg)),
		remote.WithPlatform(v1.Platform{OS: "linux", Architecture: runtime.GOARCH}),
		remote.WithUserAgent("shoal"),
	}

	// The mirrors of its registry in order, then the registry itself.
	var desc *remote.Descriptor
	var from name.Reference
	for _, cand := range candidates(ref, cfg) {
		rep.start(StageFetch, "bytes", 0, "resolving %s", cand.Name())
		d, err := remote.Get(cand, opts...)
		if err == nil {
			desc, from = d, cand
			break
		}
		if ctx.Err() != nil {
			return PulledImage{}, pullError(ctx, err)
		}
		if cand == ref {
			return PulledImage{}, pullError(ctx, err)
		}
		rep.note("mirror %s: %v; trying the next", cand.Context().RegistryStr(), err)
	}
	var img v1.Image
	if desc.MediaType.IsIndex() {
		idx, err := desc.ImageIndex()
		if err != nil {
			return PulledImage{}, pullError(ctx, err)
		}
		if img, err = pickPlatform(idx); err != nil {
			if ctx.Err() != nil {
				return PulledImage{}, pullError(ctx, err)
			}
			return PulledImage{}, errdefs.Mark(errdefs.ErrNotFound, err)
		}
	} else if desc.MediaType.IsImage() {
		if img, err = desc.Image(); err != nil {
			return PulledImage{}, pullError(ctx, err)
		}
	} else {
		return PulledImage{}, errdefs.New(errdefs.ErrInvalidArgument, "%s is a %s, not an image", ref.Name(), desc.MediaType)
	}
	digest, err := img.Digest()
	if err != nil {
		return PulledImage{}, pullError(ctx, err)
	}
	if im, ok := v.pulledAlready(ref, digest.String()); ok {
		// The same image as last time (the tag has not moved): its
		// record, without fetching its config again.
		rep.start(StageDone, "", 0, "done in %.1fs: %s, %d layers here already", time.Since(start).Seconds(), im.Digest, len(im.Layers))
		return im, nil
	}
	mf, err := img.Manifest()
	if err != nil {
		return PulledImage{}, pullError(ctx, err)
	}
	if mf.Config.Size > maxImageConfigBytes {
		return PulledImage{}, errdefs.New(errdefs.ErrInvalidArgument, "%s: its config is %d bytes, more than the maximum of %d", ref.Name(), mf.Config.Size, maxImageConfigBytes)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return PulledImage{}, pullError(ctx, fmt.Errorf("read the image config: %w", err))
	}
	layers, err := img.Layers()
	if err != nil {
		return PulledImage{}, pullError(ctx, err)
	}
	switch n := len(layers); {
	case n == 0:
		return PulledImage{}, errdefs.New(errdefs.ErrInvalidArgument, "%s has no layer", ref.Name())
	case n > MaxImageLayers:
		return PulledImage{}, errdefs.New(errdefs.ErrInvalidArgument, "%s has %d layers: at most %d", ref.Name(), n, MaxImageLayers)
	case n != len(cf.RootFS.DiffIDs) || n != len(mf.Layers):
		return PulledImage{}, errdefs.New(errdefs.ErrInvalidArgument, "%s has %d layers and its config %d diff IDs: the image is corrupt", ref.Name(), n, len(cf.RootFS.DiffIDs))
	}
	if (cf.OS != "" && cf.OS != "linux") || (cf.Architecture != "" && cf.Architecture != runtime.GOARCH) {
		return PulledImage{}, errdefs.New(errdefs.ErrNotFound, "%s is an image for %s/%s: this node runs linux/%s", ref.Name(), cf.OS, cf.Architecture, runtime.GOARCH)
	}
	platform := "linux/" + runtime.GOARCH
	if p := cf.Platform(); p != nil {
		platform = p.String()
	}
	im := PulledImage{
		Ref:      ref.Name(),
		Digest:   digest.String(),
		Platform: platform,
		Tenant:   home,
		Config: ImageConfig{
			Env:        cf.Config.Env,
			WorkingDir: cf.Config.WorkingDir,
			User:       cf.Config.User,
			Entrypoint: cf.Config.Entrypoint,
			Cmd:        cf.Config.Cmd,
		},
	}
	if err := im.Config.check(); err != nil {
		return PulledImage{}, errdefs.New(errdefs.ErrInvalidArgument, "%s: %w", ref.Name(), err)
	}
	budget := cfg.MaxPullBytes // uncompressed bytes this pull may still convert
	for i, l := range layers {
		ld := mf.Layers[i]
		if !isLayerMediaType(ld.MediaType) {
			return PulledImage{}, errdefs.New(errdefs.ErrInvalidArgument, "layer %d of %s is a %s, not a tar layer", i+1, ref.Name(), ld.MediaType)
		}
		kind := KindWorkspace
		if i == 0 {
			kind = KindBase
		}
		tag := ociTag(kind, ld.Digest)
		fetched, reused, err := v.pullLayer(ctx, l, ld, cf.RootFS.DiffIDs[i], kind, fmt.Sprintf("layer %d/%d of %s", i+1, len(layers), from.Name()), &budget, cfg, rep)
		if err != nil {
			return PulledImage{}, pullError(ctx, fmt.Errorf("layer %d/%d (%s): %w", i+1, len(layers), ld.Digest, err))
		}
		im.Fetched += fetched
		if reused {
			im.Reused++
		}
		im.Layers = append(im.Layers, tag)
		im.OCILayers = append(im.OCILayers, ld.Digest.String())
	}
	im.Pulled = time.Now().UTC().Truncate(time.Millisecond)
	rec, err := json.Marshal(im)
	if err != nil {
		return PulledImage{}, err
	}
	err = s.db.Update(func(tx *bbolt.Tx) error {
		b, err := tx.CreateBucketIfNotExists(imagesBucket)
		if err != nil {
			return err
		}
		return b.Put(imageKey(home, ref), rec)
	})
	if err != nil {
		return PulledImage{}, fmt.Errorf("record image: %w", err)
	}
	s.log.Info("image pulled", "image", im.Ref, "tenant", home, "digest", im.Digest, "layers", len(im.Layers), "reused", im.Reused, "fetched", im.Fetched, "took", time.Since(start))
	rep.start(StageDone, "", 0, "done in %.1fs: %s, %d layers (%d here already), %s fetched",
		time.Since(start).Seconds(), im.Digest, len(im.Layers), im.Reused, humanSize(im.Fetched))
	return im, nil
}

// isLayerMediaType says whether a layer of that media type is a tar
// (plain, gzip or zstd), which is what a pull can convert.
func isLayerMediaType(mt types.MediaType) bool {
	return mt.IsLayer() || strings.HasPrefix(string(mt), "application/vnd.oci.image.layer.v1.tar")
}

// candidates returns where to look for ref: its registry's mirrors in
// order, then ref itself (last).
func candidates(ref name.Reference, cfg RegistryConfig) []name.Reference {
	var out []name.Reference
	reg := ref.Context().RegistryStr()
	for host, urls := range cfg.Mirrors {
		r, err := name.NewRegistry(host)
		if err != nil || r.RegistryStr() != reg {
			continue
		}
		for _, u := range urls {
			mhost, plain, err := parseMirror(u)
			if err != nil {
				continue
			}
			var nopts []name.Option
			if plain || slices.Contains(cfg.Insecure, mhost) {
				nopts = append(nopts, name.Insecure)
			}
			s := mhost + "/" + ref.Context().RepositoryStr()
			if d, ok := ref.(name.Digest); ok {
				s += "@" + d.DigestStr()
			} else {
				s += ":" + ref.Identifier()
			}
			if m, err := name.ParseReference(s, nopts...); err == nil {
				out = append(out, m)
			}
		}
	}
	return append(out, ref)
}

// pullKeychain: a pull's own credentials for their registries, else the
// node's keychain, else anonymous.
func pullKeychain(creds []Credential, node authn.Keychain) authn.Keychain {
	return keychainFunc(func(r authn.Resource) (authn.Authenticator, error) {
		for _, c := range creds {
			cr, err := name.NewRegistry(c.Registry)
			if err != nil || cr.RegistryStr() != r.RegistryStr() {
				continue
			}
			return authn.FromConfig(authn.AuthConfig{
				Username: c.Username, Password: c.Password,
				IdentityToken: c.IdentityToken, RegistryToken: c.RegistryToken,
			}), nil
		}
		if node != nil {
			return node.Resolve(r)
		}
		return authn.Anonymous, nil
	})
}

type keychainFunc func(authn.Resource) (authn.Authenticator, error)

func (f keychainFunc) Resolve(r authn.Resource) (authn.Authenticator, error) { return f(r) }

// registryTransport bounds the wait for a registry's response headers and
// for each byte of its bodies.
func registryTransport(cfg RegistryConfig) http.RoundTripper {
	stall := cfg.StallTimeout
	t := remote.DefaultTransport.(*http.Transport).Clone()
	if cfg.RootCAs != nil {
		t.TLSClientConfig = &tls.Config{RootCAs: cfg.RootCAs, MinVersion: tls.VersionTLS12}
	}
	t.ResponseHeaderTimeout = stall
	t.TLSHandshakeTimeout = min(stall, t.TLSHandshakeTimeout)
	t.DialContext = (&net.Dialer{Timeout: min(stall, 30*time.Second), KeepAlive: 30 * time.Second}).DialContext
	return stallTransport{rt: t, d: stall}
}

// errStalled: a registry sent nothing for the stall timeout.
var errStalled = errdefs.Mark(errdefs.ErrUnavailable, errors.New("the registry stalled"))

// pullError marks a registry's error with its errdefs kind and says what
// to do about it.
func pullError(ctx context.Context, err error) error {
	if errors.Is(err, errStalled) {
		return err
	}
	if ctx.Err() != nil {
		return errors.Join(ctx.Err(), err)
	}
	var kind error
	for _, k := range []error{errdefs.ErrInvalidArgument, errdefs.ErrNotFound, errdefs.ErrPermissionDenied, errdefs.ErrUnavailable} {
		if errors.Is(err, k) {
			return err
		}
	}
	var te *transport.Error
	if errors.As(err, &te) {
		switch {
		case te.StatusCode == http.StatusUnauthorized || te.StatusCode == http.StatusForbidden:
			return errdefs.Mark(errdefs.ErrPermissionDenied, fmt.Errorf("%w (log in with docker login, or give the server --registry-auth)", err))
		case te.StatusCode == http.StatusNotFound:
			kind = errdefs.ErrNotFound
		case te.StatusCode == http.StatusTooManyRequests || te.StatusCode >= 500:
			kind = errdefs.ErrUnavailable
		default:
			for _, d := range te.Errors {
				switch d.Code {
				case transport.ManifestUnknownErrorCode, transport.NameUnknownErrorCode, transport.BlobUnknownErrorCode:
					kind = errdefs.ErrNotFound
				case transport.UnauthorizedErrorCode, transport.DeniedErrorCode:
					kind = errdefs.ErrPermissionDenied
				}
			}
		}
		if kind == nil {
			kind = errdefs.ErrInvalidArgument
		}
		return errdefs.Mark(kind, err)
	}
	var ne net.Error
	var ue *url.Error
	if errors.As(err, &ne) || errors.As(err, &ue) {
		return errdefs.Mark(errdefs.ErrUnavailable, err)
	}
	return errdefs.Mark(errdefs.ErrInvalidArgument, err)
}

// pullLocks serialises the conversions of one OCI layer on this node, so
// two pulls that share a layer fetch it once.
var pullLocks = struct {
	mu sync.Mutex
	m  map[string]*pullLock
}{m: map[string]*pullLock{}}

type pullLock struct {
	mu   sync.Mutex
	refs int
}

func lockLayer(key string) func() {
	pullLocks.mu.Lock()
	l := pullLocks.m[key]
	if l == nil {
		l = &pullLock{}
		pullLocks.m[key] = l
	}
	l.refs++
	pullLocks.mu.Unlock()
	l.mu.Lock()
	return func() {
		l.mu.Unlock()
		pullLocks.mu.Lock()
		if l.refs--; l.refs == 0 {
			delete(pullLocks.m, key)
		}
		pullLocks.mu.Unlock()
	}
}

// pullLayer makes sure the layer of that OCI digest and kind is here (or
// in the layer store): found under its tag, or fetched and converted. The
// two kinds are two conversions (a bottom layer's whiteouts are dropped),
// so an OCI layer that is the bottom of one image and above the bottom of
// another is fetched once for each. It returns the bytes fetched and
// whether it was found.
func (v View) pullLayer(ctx context.Context, l v1.Layer, ld v1.Descriptor, diffID v1.Hash, kind Kind, what string, budget *int64, cfg RegistryConfig, rep *reporter) (fetched int64, reused bool, err error) {
	if ld.Digest.Algorithm != "sha256" || diffID.Algorithm != "sha256" {
		return 0, false, errdefs.New(errdefs.ErrInvalidArgument, "digest %s, diff ID %s: only sha256 is supported", ld.Digest, diffID)
	}
	if ld.Size < 0 {
		return 0, false, errdefs.New(errdefs.ErrInvalidArgument, "negative size")
	}
	s := v.s
	home, err := v.o.home()
	if err != nil {
		return 0, false, err
	}
	tag := ociTag(kind, ld.Digest)
	unlock := lockLayer(s.dir + "\x00" + ld.Digest.String())
	defer unlock()
	if _, err := v.Resolve(tag); err == nil {
		rep.start(StageFetch, "bytes", 0, "%s: %s here already", what, ld.Digest)
		return 0, true, nil
	} else if !errors.Is(err, ErrNotFound) {
		return 0, false, err
	}
	if ok, err := v.tagConverted(tag, home); err != nil || ok {
		if ok {
			rep.start(StageFetch, "bytes", 0, "%s: %s here already", what, ld.Digest)
		}
		return 0, ok, err
	}
	start := time.Now()
	work, err := os.MkdirTemp(s.tmp, "pull-")
	if err != nil {
		return 0, false, err
	}
	defer os.RemoveAll(work)
	root := filepath.Join(work, "root")
	rep.start(StageFetch, "bytes", ld.Size, "%s: fetching %s (%s)", what, ld.Digest, humanSize(ld.Size))
	n, err := fetchLayer(ctx, l, diffID, root, kind == KindBase, budget, cfg, rep)
	if err != nil {
		return n, false, err
	}
	name, version, _ := ParseTag(tag)
	spec, err := newSpec(kind, name, version, "")
	if err != nil {
		return n, false, err
	}
	spec.source = "oci layer " + ld.Digest.String()
	spec.tenant = home
	spec.tree, spec.whiteouts, spec.start = root, true, start
	if _, err := s.make(ctx, work, spec, rep); err != nil {
		return n, false, err
	}
	return n, false, nil
}

// tagConverted gives namespace home a tag of its own (tag) to the layer
// another namespace converted under the same tag (the same OCI digest and
// kind), if one did; ok says it did.
func (v View) tagConverted(tag, home string) (ok bool, err error) {
	s := v.s
	s.gcMu.RLock() // the image must not be collected between finding and tagging
	defer s.gcMu.RUnlock()
	var l Layer
	err = s.db.View(func(tx *bbolt.Tx) error {
		return tx.Bucket(tagsBucket).ForEach(func(k, val []byte) error {
			if ok || !(string(k) == tag || strings.HasSuffix(string(k), "/"+tag)) {
				return nil
			}
			if err := json.Unmarshal(val, &l); err != nil {
				return fmt.Errorf("decode tag %s: %w", k, err)
			}
			_, statErr := os.Stat(s.ImagePath(l.Digest))
			ok = statErr == nil
			return nil
		})
	})
	if err != nil || !ok {
		return false, err
	}
	l.Tenant = home
	if _, _, err := s.tag(l); err != nil {
		return false, fmt.Errorf("tag %s: %w", tag, err)
	}
	return true, nil
}

// fetchLayer reads an OCI layer's blob (its digest checked by the
// registry client as it is read), decompresses it, checks the result
// against diffID and extracts it into root with its whiteouts turned into
// overlayfs's (or, for an image's bottom layer, dropped). A registry that
// stalls ends the fetch (registryTransport).
func fetchLayer(ctx context.Context, l v1.Layer, diffID v1.Hash, root string, bottom bool, budget *int64, cfg RegistryConfig, rep *reporter) (int64, error) {
	rc, err := l.Compressed()
	if err != nil {
		return 0, err
	}
	defer rc.Close()
	size, _ := l.Size()
	counted := &countingReader{r: rc, total: size, rep: rep}
	br := bufio.NewReaderSize(counted, 1<<20)
	var r io.Reader = br
	magic, _ := br.Peek(4)
	switch {
	case bytes.HasPrefix(magic, gzipMagic):
		zr, err := gzip.NewReader(br)
		if err != nil {
			return counted.n, badLayer(fmt.Errorf("gzip: %w", err))
		}
		defer zr.Close()
		r = zr
	case bytes.HasPrefix(magic, zstdMagic):
		zr, err := zstd.NewReader(br, zstd.WithDecoderConcurrency(1))
		if err != nil {
			return counted.n, badLayer(fmt.Errorf("zstd: %w", err))
		}
		defer zr.Close()
		r = zr
	}
	h := sha256.New()
	lim := &io.LimitedReader{R: r, N: *budget + 1}
	defer func() { *budget = max(lim.N-1, 0) }()
	tr := io.TeeReader(lim, h)
	// The bottom layer of an image hides nothing: its whiteouts are
	// dropped (overlayfs would list them where no lower layer has the
	// directory). The others keep theirs, as overlayfs's.
	x, err := newExtractor(root, bottom)
	if err != nil {
		return counted.n, err
	}
	defer x.close()
	x.overlay = !bottom
	x.maxEntries = maxLayerEntries
	if err := x.apply(ctx, tr); err != nil {
		if lim.N <= 0 {
			return counted.n, errdefs.New(errdefs.ErrInvalidArgument, "the image holds more than %s uncompressed (serve --registry-max-pull-bytes)", humanSize(cfg.MaxPullBytes))
		}
		return counted.n, badLayer(err)
	}
	if _, err := io.Copy(io.Discard, tr); err != nil { // the tar's padding, and the blob's end (where its digest is checked)
		return counted.n, badLayer(err)
	}
	if lim.N <= 0 {
		return counted.n, errdefs.New(errdefs.ErrInvalidArgument, "the image holds more than %s uncompressed (serve --registry-max-pull-bytes)", humanSize(cfg.MaxPullBytes))
	}
	// Read the compressed stream to its end: the registry client checks
	// the blob's digest at EOF.
	if _, err := io.Copy(io.Discard, br); err != nil {
		return counted.n, badLayer(err)
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != diffID.Hex {
		return counted.n, errdefs.New(errdefs.ErrInvalidArgument, "content is sha256:%s, the image config says %s: the image is corrupt", got, diffID)
	}
	if err := x.finishDirs(); err != nil {
		return counted.n, err
	}
	rep.update(counted.n, counted.n)
	return counted.n, nil
}

// badLayer marks an error reading a layer as the layer's fault
// (errdefs.ErrInvalidArgument), unless the registry stalled or the pull
// was cancelled.
func badLayer(err error) error {
	if errors.Is(err, errStalled) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return errdefs.Mark(errdefs.ErrInvalidArgument, err)
}

// stallTransport bounds the wait for each byte of a response body: one
// that sends nothing for d is closed, and its reads fail with errStalled.
type stallTransport struct {
	rt http.RoundTripper
	d  time.Duration
}

func (t stallTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := t.rt.RoundTrip(r)
	if err != nil {
		return nil, err
	}
	b := &stallBody{rc: resp.Body, d: t.d}
	b.t = time.AfterFunc(t.d, func() { b.stalled.Store(true); b.rc.Close() })
	resp.Body = b
	return resp, nil
}

type stallBody struct {
	rc      io.ReadCloser
	d       time.Duration
	t       *time.Timer
	stalled atomic.Bool
}

func (b *stallBody) Read(p []byte) (int, error) {
	n, err := b.rc.Read(p)
	if n > 0 {
		b.t.Reset(b.d)
	}
	if err != nil && err != io.EOF && b.stalled.Load() {
		err = fmt.Errorf("%w: nothing for %s", errStalled, b.d)
	}
	return n, err
}

func (b *stallBody) Close() error {
	b.t.Stop()
	return b.rc.Close()
}

// overlayWhiteout turns an OCI whiteout of a layer kept on its own into
// overlayfs's: ".wh..wh..opq" marks dir opaque (trusted.overlay.opaque=y),
// ".wh.NAME" makes NAME a character device 0/0. Both hide what lower
// layers have there.
func (x *extractor) overlayWhiteout(dir, base string) error {
	if dir != "." {
		if err := x.prepare(dir, tar.TypeDir); err != nil {
			return err
		}
		if e := x.entries[dir]; e == nil {
			if err := x.root.Mkdir(dir, 0o755); err != nil {
				return err
			}
			x.entries[dir] = &entry{typ: tar.TypeDir}
		} else if e.typ != tar.TypeDir {
			return fmt.Errorf("whiteout in %q, which is not a directory", dir)
		}
	}
	switch {
	case base == whiteoutOpaque:
		return x.markOpaque(dir)
	case strings.HasPrefix(base, whiteoutMeta):
		return nil
	}
	target := strings.TrimPrefix(base, whiteoutPrefix)
	name := path.Join(dir, target)
	if target == "" || strings.Contains(target, "/") || name == dir || !filepath.IsLocal(name) {
		return fmt.Errorf("bad whiteout %q", base)
	}
	if e := x.entries[name]; e != nil && x.current[name] {
		// This layer has its own NAME: it replaces what the lower
		// layers have (a directory hides theirs).
		if e.typ == tar.TypeDir {
			return x.markOpaque(name)
		}
		return nil
	}
	if err := x.prepare(name, tar.TypeChar); err != nil {
		return err
	}
	d, err := x.root.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := unix.Mknodat(int(d.Fd()), target, unix.S_IFCHR|0o000, 0); err != nil {
		return fmt.Errorf("whiteout %s: %w", name, err)
	}
	x.entries[name] = &entry{typ: tar.TypeChar}
	return nil
}

// markOpaque makes dir (a directory this extraction made) opaque: the
// directories of lower layers at its path do not show through it.
func (x *extractor) markOpaque(dir string) error {
	d, err := x.root.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := unix.Fsetxattr(int(d.Fd()), "trusted.overlay.opaque", []byte("y"), 0); err != nil {
		return fmt.Errorf("mark %s opaque: %w", dir, err)
	}
	return nil
}

// dropOverlayXattrs removes overlayfs's own attributes from a tar entry
// (extractor.entry): only the whiteouts an extraction makes may steer
// overlayfs (a redirect or metacopy from an image would reach into other
// layers).
func dropOverlayXattrs(hdr *tar.Header) {
	for k := range hdr.PAXRecords {
		if strings.HasPrefix(k, "SCHILY.xattr.trusted.overlay.") || strings.HasPrefix(k, "SCHILY.xattr.user.overlay.") {
			delete(hdr.PAXRecords, k)
		}
	}
}

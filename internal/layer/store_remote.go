package layer

// A node's layer store (remote.Store): push and pull of whole layers,
// resolution of references this node does not hold, and mounts straight
// from the store (file://) or lazily through FUSE (s3://).
//
// Layout of a store (keys):
//
//	blobs/sha256/<hex>          the EROFS image
//	blobs/sha256/<hex>.chunks   its chunk digest list (lazy.Manifest, JSON)
//	blobs/sha256/<hex>.json     the Layer as pushed (JSON)
//	tags/<name>/<version>       the Layer the tag points at (JSON), written last

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strings"
	"sync"
	"time"

	"go.etcd.io/bbolt"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/layer/lazy"
	"github.com/shoal-sandbox/shoal/internal/layer/remote"
)

// RemoteConfig attaches a layer store to a Store.
type RemoteConfig struct {
	Store remote.Store
	// Lazy serves images of a store with no LocalPath (s3://) on demand;
	// without it such an image is pulled whole on first use.
	Lazy *lazy.FS
	// WriteThrough pushes every layer built, committed or imported.
	WriteThrough bool
	// ChunkSize of the chunk lists push writes (lazy.DefaultChunkSize if 0).
	ChunkSize int64
	// CacheMax bounds the bytes of whole images copied from the store
	// (cache.go); 0: no bound.
	CacheMax int64
}

// remoteTimeout bounds a metadata request to the store.
const remoteTimeout = 30 * time.Second

// SetRemote attaches a layer store. Call it before serving.
func (s *Store) SetRemote(c RemoteConfig) {
	if c.ChunkSize == 0 {
		c.ChunkSize = lazy.DefaultChunkSize
	}
	s.remote = &c
}

// RemoteStore returns the attached layer store, or nil.
func (s *Store) RemoteStore() remote.Store {
	if s.remote == nil {
		return nil
	}
	return s.remote.Store
}

// Lazy returns the lazy loader, or nil.
func (s *Store) Lazy() *lazy.FS {
	if s.remote == nil {
		return nil
	}
	return s.remote.Lazy
}

func blobKey(digest string) string   { return "blobs/sha256/" + strings.TrimPrefix(digest, "sha256:") }
func chunksKey(digest string) string { return blobKey(digest) + ".chunks" }
func metaKey(digest string) string   { return blobKey(digest) + ".json" }

// tagKey is the store's key of a tag: "tags/<name>/<version>" for a
// shared one, "tenants/<tenant>/tags/<name>/<version>" for a tenant's.
func tagKey(tenant, name, version string) string {
	if tenant != "" {
		return "tenants/" + tenant + "/tags/" + name + "/" + version
	}
	return "tags/" + name + "/" + version
}

// ErrNoStore: the node has no layer store configured.
var ErrNoStore = errdefs.Mark(errdefs.ErrFailedPrecondition, errors.New("no layer store configured (shoal serve --layer-store URL)"))

// PushResult says what a push sent.
type PushResult struct {
	Store         string
	UploadedBytes int64 // 0 if the store already had the image
}

// Push copies the layer ref names to the layer store: its image and chunk
// list (unless the store has them), its metadata, then its tag.
func (s *Store) Push(ctx context.Context, ref string) (Layer, PushResult, error) {
	return s.PushProgress(ctx, ref, nil)
}

// Stages of a push (Progress.Stage), in the order they run.
const (
	StageUpload = "upload" // the image's bytes sent to the store
	StageChunks = "chunks" // the image read again for its chunk digest list
)

// PushProgress is Push reporting its progress to progress (nil: none): a
// line at the start of each stage (StageUpload, StageChunks, StageDone),
// byte counts in between, the last one of a stage equal to its total.
func (s *Store) PushProgress(ctx context.Context, ref string, progress func(Progress)) (Layer, PushResult, error) {
	return s.As(AdminOwner).PushProgress(ctx, ref, progress)
}

// PushProgress is Store.PushProgress of one of the owner's layers (a
// shared one is the admin's to push: ErrReadOnly).
func (v View) PushProgress(ctx context.Context, ref string, progress func(Progress)) (Layer, PushResult, error) {
	s := v.s
	if s.remote == nil {
		return Layer{}, PushResult{}, fmt.Errorf("push layer %s: %w", ref, ErrNoStore)
	}
	l, f, err := v.OpenExport(ctx, ref)
	if err != nil {
		return Layer{}, PushResult{}, fmt.Errorf("push layer %s: %w", ref, err)
	}
	if !v.o.writes(l.Tenant) {
		f.Close()
		return Layer{}, PushResult{}, fmt.Errorf("push layer %s: %w", ref, ErrReadOnly)
	}
	defer f.Close()
	rep := newReporter(progress)
	res, err := s.push(ctx, l, f, rep)
	if err != nil {
		return Layer{}, PushResult{}, fmt.Errorf("push layer %s to %s: %w", ref, s.remote.Store.URL(), err)
	}
	rep.start(StageDone, "", 0, "pushed %s to %s (%s uploaded)", l.Ref(), res.Store, humanSize(res.UploadedBytes))
	s.log.Info("layer pushed", "layer", l.Ref(), "digest", l.Digest, "store", res.Store, "uploaded", res.UploadedBytes)
	return l, res, nil
}

func (s *Store) push(ctx context.Context, l Layer, img *os.File, rep *reporter) (PushResult, error) {
	st := s.remote.Store
	res := PushResult{Store: st.URL()}
	size, err := st.Stat(ctx, blobKey(l.Digest))
	have := err == nil && size == l.Size
	if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		return res, err
	}
	if !have {
		rep.start(StageUpload, "bytes", l.Size, "uploading %s (%s) to %s", l.Ref(), humanSize(l.Size), st.URL())
		if err := st.Put(ctx, blobKey(l.Digest), &progressSection{sr: io.NewSectionReader(img, 0, l.Size), rep: rep}, l.Size); err != nil {
			return res, err
		}
		res.UploadedBytes = l.Size
	} else {
		rep.start(StageUpload, "bytes", 0, "%s has the image of %s already", st.URL(), l.Ref())
	}
	if _, err := st.Stat(ctx, chunksKey(l.Digest)); !have || err != nil {
		rep.start(StageChunks, "bytes", l.Size, "chunk list of %s", l.Ref())
		m, err := lazy.BuildManifest(&countingReader{r: io.NewSectionReader(img, 0, l.Size), total: l.Size, rep: rep}, s.remote.ChunkSize)
		if err != nil {
			return res, fmt.Errorf("chunk list: %w", err)
		}
		b, _ := json.Marshal(m)
		if err := st.Put(ctx, chunksKey(l.Digest), bytes.NewReader(b), int64(len(b))); err != nil {
			return res, err
		}
	}
	pushed := l
	pushed.Remote, pushed.Mirrored = "", 0
	b, err := json.Marshal(pushed)
	if err != nil {
		return res, err
	}
	if err := st.Put(ctx, metaKey(l.Digest), bytes.NewReader(b), int64(len(b))); err != nil {
		return res, err
	}
	if err := st.Put(ctx, tagKey(l.Tenant, l.Name, l.Version), bytes.NewReader(b), int64(len(b))); err != nil {
		return res, err
	}
	return res, nil
}

// progressSection is an image being uploaded: an io.SectionReader (its
// ReadAt and Seek kept, for stores that read by offset or rewind) that
// reports the furthest byte read.
type progressSection struct {
	sr   *io.SectionReader
	rep  *reporter
	mu   sync.Mutex // guards high, and orders reports (ReadAt may be called concurrently)
	high int64
}

func (p *progressSection) reached(off int64) {
	p.mu.Lock()
	defer p.mu.Unlock() // held while reporting: reports never go back
	if off <= p.high {  // nothing new (a read at EOF, a re-read)
		return
	}
	p.high = off
	p.rep.update(off, p.sr.Size())
}

func (p *progressSection) Read(b []byte) (int, error) {
	n, err := p.sr.Read(b)
	if pos, serr := p.sr.Seek(0, io.SeekCurrent); serr == nil {
		p.reached(pos)
	}
	return n, err
}

func (p *progressSection) ReadAt(b []byte, off int64) (int, error) {
	n, err := p.sr.ReadAt(b, off)
	p.reached(off + int64(n))
	return n, err
}

func (p *progressSection) Seek(off int64, whence int) (int64, error) { return p.sr.Seek(off, whence) }
func (p *progressSection) Size() int64                               { return p.sr.Size() }

// pushAfterInstall is the write-through push of a layer just installed.
// On a node of a cluster it is always done (before the cluster's tag
// names the layer): every node resolves the cluster's tags, and mounts
// what it does not hold from the store.
func (s *Store) pushAfterInstall(l Layer) error {
	if s.remote == nil || !s.remote.WriteThrough && s.cluster == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	f, err := os.Open(s.ImagePath(l.Digest))
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := s.push(ctx, l, f, nil); err != nil {
		return fmt.Errorf("write-through push to %s: %w", s.remote.Store.URL(), err)
	}
	return nil
}

// Pull copies the layer ref names from the layer store to this node (the
// whole image, its digest checked) and tags it here.
func (s *Store) Pull(ctx context.Context, ref string) (Layer, error) {
	return s.As(AdminOwner).Pull(ctx, ref)
}

// Pull is Store.Pull of one of the owner's layers in the store, tagged
// here in the namespace it has there; a shared one is the admin's to pull
// (ErrReadOnly: a tenant's create resolves it from the store without).
func (v View) Pull(ctx context.Context, ref string) (Layer, error) {
	s := v.s
	if s.remote == nil {
		return Layer{}, fmt.Errorf("pull layer %s: %w", ref, ErrNoStore)
	}
	p, err := parseRef(ref)
	if err != nil {
		return Layer{}, fmt.Errorf("pull layer %s: %w", ref, err)
	}
	l, err := v.remoteLayer(ctx, p, v.o.namespaces(p))
	if err != nil {
		return Layer{}, fmt.Errorf("pull layer %s: %w", ref, err)
	}
	if !v.o.writes(l.Tenant) {
		return Layer{}, fmt.Errorf("pull layer %s: %w", ref, ErrReadOnly)
	}
	if err := s.download(ctx, l); err != nil {
		return Layer{}, fmt.Errorf("pull layer %s from %s: %w", ref, s.remote.Store.URL(), err)
	}
	l.Remote = ""
	s.gcMu.RLock()
	tagged, _, err := s.tag(l)
	s.gcMu.RUnlock()
	if err != nil {
		return Layer{}, fmt.Errorf("pull layer %s: tag: %w", ref, err)
	}
	return tagged, nil
}

// download fetches l's whole image into blobs (nothing if it is there).
func (s *Store) download(ctx context.Context, l Layer) error {
	if _, err := os.Stat(s.ImagePath(l.Digest)); err == nil {
		return nil
	}
	rc, size, err := s.remote.Store.Get(ctx, blobKey(l.Digest))
	if err != nil {
		return err
	}
	defer rc.Close()
	if size != l.Size {
		return errdefs.New(errdefs.ErrFailedPrecondition, "the store's image of %s has %d bytes, its record says %d", l.Digest, size, l.Size)
	}
	f, err := os.CreateTemp(s.tmp, "pull-*.erofs")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(io.MultiWriter(f, h), ctxReader{ctx, io.LimitReader(rc, l.Size)}); err != nil {
		return err
	}
	if got := "sha256:" + hex.EncodeToString(h.Sum(nil)); got != l.Digest {
		return errdefs.New(errdefs.ErrFailedPrecondition, "the store's image of %s hashes to %s: it is corrupt", l.Digest, got)
	}
	if err := f.Sync(); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	s.gcMu.RLock()
	defer s.gcMu.RUnlock()
	return s.install(f.Name(), l.Digest)
}

// remoteLayer reads the record of reference p from the store: a tag in
// the first of namespaces nss that has it, or a digest the owner sees
// (its record the owner's or shared).
func (v View) remoteLayer(ctx context.Context, p parsedRef, nss []string) (Layer, error) {
	if p.version == "" {
		l, err := v.s.remoteRecord(ctx, p, metaKey(p.digest))
		if err == nil && !v.o.reads(l.Tenant) {
			err = fmt.Errorf("%s: %w", p.digest, ErrNotFound)
		}
		return l, err
	}
	for _, ns := range nss {
		l, err := v.s.remoteRecord(ctx, p, tagKey(ns, p.name, p.version))
		if errors.Is(err, ErrNotFound) {
			continue
		}
		if err == nil && l.Tenant != ns {
			err = fmt.Errorf("%s: %w (the store's record of tenant %q is under %q)", p.key(ns), ErrNotFound, l.Tenant, ns)
		}
		return l, err
	}
	return Layer{}, fmt.Errorf("%s:%s: %w (not here, not in %s)", p.name, p.version, ErrNotFound, v.s.remote.Store.URL())
}

// remoteRecord reads the record at key of the store, for reference p.
func (s *Store) remoteRecord(ctx context.Context, p parsedRef, key string) (Layer, error) {
	rc, size, err := s.remote.Store.Get(ctx, key)
	if err != nil {
		if errors.Is(err, errdefs.ErrNotFound) {
			return Layer{}, fmt.Errorf("%s: %w (not here, not in %s)", key, ErrNotFound, s.remote.Store.URL())
		}
		return Layer{}, err
	}
	defer rc.Close()
	if size > maxExportMeta {
		return Layer{}, errdefs.New(errdefs.ErrFailedPrecondition, "record %s in the store is %d bytes", key, size)
	}
	raw, err := io.ReadAll(io.LimitReader(rc, maxExportMeta))
	if err != nil {
		return Layer{}, err
	}
	var l Layer
	if err := json.Unmarshal(raw, &l); err != nil {
		return Layer{}, errdefs.New(errdefs.ErrFailedPrecondition, "record %s in the store: %v", key, err)
	}
	if _, err := newSpec(l.Kind, l.Name, l.Version, l.Compression); err != nil {
		return Layer{}, errdefs.Mark(errdefs.ErrFailedPrecondition, fmt.Errorf("record %s in the store: %w", key, err))
	}
	if _, err := checkTenant(l.Tenant); err != nil {
		return Layer{}, errdefs.Mark(errdefs.ErrFailedPrecondition, fmt.Errorf("record %s in the store: %w", key, err))
	}
	if err := validateDigest(l.Digest); err != nil || (p.digest != "" && l.Digest != p.digest) || (p.name != "" && l.Name != p.name) {
		return Layer{}, fmt.Errorf("%s: %w (the store's record %s does not match)", key, ErrNotFound, key)
	}
	if l.Size <= 0 {
		return Layer{}, errdefs.New(errdefs.ErrFailedPrecondition, "record %s in the store: size %d", key, l.Size)
	}
	return l, nil
}

// resolveRemote resolves a reference this node does not hold from the
// store and records the layer by digest (marked Remote), so that the
// digest resolves here from now on, and its image is mounted from the
// store when a sandbox uses it.
func (v View) resolveRemote(p parsedRef, nss []string) (Layer, error) {
	s := v.s
	ctx, cancel := context.WithTimeout(context.Background(), remoteTimeout)
	defer cancel()
	l, err := v.remoteLayer(ctx, p, nss)
	if err != nil {
		return Layer{}, fmt.Errorf("resolve layer: %w", err)
	}
	l.Remote = s.remote.Store.URL()
	val, err := json.Marshal(l)
	if err != nil {
		return Layer{}, err
	}
	err = s.db.Update(func(tx *bbolt.Tx) error {
		b := tx.Bucket(blobsBucket)
		if b.Get([]byte(l.Digest)) != nil {
			return nil // a local record wins
		}
		return b.Put([]byte(l.Digest), val)
	})
	if err != nil {
		return Layer{}, fmt.Errorf("resolve layer: record: %w", err)
	}
	return l, nil
}

// blobRecord returns the record of digest.
func (s *Store) blobRecord(digest string) (Layer, bool, error) {
	var l Layer
	var found bool
	err := s.db.View(func(tx *bbolt.Tx) error {
		var err error
		found, err = get(tx.Bucket(blobsBucket), digest, &l)
		return err
	})
	return l, found, err
}

// remoteImage returns what to mount for an image this node holds no copy
// of: the store's own file (file://), or a loop device over the lazy FUSE
// file (s3://), and what to undo after unmounting. If dir is already an
// EROFS mount of this image on a loop device over a lazy file (left by an
// earlier process, whose FUSE server is gone), that loop device is turned
// to this process's lazy file and returned with repointed set: the mount,
// and the sandboxes reading through it, go on. Called with s.mu held.
func (s *Store) remoteImage(digest, dir string) (src string, release func(), repointed bool, err error) {
	if s.remote == nil {
		return "", nil, false, fmt.Errorf("no image: %w", ErrNotFound)
	}
	l, found, err := s.blobRecord(digest)
	if err != nil {
		return "", nil, false, err
	}
	if !found {
		ctx, cancel := context.WithTimeout(context.Background(), remoteTimeout)
		defer cancel()
		if l, err = s.remoteRecord(ctx, parsedRef{digest: digest}, metaKey(digest)); err != nil {
			return "", nil, false, err
		}
	}
	st := s.remote.Store
	if p := st.LocalPath(blobKey(digest)); p != "" {
		fi, err := os.Stat(p)
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return "", nil, false, fmt.Errorf("no image here or in %s: %w", st.URL(), ErrNotFound)
			}
			return "", nil, false, err
		}
		if fi.Size() != l.Size {
			return "", nil, false, errdefs.New(errdefs.ErrFailedPrecondition, "%s holds %d bytes for %s, its record says %d", p, fi.Size(), digest, l.Size)
		}
		return p, nil, false, nil
	}
	if s.remote.Lazy == nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
		defer cancel()
		if err := s.download(ctx, l); err != nil {
			return "", nil, false, err
		}
		s.trimCacheLocked(digest)
		return s.ImagePath(digest), nil, false, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), remoteTimeout)
	defer cancel()
	m, err := s.manifest(ctx, digest, l.Size)
	if err != nil {
		return "", nil, false, err
	}
	hexd := strings.TrimPrefix(digest, "sha256:")
	file, err := s.remote.Lazy.Open(hexd, blobKey(digest), m)
	if err != nil {
		return "", nil, false, err
	}
	dev, err := repointLoop(dir, file, hexd)
	if err != nil {
		s.log.Warn("lazy layer: cannot turn the earlier mount's loop device to the new loader; mounting it afresh", "layer", digest, "err", err)
	}
	if dev != nil {
		s.log.Info("lazy layer mount taken over", "layer", digest, "device", dev.path)
		return dev.path, func() {
			dev.Close()
			s.remote.Lazy.Close(hexd)
		}, true, nil
	}
	if dev, err = attachLoop(file); err != nil {
		s.remote.Lazy.Close(hexd)
		return "", nil, false, err
	}
	return dev.path, func() {
		dev.Close()
		s.remote.Lazy.Close(hexd)
	}, false, nil
}

// manifest reads and checks the chunk list of digest.
func (s *Store) manifest(ctx context.Context, digest string, size int64) (lazy.Manifest, error) {
	rc, n, err := s.remote.Store.Get(ctx, chunksKey(digest))
	if err != nil {
		return lazy.Manifest{}, fmt.Errorf("chunk list of %s: %w", digest, err)
	}
	defer rc.Close()
	if n > lazy.MaxManifestBytes {
		return lazy.Manifest{}, errdefs.New(errdefs.ErrFailedPrecondition, "chunk list of %s has %d bytes", digest, n)
	}
	var m lazy.Manifest
	if err := json.NewDecoder(io.LimitReader(rc, lazy.MaxManifestBytes)).Decode(&m); err != nil {
		return lazy.Manifest{}, errdefs.New(errdefs.ErrFailedPrecondition, "chunk list of %s: %v", digest, err)
	}
	if err := m.Validate(size); err != nil {
		return lazy.Manifest{}, errdefs.New(errdefs.ErrFailedPrecondition, "chunk list of %s: %v", digest, err)
	}
	return m, nil
}

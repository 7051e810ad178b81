package layer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"go.etcd.io/bbolt"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// Usage says which images are used outside the Store: digest -> the IDs of
// the sandboxes using it (in any state). The node computes it; the Store
// never removes an image that appears in it.
type Usage map[string][]string

// Tag is View.Tag for the admin: target is a shared tag unless qualified
// ("tenant/name:version").
func (s *Store) Tag(source, target string) (Layer, string, error) {
	return s.As(AdminOwner).Tag(source, target)
}

// Tag points the owner's tag target ("name:version", in the owner's
// namespace) at the layer source names as the owner sees it (a tag,
// name@digest or digest), in one bbolt transaction: a concurrent Resolve
// sees the old layer or the new one. It returns the layer the tag now
// points at and the digest it pointed at before ("" if it is new). A
// tenant's tags are its own: it cannot move a shared tag (ErrReadOnly) nor
// another tenant's (its own of the same name is a different tag).
func (v View) Tag(source, target string) (Layer, string, error) {
	s := v.s
	p, err := parseRef(target)
	if err == nil && p.version == "" {
		err = fmt.Errorf("%w %q: want a tag name:version, not a digest", ErrInvalidRef, target)
	}
	if err != nil {
		return Layer{}, "", errdefs.Mark(errdefs.ErrInvalidArgument, fmt.Errorf("tag %s: %w", target, err))
	}
	ns, err := v.o.target(p)
	if err != nil {
		return Layer{}, "", fmt.Errorf("tag %s: %w", target, err)
	}
	key := p.key(ns)
	s.gcMu.RLock() // the image must not be collected between resolving and tagging
	defer s.gcMu.RUnlock()
	l, err := v.Resolve(source)
	if err != nil {
		return Layer{}, "", fmt.Errorf("tag %s as %s: %w", source, target, err)
	}
	l.Name, l.Version, l.Mirrored, l.Tenant = p.name, p.version, 0, ns
	if s.cluster != nil { // the cluster's tag, moved in etcd first
		if _, err := os.Stat(s.ImagePath(l.Digest)); err == nil && s.remote != nil {
			// An image this node holds: in the store before the tag
			// names it (the store keeps what it has already).
			if err := s.pushAfterInstall(l); err != nil {
				return Layer{}, "", fmt.Errorf("tag %s as %s: %w", source, target, err)
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), clusterTagTimeout)
		defer cancel()
		tagged, old, err := s.cluster.PutTag(ctx, l)
		if err != nil {
			return Layer{}, "", fmt.Errorf("tag %s as %s: %w", source, target, err)
		}
		if old != tagged.Digest {
			s.log.Info("layer tagged in the cluster", "layer", key, "digest", tagged.Digest, "from", old)
		}
		return tagged, old, nil
	}
	val, err := json.Marshal(l)
	if err != nil {
		return Layer{}, "", err
	}
	var old string
	err = s.db.Update(func(tx *bbolt.Tx) error {
		var prev Layer
		found, err := get(tx.Bucket(tagsBucket), key, &prev)
		if err != nil {
			return err
		}
		if found {
			old = prev.Digest
		}
		return tx.Bucket(tagsBucket).Put([]byte(key), val)
	})
	if err != nil {
		return Layer{}, "", fmt.Errorf("tag %s as %s: %w", source, target, err)
	}
	if old != l.Digest {
		s.log.Info("layer tagged", "layer", key, "digest", l.Digest, "from", old)
	}
	return l, old, nil
}

// Image is one stored image and the tags that point at it.
type Image struct {
	Layer          // the tag's layer, or the image as last built if untagged
	Tags  []string // "name:version", sorted; empty if dangling
}

// Images returns every stored image with its tags (those of a tenant
// qualified, "tenant/name:version"), sorted by the first tag (untagged
// images last, by name then digest).
func (s *Store) Images() ([]Image, error) { return s.images(AdminOwner) }

// images returns every stored image with the tags o sees.
func (s *Store) images(o Owner) ([]Image, error) {
	var out []Image
	err := s.db.View(func(tx *bbolt.Tx) error {
		tags, err := tagsByDigest(tx)
		if err != nil {
			return err
		}
		return tx.Bucket(blobsBucket).ForEach(func(k, v []byte) error {
			var l Layer
			if err := json.Unmarshal(v, &l); err != nil {
				return fmt.Errorf("decode image %s: %w", k, err)
			}
			im := Image{Layer: l}
			for _, t := range tags[l.Digest] {
				if !o.reads(t.Tenant) {
					continue
				}
				if len(im.Tags) == 0 {
					im.Layer = t
				}
				im.Tags = append(im.Tags, o.displayTag(t))
			}
			if len(im.Tags) == 0 && len(tags[l.Digest]) > 0 && !o.Admin {
				return nil // tagged by others only: theirs
			}
			sort.Strings(im.Tags)
			out = append(out, im)
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("list images: %w", err)
	}
	slices.SortFunc(out, func(a, b Image) int {
		switch {
		case len(a.Tags) > 0 && len(b.Tags) > 0:
			return strings.Compare(a.Tags[0], b.Tags[0])
		case len(a.Tags) > 0:
			return -1
		case len(b.Tags) > 0:
			return 1
		}
		if c := strings.Compare(a.Name, b.Name); c != 0 {
			return c
		}
		return strings.Compare(a.Digest, b.Digest)
	})
	return out, nil
}

// Tags returns the tags that point at digest (of every tenant, those of
// a tenant qualified), sorted.
func (s *Store) Tags(digest string) ([]string, error) { return s.tags(AdminOwner, digest) }

func (s *Store) tags(o Owner, digest string) ([]string, error) {
	var out []string
	err := s.db.View(func(tx *bbolt.Tx) error {
		tags, err := tagsByDigest(tx)
		for _, t := range tags[digest] {
			if o.reads(t.Tenant) {
				out = append(out, o.displayTag(t))
			}
		}
		return err
	})
	sort.Strings(out)
	return out, err
}

// tagsByDigest maps each tagged digest to the layers of its tags, sorted by
// tag.
func tagsByDigest(tx *bbolt.Tx) (map[string][]Layer, error) {
	out := map[string][]Layer{}
	err := tx.Bucket(tagsBucket).ForEach(func(k, v []byte) error {
		var l Layer
		if err := json.Unmarshal(v, &l); err != nil {
			return fmt.Errorf("decode tag %s: %w", k, err)
		}
		out[l.Digest] = append(out[l.Digest], l)
		return nil
	})
	return out, err
}

// RemoveResult says what Remove did.
type RemoveResult struct {
	Untagged   []string // tags removed
	Removed    []Layer  // images removed
	FreedBytes int64
}

// Remove removes a layer reference as the admin (View.Remove for a
// tenant):
//   - a tag "name:version": the tag goes, and so does its image unless
//     another tag, an environment or a sandbox (usage) uses it, or it is
//     mounted; a tag that an environment names is refused;
//   - a digest ("sha256:<hex>" or "name@sha256:<hex>"): the image goes; it
//     is refused while a tag, an environment or a sandbox uses it, or while
//     it is mounted.
//
// Refusals wrap ErrInUse and are marked errdefs.ErrFailedPrecondition.
func (s *Store) Remove(ref string, usage Usage) (RemoveResult, error) {
	return s.As(AdminOwner).Remove(ref, usage)
}

func (s *Store) remove(v View, ref string, usage Usage) (RemoveResult, error) {
	p, err := parseRef(ref)
	if err != nil {
		return RemoveResult{}, errdefs.Mark(errdefs.ErrInvalidArgument, err)
	}
	s.gcMu.Lock()
	defer s.gcMu.Unlock()
	l, err := v.Resolve(ref)
	if err != nil {
		return RemoveResult{}, err
	}
	if p.version != "" && !v.o.writes(l.Tenant) {
		return RemoveResult{}, fmt.Errorf("tag %s: %w", l.Ref(), ErrReadOnly)
	}
	if p.version == "" && !v.o.Admin && (l.Tenant != v.o.Tenant || l.Tenant == "") {
		return RemoveResult{}, errdefs.New(errdefs.ErrPermissionDenied, "image %s was not built by tenant %q last: remove your tags instead", l.Digest, v.o.Tenant)
	}
	envs, err := s.Envs()
	if err != nil {
		return RemoveResult{}, err
	}
	var res RemoveResult
	if p.version != "" {
		key := l.Key()
		for _, e := range envs {
			if envNames(e, key) {
				return RemoveResult{}, inUse("environment %s names it: change or remove the environment first (shoal env rm %s)", e.Key(), e.Key())
			}
		}
		if s.cluster != nil { // the cluster's tag: out of etcd first
			ctx, cancel := context.WithTimeout(context.Background(), clusterTagTimeout)
			err := s.cluster.DeleteTag(ctx, key)
			cancel()
			if err != nil {
				return RemoveResult{}, err
			}
		} else if err := s.db.Update(func(tx *bbolt.Tx) error { return tx.Bucket(tagsBucket).Delete([]byte(key)) }); err != nil {
			return RemoveResult{}, err
		}
		res.Untagged = append(res.Untagged, v.o.displayTag(l))
		s.log.Info("layer tag removed", "layer", key, "digest", l.Digest)
	}
	why, err := s.usedBy(l.Digest, usage, envs)
	if err != nil {
		return res, err
	}
	if why != "" {
		if p.version != "" {
			return res, nil // untagged; the image stays while it is used
		}
		return RemoveResult{}, inUse("%s", why)
	}
	freed, err := s.deleteImages([]Layer{l})
	if err != nil {
		return res, err
	}
	res.Removed, res.FreedBytes = []Layer{l}, freed
	return res, nil
}

func inUse(format string, args ...any) error {
	return errdefs.Mark(errdefs.ErrFailedPrecondition, fmt.Errorf("%w: %s", ErrInUse, fmt.Sprintf(format, args...)))
}

// usedBy says why an image must stay ("" if nothing needs it). The caller
// holds gcMu.
func (s *Store) usedBy(digest string, usage Usage, envs []Env) (string, error) {
	tags, err := s.Tags(digest)
	if err != nil {
		return "", err
	}
	if len(tags) > 0 {
		return fmt.Sprintf("tagged as %s: remove the tags first (shoal layer rm %s)", strings.Join(tags, ", "), tags[0]), nil
	}
	if ids := usage[digest]; len(ids) > 0 {
		return fmt.Sprintf("used by sandbox %s", strings.Join(ids, ", ")), nil
	}
	for _, e := range envs {
		for _, r := range e.refs() {
			if p, err := parseRef(r); err == nil && p.digest == digest {
				return fmt.Sprintf("environment %s names it", e.Name), nil
			}
		}
	}
	if n := s.Refs(digest); n > 0 {
		return fmt.Sprintf("mounted (%d references)", n), nil
	}
	return "", nil
}

// GCResult says what GC removed (or would remove, in a dry run).
type GCResult struct {
	Removed    []Layer
	FreedBytes int64
	Kept       int // images kept
}

// GC removes every image that no tag points at, no environment names, no
// sandbox uses (usage) and that is not mounted, and image files that were
// never recorded (left by a crash between writing and recording). With
// dryRun it only reports what it would remove.
func (s *Store) GC(usage Usage, dryRun bool) (GCResult, error) {
	s.gcMu.Lock()
	defer s.gcMu.Unlock()
	images, err := s.Images()
	if err != nil {
		return GCResult{}, fmt.Errorf("gc layers: %w", err)
	}
	envs, err := s.Envs()
	if err != nil {
		return GCResult{}, fmt.Errorf("gc layers: %w", err)
	}
	var res GCResult
	var doomed []Layer
	known := map[string]bool{}
	for _, im := range images {
		known[im.Digest] = true
		why, err := s.usedBy(im.Digest, usage, envs)
		if err != nil {
			return GCResult{}, fmt.Errorf("gc layers: %w", err)
		}
		if why != "" {
			res.Kept++
			continue
		}
		doomed = append(doomed, im.Layer)
	}
	// Image files nothing records (nor tags: a node of a cluster has the
	// cluster's tags, some of them naming images it never recorded).
	files, err := os.ReadDir(s.blobs)
	if err != nil {
		return GCResult{}, fmt.Errorf("gc layers: %w", err)
	}
	for _, f := range files {
		hex, ok := strings.CutSuffix(f.Name(), ".erofs")
		digest := "sha256:" + hex
		if !ok || validateDigest(digest) != nil || known[digest] || len(usage[digest]) > 0 || s.Refs(digest) > 0 {
			continue
		}
		if tags, err := s.Tags(digest); err != nil || len(tags) > 0 {
			res.Kept++
			continue
		}
		var size int64
		if fi, err := f.Info(); err == nil {
			size = fi.Size()
		}
		doomed = append(doomed, Layer{Digest: digest, Size: size, Source: "unrecorded image file"})
	}
	if dryRun {
		res.Removed = doomed
		for _, l := range doomed {
			res.FreedBytes += l.Size
		}
		return res, nil
	}
	freed, err := s.deleteImages(doomed)
	res.Removed, res.FreedBytes = doomed, freed
	if err != nil {
		return res, fmt.Errorf("gc layers: %w", err)
	}
	if len(doomed) > 0 {
		s.log.Info("layers collected", "images", len(doomed), "freed_bytes", freed, "kept", res.Kept)
	}
	return res, nil
}

// deleteImages forgets images and removes their files, skipping (with an
// error) any that got mounted meanwhile. The caller holds gcMu; mu is held
// here, so no Acquire can mount an image being deleted. Records go first:
// a crash in between leaves unrecorded files, which the next GC removes.
func (s *Store) deleteImages(ls []Layer) (freed int64, err error) {
	if len(ls) == 0 {
		return 0, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var del []Layer
	var errs []error
	for _, l := range ls {
		if m := s.mounts[l.Digest]; m != nil {
			errs = append(errs, fmt.Errorf("%s: %w: mounted", l.Digest, ErrInUse))
			continue
		}
		del = append(del, l)
	}
	err = s.db.Update(func(tx *bbolt.Tx) error {
		for _, l := range del {
			if err := tx.Bucket(blobsBucket).Delete([]byte(l.Digest)); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return 0, err
	}
	for _, l := range del {
		p := s.ImagePath(l.Digest)
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
			continue
		}
		if l.Remote == "" {
			freed += l.Size
		}
		s.log.Info("layer image removed", "digest", l.Digest, "name", l.Name, "size", l.Size)
	}
	if len(del) > 0 {
		if d, err := os.Open(filepath.Clean(s.blobs)); err == nil {
			d.Sync()
			d.Close()
		}
	}
	return freed, errors.Join(errs...)
}

package layer

import (
	"cmp"
	"encoding/json"
	"os"
	"slices"
	"time"

	"go.etcd.io/bbolt"
)

// The node's copies of images from its layer store (pulled whole on first
// use when not loaded lazily) are a cache: at most RemoteConfig.CacheMax
// bytes of them are kept, the least recently used copies that no mount
// holds going first. Only copies whose record names the store (Remote) are
// evicted: the record stays, so the next use fetches the image again.
// Layers built, committed, imported or pulled here are never evicted.

// touchLocked records a use of digest for the cache's LRU order. Called
// with s.mu held.
func (s *Store) touchLocked(digest string) {
	if s.lastUse == nil {
		s.lastUse = map[string]time.Time{}
	}
	s.lastUse[digest] = time.Now()
}

// cachedImage is an evictable copy.
type cachedImage struct {
	digest string
	size   int64
	used   time.Time
}

// trimCacheLocked evicts copies of store images that no mount holds, least
// recently used first (keep, about to be mounted, stays), until those
// copies total at most CacheMax bytes.
// Called with s.mu held; it skips the trim if a build or gc holds gcMu
// (the next Acquire or Release trims).
func (s *Store) trimCacheLocked(keep string) {
	if s.remote == nil || s.remote.CacheMax <= 0 {
		return
	}
	if !s.gcMu.TryLock() {
		return
	}
	defer s.gcMu.Unlock()
	var all []cachedImage
	var total int64
	s.db.View(func(tx *bbolt.Tx) error {
		return tx.Bucket(blobsBucket).ForEach(func(k, v []byte) error {
			var l Layer
			if json.Unmarshal(v, &l) != nil || l.Remote == "" {
				return nil
			}
			fi, err := os.Stat(s.ImagePath(l.Digest))
			if err != nil {
				return nil
			}
			used, ok := s.lastUse[l.Digest]
			if !ok {
				used = fi.ModTime()
			}
			total += fi.Size()
			if s.mounts[l.Digest] == nil && l.Digest != keep {
				all = append(all, cachedImage{l.Digest, fi.Size(), used})
			}
			return nil
		})
	})
	slices.SortFunc(all, func(a, b cachedImage) int { return cmp.Compare(a.used.UnixNano(), b.used.UnixNano()) })
	for _, c := range all {
		if total <= s.remote.CacheMax {
			return
		}
		if err := os.Remove(s.ImagePath(c.digest)); err != nil {
			s.log.Warn("layer cache: evict", "layer", c.digest, "err", err)
			continue
		}
		total -= c.size
		delete(s.lastUse, c.digest)
		s.log.Info("layer cache: evicted a copy of a store image", "layer", c.digest, "size", c.size, "cached", total, "max", s.remote.CacheMax)
	}
}

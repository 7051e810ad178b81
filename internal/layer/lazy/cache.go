package lazy

import (
	"cmp"
	"container/list"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
)

// cache is the on-disk chunk cache: chunks/<image hex>/<index>, LRU over
// chunks, at most max bytes. mu guards lru, index, bytes and perImage; the
// files are written to a temporary name and renamed in, so a reader sees a
// whole chunk or none, and every read is checked against the chunk's digest.
type cache struct {
	dir string
	max int64

	mu       sync.Mutex
	lru      *list.List // of *entry, most recent at the front
	index    map[chunkKey]*list.Element
	bytes    int64
	perImage map[string]int

	evictions atomic.Int64
}

type chunkKey struct {
	hex string
	i   int
}

type entry struct {
	key  chunkKey
	size int64
}

// openCache indexes the chunks left by an earlier process (least recently
// modified first out) and trims them to max.
func openCache(dir string, max int64) (*cache, error) {
	c := &cache{dir: filepath.Join(dir, "chunks"), max: max, lru: list.New(), index: map[chunkKey]*list.Element{}, perImage: map[string]int{}}
	if err := os.MkdirAll(c.dir, 0o755); err != nil {
		return nil, fmt.Errorf("lazy cache: %w", err)
	}
	type found struct {
		key   chunkKey
		size  int64
		mtime int64
	}
	var all []found
	images, err := os.ReadDir(c.dir)
	if err != nil {
		return nil, fmt.Errorf("lazy cache: %w", err)
	}
	for _, d := range images {
		if !hexRE.MatchString(d.Name()) {
			continue
		}
		files, _ := os.ReadDir(filepath.Join(c.dir, d.Name()))
		for _, f := range files {
			i, err := strconv.Atoi(f.Name())
			if err != nil || i < 0 {
				os.Remove(filepath.Join(c.dir, d.Name(), f.Name())) // a temporary file
				continue
			}
			if fi, err := f.Info(); err == nil {
				all = append(all, found{chunkKey{d.Name(), i}, fi.Size(), fi.ModTime().UnixNano()})
			}
		}
	}
	// Oldest at the back.
	for _, f := range sortByMtime(all, func(f found) int64 { return f.mtime }) {
		c.index[f.key] = c.lru.PushFront(&entry{f.key, f.size})
		c.bytes += f.size
		c.perImage[f.key.hex]++
	}
	c.mu.Lock()
	c.evictLocked()
	c.mu.Unlock()
	return c, nil
}

func sortByMtime[T any](s []T, key func(T) int64) []T {
	slices.SortFunc(s, func(a, b T) int { return cmp.Compare(key(a), key(b)) })
	return s
}

func (c *cache) path(k chunkKey) string {
	return filepath.Join(c.dir, k.hex, strconv.Itoa(k.i))
}

func (c *cache) has(hex string, i int) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, ok := c.index[chunkKey{hex, i}]
	return ok
}

func (c *cache) count(hex string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.perImage[hex]
}

func (c *cache) size() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.bytes
}

// get returns the cached chunk if it is there and matches digest; a chunk
// that does not match is dropped.
func (c *cache) get(hexDigest string, i int, digest string) ([]byte, bool) {
	k := chunkKey{hexDigest, i}
	c.mu.Lock()
	e, ok := c.index[k]
	if ok {
		c.lru.MoveToFront(e)
	}
	c.mu.Unlock()
	if !ok {
		return nil, false
	}
	b, err := os.ReadFile(c.path(k))
	if err == nil {
		sum := sha256.Sum256(b)
		if hex.EncodeToString(sum[:]) == digest {
			return b, true
		}
	}
	c.drop(k)
	return nil, false
}

func (c *cache) drop(k chunkKey) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.index[k]; ok {
		c.removeLocked(e)
	}
}

func (c *cache) removeLocked(e *list.Element) {
	en := e.Value.(*entry)
	c.lru.Remove(e)
	delete(c.index, en.key)
	c.bytes -= en.size
	if c.perImage[en.key.hex]--; c.perImage[en.key.hex] <= 0 {
		delete(c.perImage, en.key.hex)
	}
	os.Remove(c.path(en.key))
}

// put stores a chunk and evicts the least recently used ones over max.
func (c *cache) put(hex string, i int, b []byte) error {
	k := chunkKey{hex, i}
	if int64(len(b)) > c.max {
		return nil // never fits
	}
	dir := filepath.Join(c.dir, hex)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	f, err := os.CreateTemp(dir, "tmp-*")
	if err != nil {
		return err
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		os.Remove(f.Name())
		return err
	}
	if err := f.Close(); err != nil {
		os.Remove(f.Name())
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := os.Rename(f.Name(), c.path(k)); err != nil {
		os.Remove(f.Name())
		return err
	}
	if e, ok := c.index[k]; ok {
		c.lru.MoveToFront(e)
		return nil
	}
	c.index[k] = c.lru.PushFront(&entry{k, int64(len(b))})
	c.bytes += int64(len(b))
	c.perImage[hex]++
	c.evictLocked()
	return nil
}

func (c *cache) evictLocked() {
	for c.bytes > c.max {
		e := c.lru.Back()
		if e == nil {
			return
		}
		c.removeLocked(e)
		c.evictions.Add(1)
	}
}

// Package lazy serves layer images that live in a remote layer store as
// files of a FUSE file system, fetching them in fixed-size chunks on first
// read.
//
// Each image is a read-only file <mountpoint>/<hex>. A read is served chunk
// by chunk from an on-disk cache; a chunk not there is fetched with one
// ranged read of the store (concurrent readers of one chunk share one
// fetch), checked against the chunk digest list written beside the blob at
// push time, retried with back-off, and cached. The cache is bounded (LRU
// over pack files of chunks, evicted as new ones come in) and survives a
// restart: chunks are appended, zstd-compressed, to pack files indexed
// again on open, and checked again on every read.
// A chunk that cannot be fetched within Config.FetchTimeout fails the read
// with EIO: a store that goes away gives the reader an I/O error, never a
// hang.
//
// The first opens of an image record which chunks were read, in order (a
// trace, persisted per image in the cache directory); later opens prefetch
// the traced chunks in the background in that order, so that a cold start
// reads from the cache instead of waiting on the network.
//
// Reads that wait on the store come first (sched): background fetches
// (readahead, trace prefetch) keep off the store while any such fetch
// waits or runs, and ask for at most 256 KiB each.
//
// The layer package mounts EROFS from the FUSE file through a loop device
// (the kernel's file-backed EROFS mount refuses a FUSE file).
package lazy

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// DefaultChunkSize is the chunk size push writes digest lists for, chosen
// by measurement (README, "Layer stores and lazy loading"): reading every
// 10th file of /usr/lib/python3 (files spread evenly through the image,
// the worst case) fetched 1.4x the file bytes at 4 KiB, 1.9x at 8 KiB,
// 3.0x at 16 KiB and 6.6x at 64 KiB; the real workload of `shoal bench
// lazy` fetched 1.24x what the kernel read at 16 KiB. Since a read's
// missing chunks go in one request, a small chunk costs no round trips;
// it costs a digest (and a cache record) per chunk, so not smaller.
const DefaultChunkSize = 16 << 10

// Limits on what a chunk list may say.
const (
	MinChunkSize     = 4 << 10
	MaxChunkSize     = 16 << 20
	MaxManifestBytes = 64 << 20
)

// Manifest is the chunk digest list stored beside a blob.
type Manifest struct {
	Size      int64    `json:"size"`
	ChunkSize int64    `json:"chunk_size"`
	Digests   []string `json:"sha256"` // hex of each chunk, in order
}

// Validate checks that m describes an image of size bytes.
func (m *Manifest) Validate(size int64) error {
	if m.ChunkSize < MinChunkSize || m.ChunkSize > MaxChunkSize {
		return fmt.Errorf("chunk size %d: want %d..%d", m.ChunkSize, MinChunkSize, MaxChunkSize)
	}
	if m.Size != size {
		return fmt.Errorf("chunk list is for %d bytes, the image has %d", m.Size, size)
	}
	if want := (size + m.ChunkSize - 1) / m.ChunkSize; int64(len(m.Digests)) != want {
		return fmt.Errorf("chunk list has %d digests, want %d", len(m.Digests), want)
	}
	for _, d := range m.Digests {
		if len(d) != 64 {
			return fmt.Errorf("chunk digest %q: want 64 hex", d)
		}
	}
	return nil
}

// BuildManifest reads an image and returns its chunk list.
func BuildManifest(r io.Reader, chunkSize int64) (Manifest, error) {
	m := Manifest{ChunkSize: chunkSize}
	buf := make([]byte, chunkSize)
	for {
		n, err := io.ReadFull(r, buf)
		if n > 0 {
			sum := sha256.Sum256(buf[:n])
			m.Digests = append(m.Digests, hex.EncodeToString(sum[:]))
			m.Size += int64(n)
		}
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return m, nil
		}
		if err != nil {
			return Manifest{}, err
		}
	}
}

// Source is where chunks come from: remote.Store satisfies it.
type Source interface {
	ReadAt(ctx context.Context, key string, p []byte, off int64) (int, error)
}

// Config tunes an FS. Zero values take the defaults.
type Config struct {
	CacheDir     string        // required
	CacheMax     int64         // bytes of cached chunks at most (default 10 GiB)
	FetchTimeout time.Duration // a chunk not fetched by then fails its read with EIO (default 30s)
	Parallel     int           // background fetches (readahead, prefetch) at once (default 8)
	// DemandParallel bounds the fetches for reads that wait on them
	// (cache misses) in flight at once; more wait in arrival order
	// (default 32).
	DemandParallel int
	Readahead      int  // chunks fetched ahead of a sequential miss (default 4)
	TraceChunks    int  // chunks a trace records at most (default 65536)
	NoPrefetch     bool // record traces but never prefetch (benchmarks)
	// OnFetch, if set, is called after each chunk fetched from the store
	// (metrics); it must not block.
	OnFetch func(bytes int, took time.Duration)
}

func (c *Config) fill() {
	if c.CacheMax <= 0 {
		c.CacheMax = 10 << 30
	}
	if c.FetchTimeout <= 0 {
		c.FetchTimeout = 30 * time.Second
	}
	if c.Parallel <= 0 {
		c.Parallel = 8
	}
	if c.DemandParallel <= 0 {
		c.DemandParallel = 32
	}
	if c.Readahead < 0 {
		c.Readahead = 0
	} else if c.Readahead == 0 {
		c.Readahead = 4
	}
	if c.TraceChunks <= 0 {
		c.TraceChunks = 1 << 16
	}
}

// Stats are an FS's counters since it was mounted.
type Stats struct {
	BytesFetched  int64 // from the store
	ChunksFetched int64
	FetchErrors   int64 // failed attempts (retried or not)
	CacheHits     int64 // chunk reads served from the cache
	CacheMisses   int64 // chunk reads that waited on a fetch
	CacheBytes    int64 // bytes of chunks in the cache now
	Evictions     int64
	Prefetched    int64   // chunks fetched by trace prefetch
	FetchSeconds  float64 // summed over fetches
}

// ImageStats are the counters of one open image.
type ImageStats struct {
	Size         int64
	ChunkSize    int64
	Chunks       int
	ChunksCached int
	BytesFetched int64
	BytesRead    int64 // bytes the kernel asked for
	// BytesTouched are the distinct bytes of the image the kernel read
	// (in 4 KiB pages): what the workload needed, metadata included.
	BytesTouched int64
	CacheHits    int64
	CacheMisses  int64
	TraceChunks  int  // chunks in the recorded trace
	Prefetching  bool // a prefetch runs
	Prefetched   int64
}

// FS is a mounted lazy file system. It is safe for concurrent use.
type FS struct {
	cfg   Config
	src   Source
	log   *slog.Logger
	mnt   string
	root  *rootNode
	srv   *fuse.Server
	cache *cache
	sched *sched

	mu     sync.Mutex
	images map[string]*image // by hex; guarded by mu

	bytesFetched, chunksFetched, fetchErrors, hits, misses, prefetched atomic.Int64
	fetchNanos                                                         atomic.Int64
	latMu                                                              sync.Mutex
	lat                                                                []time.Duration // guarded by latMu
}

var hexRE = regexp.MustCompile(`^[0-9a-f]{64}$`)

// Mount mounts an FS at mnt (created if needed; a stale mount left there by
// an earlier process is detached first) serving chunks from src.
func Mount(mnt string, src Source, cfg Config, log *slog.Logger) (*FS, error) {
	f, err := newFS(src, cfg, log)
	if err != nil {
		return nil, err
	}
	for range 8 { // a dead FUSE mount from a killed process
		if unix.Unmount(mnt, unix.MNT_DETACH) != nil {
			break
		}
	}
	if err := os.MkdirAll(mnt, 0o755); err != nil {
		return nil, fmt.Errorf("lazy mount: %w", err)
	}
	f.mnt = mnt
	f.root = &rootNode{fs: f}
	sec := time.Hour // images never change
	f.srv, err = fs.Mount(mnt, f.root, &fs.Options{
		EntryTimeout: &sec, AttrTimeout: &sec,
		MountOptions: fuse.MountOptions{
			DirectMount: true, FsName: "shoal-lazy", Name: "shoal-lazy",
			MaxReadAhead:  16 << 10, // the loader reads ahead itself, by chunks
			MaxBackground: 64, DisableXAttrs: true,
		},
	})
	if err != nil {
		return nil, fmt.Errorf("lazy mount %s: %w", mnt, err)
	}
	return f, nil
}

// newFS makes an FS that is not mounted yet.
func newFS(src Source, cfg Config, log *slog.Logger) (*FS, error) {
	cfg.fill()
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if cfg.CacheDir == "" {
		return nil, errors.New("lazy: no cache directory")
	}
	c, err := openCache(cfg.CacheDir, cfg.CacheMax)
	if err != nil {
		return nil, err
	}
	return &FS{cfg: cfg, src: src, log: log, cache: c, sched: newSched(cfg.DemandParallel, cfg.Parallel), images: map[string]*image{}}, nil
}

// Unmount closes every image and unmounts the FS.
func (f *FS) Unmount() error {
	f.mu.Lock()
	for _, im := range f.images {
		im.stop()
	}
	f.mu.Unlock()
	err := f.srv.Unmount()
	if err != nil {
		unix.Unmount(f.mnt, unix.MNT_DETACH)
	}
	f.cache.close()
	return err
}

// Open makes the image <hex> of the store object key available as the file
// it returns, until Close. Opens are counted: the file goes with the last
// Close.
func (f *FS) Open(hexDigest, key string, m Manifest) (string, error) {
	if !hexRE.MatchString(hexDigest) {
		return "", fmt.Errorf("lazy open: bad digest %q", hexDigest)
	}
	if err := m.Validate(m.Size); err != nil {
		return "", fmt.Errorf("lazy open %s: %w", hexDigest, err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if im := f.images[hexDigest]; im != nil {
		im.opens++
		return filepath.Join(f.mnt, hexDigest), nil
	}
	im, prefetch := f.newImage(hexDigest, key, m)
	ctx := context.Background()
	ch := f.root.NewPersistentInode(ctx, &fileNode{im: im}, fs.StableAttr{Mode: syscall.S_IFREG})
	if !f.root.AddChild(hexDigest, ch, true) {
		return "", fmt.Errorf("lazy open %s: cannot add the file", hexDigest)
	}
	f.images[hexDigest] = im
	if prefetch {
		go im.prefetch()
	}
	go im.flushLoop()
	return filepath.Join(f.mnt, hexDigest), nil
}

// newImage makes the image <hex> of key, with its trace loaded; prefetch
// says whether its trace is to be prefetched.
func (f *FS) newImage(hexDigest, key string, m Manifest) (im *image, prefetch bool) {
	im = &image{fs: f, hex: hexDigest, key: key, m: m, opens: 1, inflight: map[int]*call{}, touched: map[int32]bool{}, done: make(chan struct{})}
	im.loadTrace()
	prefetch = len(im.trace) > 0 && !f.cfg.NoPrefetch
	im.recording = !prefetch // decided before the file is visible: reads see it set
	return im, prefetch
}

// Close drops one Open of the image; the last one removes its file, stops
// its prefetch and saves its trace.
func (f *FS) Close(hexDigest string) {
	f.mu.Lock()
	im := f.images[hexDigest]
	if im == nil {
		f.mu.Unlock()
		return
	}
	im.opens--
	if im.opens > 0 {
		f.mu.Unlock()
		return
	}
	delete(f.images, hexDigest)
	f.root.RmChild(hexDigest)
	f.mu.Unlock()
	im.stop()
}

// Stats returns the FS's counters.
func (f *FS) Stats() Stats {
	return Stats{
		BytesFetched:  f.bytesFetched.Load(),
		ChunksFetched: f.chunksFetched.Load(),
		FetchErrors:   f.fetchErrors.Load(),
		CacheHits:     f.hits.Load(),
		CacheMisses:   f.misses.Load(),
		CacheBytes:    f.cache.size(),
		Evictions:     f.cache.evictions.Load(),
		Prefetched:    f.prefetched.Load(),
		FetchSeconds:  time.Duration(f.fetchNanos.Load()).Seconds(),
	}
}

// ImageStats returns the counters of an open image; ok is false if it is
// not open.
func (f *FS) ImageStats(hexDigest string) (ImageStats, bool) {
	f.mu.Lock()
	im := f.images[hexDigest]
	f.mu.Unlock()
	if im == nil {
		return ImageStats{}, false
	}
	im.mu.Lock()
	defer im.mu.Unlock()
	st := ImageStats{
		Size: im.m.Size, ChunkSize: im.m.ChunkSize, Chunks: len(im.m.Digests),
		BytesFetched: im.bytesFetched, BytesRead: im.bytesRead, BytesTouched: im.pagesTouched * pageSize, CacheHits: im.hits, CacheMisses: im.misses,
		TraceChunks: len(im.trace), Prefetching: im.prefetching, Prefetched: im.prefetched,
	}
	st.ChunksCached = f.cache.count(im.hex)
	return st, true
}

// image is one open image.
type image struct {
	fs  *FS
	hex string
	key string
	m   Manifest

	opens int // guarded by fs.mu

	mu           sync.Mutex
	inflight     map[int]*call  // guarded by mu
	touched      map[int32]bool // guarded by mu: chunks read (trace)
	trace        []int32        // guarded by mu: first reads in order
	recording    bool           // guarded by mu (set before use)
	dirty        bool           // guarded by mu
	prefetching  bool
	bytesFetched int64
	bytesRead    int64
	pages        []uint64 // guarded by mu: bitmap of 4 KiB pages read
	pagesTouched int64    // guarded by mu
	hits, misses int64
	prefetched   int64
	lastMiss     int
	stopOnce     sync.Once
	done         chan struct{}
}

type call struct {
	done chan struct{}
	data []byte
	err  error
}

func (im *image) stop() {
	im.stopOnce.Do(func() {
		close(im.done)
		im.saveTrace()
	})
}

func (im *image) chunkLen(i int) int64 {
	off := int64(i) * im.m.ChunkSize
	return min(im.m.ChunkSize, im.m.Size-off)
}

// maxRun bounds the chunks one ranged read of the store fetches.
const maxRun = 64

// readAt fills dest from the image at off. The chunks it needs that are
// neither cached nor being fetched are fetched together, one ranged read
// per run of adjacent chunks, so that small chunks cost no more round
// trips than the kernel's reads.
func (im *image) readAt(ctx context.Context, dest []byte, off int64) (int, error) {
	if off >= im.m.Size {
		return 0, nil
	}
	end := min(off+int64(len(dest)), im.m.Size)
	first, last := int(off/im.m.ChunkSize), int((end-1)/im.m.ChunkSize)
	datas := make([][]byte, last-first+1)
	calls := make([]*call, last-first+1)
	var fresh []int // chunks this read starts fetching
	f := im.fs
	for i := first; i <= last; i++ {
		im.record(i)
		if d, ok := f.cache.get(im.hex, i, im.m.Digests[i]); ok {
			datas[i-first] = d
			f.hits.Add(1)
			im.mu.Lock()
			im.hits++
			im.mu.Unlock()
			continue
		}
		f.misses.Add(1)
		im.mu.Lock()
		im.misses++
		c := im.inflight[i]
		if c == nil {
			c = &call{done: make(chan struct{})}
			im.inflight[i] = c
			fresh = append(fresh, i)
		}
		im.mu.Unlock()
		calls[i-first] = c
	}
	if len(fresh) > 0 {
		rs := runs(fresh)
		for _, run := range rs {
			f.sched.beginDemand() // before any readahead below: it sees this read's fetches
			go im.fetchRun(run, im.callsOf(run), true)
		}
		// A miss right after the previous one's chunks: read ahead, if
		// no other read waits on the store.
		im.mu.Lock()
		seq := fresh[0] == im.lastMiss+1 || fresh[0] == im.lastMiss
		im.lastMiss = fresh[len(fresh)-1]
		im.mu.Unlock()
		if seq && f.cfg.Readahead > 0 {
			im.background(last+1, f.cfg.Readahead, len(rs))
		}
	}
	for k, c := range calls {
		if c == nil {
			continue
		}
		select {
		case <-c.done:
			if c.err != nil {
				return 0, c.err
			}
			datas[k] = c.data
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
	n := 0
	for k, d := range datas {
		cOff := int64(first+k) * im.m.ChunkSize
		lo := max(off, cOff) - cOff
		hi := min(end, cOff+int64(len(d))) - cOff
		n += copy(dest[n:], d[lo:hi])
	}
	im.mu.Lock()
	im.bytesRead += int64(n)
	if im.pages == nil {
		im.pages = make([]uint64, (im.m.Size/pageSize+64)/64)
	}
	for p := off / pageSize; p <= (off+int64(n)-1)/pageSize && n > 0; p++ {
		if im.pages[p/64]&(1<<(p%64)) == 0 {
			im.pages[p/64] |= 1 << (p % 64)
			im.pagesTouched++
		}
	}
	im.mu.Unlock()
	return n, nil
}

const pageSize = 4096

// record adds chunk i to the trace if this image records one.
func (im *image) record(i int) {
	im.mu.Lock()
	if im.recording && !im.touched[int32(i)] && len(im.trace) < im.fs.cfg.TraceChunks {
		im.touched[int32(i)] = true
		im.trace = append(im.trace, int32(i))
		im.dirty = true
	}
	im.mu.Unlock()
}

// runs splits ascending chunk indices into runs of adjacent ones, each at
// most maxRun long.
func runs(idx []int) [][]int {
	var out [][]int
	for k := 0; k < len(idx); {
		e := k + 1
		for e < len(idx) && idx[e] == idx[e-1]+1 && e-k < maxRun {
			e++
		}
		out = append(out, idx[k:e])
		k = e
	}
	return out
}

func (im *image) callsOf(run []int) []*call {
	im.mu.Lock()
	defer im.mu.Unlock()
	cs := make([]*call, len(run))
	for k, i := range run {
		cs[k] = im.inflight[i]
	}
	return cs
}

// claim registers fetches for those of the chunks idx that are neither
// cached nor being fetched, and returns them (ascending if idx is).
func (im *image) claim(idx []int) []int {
	var out []int
	for _, i := range idx {
		if i < 0 || i >= len(im.m.Digests) || im.fs.cache.has(im.hex, i) {
			continue
		}
		im.mu.Lock()
		if _, busy := im.inflight[i]; !busy {
			im.inflight[i] = &call{done: make(chan struct{})}
			out = append(out, i)
		}
		im.mu.Unlock()
	}
	return out
}

// bgChunks is how many chunks one background request asks for at most.
func (im *image) bgChunks() int {
	return int(max(1, min(maxRun, bgMaxBytes/im.m.ChunkSize)))
}

// background fetches up to n chunks from i on that are neither cached nor
// being fetched, if a background slot is free and no more than own demand
// fetches (the caller's) are waiting or in flight; it never waits.
func (im *image) background(i, n, own int) {
	if !im.fs.sched.tryBackground(own) {
		return
	}
	n = min(n, im.bgChunks())
	idx := make([]int, 0, n)
	for k := i; k < i+n && k < len(im.m.Digests); k++ {
		idx = append(idx, k)
	}
	todo := im.claim(idx)
	go func() {
		defer im.fs.sched.releaseBackground()
		for _, run := range runs(todo) {
			im.fetchRun(run, im.callsOf(run), false)
		}
	}()
}

// fetchRun gets the adjacent chunks run from the store with one ranged
// read, checks each against its digest, caches them, and completes their
// calls, retrying with back-off until the fetch timeout. A demand fetch
// (counted by sched.beginDemand) first takes a demand slot, within the
// same timeout, and is uncounted when it ends; a background one runs in
// a background slot its caller holds.
func (im *image) fetchRun(run []int, calls []*call, demand bool) {
	f := im.fs
	var data [][]byte
	var err error
	defer func() {
		im.mu.Lock()
		for _, i := range run {
			delete(im.inflight, i)
		}
		im.mu.Unlock()
		for k, c := range calls {
			if err != nil {
				c.err = err
			} else {
				c.data = data[k]
			}
			close(c.done)
		}
	}()
	if demand {
		// Uncounted before the waiters wake (deferred last, so run
		// first): a process's next read, right after this one, must not
		// see this fetch still counted, which would keep its readahead
		// off the store (tryBackground).
		defer f.sched.endDemand()
	}
	ctx, cancel := context.WithTimeout(context.Background(), f.cfg.FetchTimeout)
	defer cancel()
	if demand {
		if err = f.sched.demandSlot(ctx); err != nil {
			err = fmt.Errorf("fetch chunks %d..%d of %s: waiting for a fetch slot: %w", run[0], run[len(run)-1], im.hex, err)
			return
		}
		defer f.sched.releaseSlot()
	}
	var total int64
	for _, i := range run {
		total += im.chunkLen(i)
	}
	buf := make([]byte, total)
	off := int64(run[0]) * im.m.ChunkSize
	backoff := 50 * time.Millisecond
	for attempt := 1; ; attempt++ {
		start := time.Now()
		actx, acancel := context.WithTimeout(ctx, max(f.cfg.FetchTimeout/3, time.Second))
		var n int
		n, err = f.src.ReadAt(actx, im.key, buf, off)
		acancel()
		if err == nil && n != len(buf) {
			err = fmt.Errorf("short read: %d of %d bytes", n, len(buf))
		}
		if err == nil {
			data = make([][]byte, len(run))
			var p int64
			for k, i := range run {
				c := buf[p : p+im.chunkLen(i)]
				p += im.chunkLen(i)
				sum := sha256.Sum256(c)
				if hex.EncodeToString(sum[:]) != im.m.Digests[i] {
					err = fmt.Errorf("chunk %d of %s does not match its digest", i, im.hex)
					break
				}
				data[k] = c
			}
		}
		if err == nil {
			took := time.Since(start)
			f.bytesFetched.Add(int64(n))
			f.chunksFetched.Add(int64(len(run)))
			f.fetchNanos.Add(int64(took))
			if f.cfg.OnFetch != nil {
				f.cfg.OnFetch(n, took)
			}
			im.mu.Lock()
			im.bytesFetched += int64(n)
			im.mu.Unlock()
			for k, i := range run {
				if err := f.cache.put(im.hex, i, data[k]); err != nil {
					f.log.Warn("lazy cache write", "layer", im.hex, "chunk", i, "err", err)
				}
			}
			return
		}
		f.fetchErrors.Add(1)
		wait := backoff/2 + rand.N(backoff)
		backoff = min(backoff*2, 2*time.Second)
		if ctx.Err() != nil || time.Until(deadline(ctx)) < wait {
			f.log.Warn("lazy chunk fetch failed", "layer", im.hex, "chunks", len(run), "first", run[0], "attempts", attempt, "err", err)
			err = fmt.Errorf("fetch chunks %d..%d of %s: %w", run[0], run[len(run)-1], im.hex, err)
			return
		}
		select {
		case <-time.After(wait):
		case <-ctx.Done():
		}
	}
}

func deadline(ctx context.Context) time.Time {
	d, _ := ctx.Deadline()
	return d
}

// prefetch fetches the traced chunks in trace order, in background slots
// (Parallel at a time, none while a read waits on the store), until done
// or closed.
func (im *image) prefetch() {
	im.mu.Lock()
	im.prefetching = true
	order := append([]int32(nil), im.trace...)
	im.mu.Unlock()
	defer func() {
		im.mu.Lock()
		im.prefetching = false
		im.mu.Unlock()
	}()
	// Adjacent chunks next to each other in the trace go in one request.
	var groups [][]int
	for _, i := range order {
		if n := len(groups); n > 0 {
			g := groups[n-1]
			if int(i) == g[len(g)-1]+1 && len(g) < im.bgChunks() {
				groups[n-1] = append(g, int(i))
				continue
			}
		}
		groups = append(groups, []int{int(i)})
	}
	var wg sync.WaitGroup
	for _, g := range groups {
		if !im.fs.sched.acquireBackground(im.done) {
			wg.Wait()
			return
		}
		todo := im.claim(g)
		if len(todo) == 0 {
			im.fs.sched.releaseBackground()
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer im.fs.sched.releaseBackground()
			for _, run := range runs(todo) {
				cs := im.callsOf(run)
				im.fetchRun(run, cs, false)
				if cs[0].err == nil {
					im.fs.prefetched.Add(int64(len(run)))
					im.mu.Lock()
					im.prefetched += int64(len(run))
					im.mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
}

// The trace of an image is saved as a JSON list of chunk indices.
func (im *image) tracePath() string {
	return filepath.Join(im.fs.cfg.CacheDir, "traces", im.hex+".json")
}

func (im *image) loadTrace() {
	b, err := os.ReadFile(im.tracePath())
	if err != nil {
		return
	}
	var t []int32
	if json.Unmarshal(b, &t) == nil && len(t) <= im.fs.cfg.TraceChunks {
		im.trace = t
	}
}

func (im *image) saveTrace() {
	im.mu.Lock()
	if !im.dirty {
		im.mu.Unlock()
		return
	}
	b, err := json.Marshal(im.trace)
	im.dirty = false
	im.mu.Unlock()
	if err != nil {
		return
	}
	if err := writeFileAtomic(im.tracePath(), b); err != nil {
		im.fs.log.Warn("save lazy trace", "layer", im.hex, "err", err)
	}
}

// flushLoop saves the trace every few seconds while the image is open, so
// that a trace survives a crash.
func (im *image) flushLoop() {
	t := time.NewTicker(2 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			im.saveTrace()
		case <-im.done:
			return
		}
	}
}

func writeFileAtomic(path string, b []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	tmp := path + ".tmp" + strconv.Itoa(rand.IntN(1<<30))
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}

// --- FUSE nodes ---

type rootNode struct {
	fs.Inode
	fs *FS
}

var _ fs.NodeGetattrer = (*rootNode)(nil)

func (r *rootNode) Getattr(ctx context.Context, fh fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = 0o755 | syscall.S_IFDIR
	return 0
}

type fileNode struct {
	fs.Inode
	im *image
}

var (
	_ fs.NodeGetattrer = (*fileNode)(nil)
	_ fs.NodeOpener    = (*fileNode)(nil)
	_ fs.NodeReader    = (*fileNode)(nil)
)

func (n *fileNode) Getattr(ctx context.Context, fh fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = 0o444 | syscall.S_IFREG
	out.Size = uint64(n.im.m.Size)
	out.Blksize = 4096
	out.Blocks = (uint64(n.im.m.Size) + 511) / 512
	return 0
}

func (n *fileNode) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	if flags&(syscall.O_WRONLY|syscall.O_RDWR) != 0 {
		return nil, 0, syscall.EROFS
	}
	return nil, fuse.FOPEN_KEEP_CACHE, 0
}

func (n *fileNode) Read(ctx context.Context, fh fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	k, err := n.im.readAt(ctx, dest, off)
	if err != nil {
		n.im.fs.log.Debug("lazy read", "layer", n.im.hex, "off", off, "err", err)
		return nil, syscall.EIO
	}
	return fuse.ReadResultData(dest[:k]), 0
}

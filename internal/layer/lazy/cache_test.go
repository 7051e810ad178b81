package lazy

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// testChunk returns chunk i of a test image: even ones compress (text),
// odd ones do not (random bytes).
func testChunk(i int) []byte {
	b := make([]byte, 16<<10)
	if i%2 == 0 {
		copy(b, strings.Repeat("chunk "+string(rune('a'+i%26))+" of a text file\n", len(b)/20+1))
		return b
	}
	r := rand.New(rand.NewPCG(uint64(i), 9))
	for k := range b {
		b[k] = byte(r.Uint32())
	}
	return b
}

func digestOf(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

func packFiles(t *testing.T, dir string) (n int, bytes int64) {
	t.Helper()
	ents, err := os.ReadDir(filepath.Join(dir, "chunks"))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		fi, err := e.Info()
		if err != nil {
			t.Fatal(err)
		}
		n++
		bytes += fi.Size()
	}
	return n, bytes
}

var testImg = strings.Repeat("ab", 32)

// TestCachePacks: chunks go, compressed where that pays, into a few pack
// files (not a file each), read back byte for byte, and after a reopen
// (a restart) too, with a torn record at a pack's end cut off.
func TestCachePacks(t *testing.T) {
	dir := t.TempDir()
	// An earlier layout's chunk files go.
	old := filepath.Join(dir, "chunks", testImg)
	os.MkdirAll(old, 0o755)
	os.WriteFile(filepath.Join(old, "0"), testChunk(0), 0o644)

	c, err := openCache(dir, 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(old); !os.IsNotExist(err) {
		t.Fatalf("the earlier layout's chunk files are still there: %v", err)
	}
	const n = 400 // 6.25 MiB of chunks
	var raw int64
	for i := range n {
		if err := c.put(testImg, i, testChunk(i)); err != nil {
			t.Fatal(err)
		}
		raw += int64(len(testChunk(i)))
	}
	files, onDisk := packFiles(t, dir)
	t.Logf("%d chunks, %d bytes: %d pack files, %d bytes on disk", n, raw, files, onDisk)
	if files > 4 {
		t.Fatalf("%d chunks in %d files: want them packed", n, files)
	}
	// Half the chunks compress ~100x, half not at all.
	if onDisk > raw*6/10 || onDisk != c.size() {
		t.Fatalf("%d bytes of chunks took %d on disk (cache says %d): want the text ones compressed", raw, onDisk, c.size())
	}
	check := func(c *cache) {
		t.Helper()
		for i := range n {
			got, ok := c.get(testImg, i, digestOf(testChunk(i)))
			if !ok || !bytes.Equal(got, testChunk(i)) {
				t.Fatalf("chunk %d: %v, or not its bytes", i, ok)
			}
		}
		if c.count(testImg) != n {
			t.Fatalf("cache counts %d chunks of the image, want %d", c.count(testImg), n)
		}
	}
	check(c)
	c.close()

	// A torn record at the end of the last pack (a crash mid-append).
	packs, _ := filepath.Glob(filepath.Join(dir, "chunks", "*.pack"))
	last := packs[len(packs)-1]
	fi, _ := os.Stat(last)
	f, _ := os.OpenFile(last, os.O_WRONLY|os.O_APPEND, 0)
	rec := make([]byte, recHdr+100)
	copy(rec, []byte{0x31, 0x43, 0x48, 0x53, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0}) // claims 64 KiB
	f.Write(rec)
	f.Close()

	c2, err := openCache(dir, 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	check(c2)
	if fi2, _ := os.Stat(last); fi2.Size() != fi.Size() {
		t.Fatalf("the torn record was not cut off: %d bytes, want %d", fi2.Size(), fi.Size())
	}
	// New chunks after the restart go in a new pack and read back.
	if err := c2.put(testImg, n, testChunk(n)); err != nil {
		t.Fatal(err)
	}
	if got, ok := c2.get(testImg, n, digestOf(testChunk(n))); !ok || !bytes.Equal(got, testChunk(n)) {
		t.Fatal("a chunk put after the restart does not read back")
	}
	c2.close()
}

// TestCacheDamaged: a damaged record is never served: it reads as a miss
// and is forgotten.
func TestCacheDamaged(t *testing.T) {
	dir := t.TempDir()
	c, err := openCache(dir, 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 4 {
		c.put(testImg, i, testChunk(i))
	}
	c.close()
	packs, _ := filepath.Glob(filepath.Join(dir, "chunks", "*.pack"))
	b, _ := os.ReadFile(packs[0])
	for _, i := range []int{0, 1} { // a compressed and a raw record
		l := c.index[chunkKey{testImg, i}]
		b[l.off+int64(l.n)/2] ^= 0xff
	}
	os.WriteFile(packs[0], b, 0o644)
	c2, err := openCache(dir, 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 4 {
		got, ok := c2.get(testImg, i, digestOf(testChunk(i)))
		if damaged := i < 2; ok == damaged || (ok && !bytes.Equal(got, testChunk(i))) {
			t.Fatalf("chunk %d (damaged %v): served %v", i, damaged, ok)
		}
	}
	if c2.has(testImg, 0) || c2.count(testImg) != 2 {
		t.Fatalf("damaged chunks are still indexed: %d", c2.count(testImg))
	}
}

// TestCacheEvicts: under a cap, whole packs go, least recently used
// first: chunks read all along stay.
func TestCacheEvicts(t *testing.T) {
	dir := t.TempDir()
	const capBytes = 1 << 20
	c, err := openCache(dir, capBytes)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 300 { // ~2.4 MB of chunks, half of them random
		if err := c.put(testImg, i, testChunk(i)); err != nil {
			t.Fatal(err)
		}
		if _, ok := c.get(testImg, 1, digestOf(testChunk(1))); !ok && i >= 1 {
			t.Fatalf("chunk 1, read after every put, was evicted (at put %d)", i)
		}
		if _, onDisk := packFiles(t, dir); onDisk > capBytes || c.size() > capBytes {
			t.Fatalf("%d bytes on disk (cache says %d), cap %d", onDisk, c.size(), capBytes)
		}
	}
	if c.evictions.Load() == 0 || c.has(testImg, 50) {
		t.Fatalf("%d evictions; chunk 50 (never read again, in another pack than chunk 1) still there: %v", c.evictions.Load(), c.has(testImg, 50))
	}
	c.close()
}

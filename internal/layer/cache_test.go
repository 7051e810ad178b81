package layer

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/shoal-sandbox/shoal/internal/layer/remote/s3server/s3test"
)

// TestLayerCacheEvicts: a node that pulls whole images from its store on
// first use keeps at most CacheMax bytes of them, evicting the least
// recently used one no mount holds; an evicted image is fetched again on
// its next use; images in use and layers built here are never evicted.
func TestLayerCacheEvicts(t *testing.T) {
	needRoot(t)
	srv := s3test.Start(t, t.TempDir(), "shoal", 0)
	st := s3Store(t, srv)
	a := newEnv(t)
	a.store.SetRemote(RemoteConfig{Store: st})
	var digests []string
	var files []map[string][]byte
	for i, v := range []string{"1", "2", "3"} {
		src := filepath.Join(a.root, "src"+v)
		f := randomTree(t, src, 4, 250<<10+i) // ~1 MB each, distinct
		l, err := a.store.Build(context.Background(), BuildOptions{Kind: KindBase, Name: "base", Version: v, Source: src, Compression: "none"})
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := a.store.Push(context.Background(), l.Ref()); err != nil {
			t.Fatal(err)
		}
		digests = append(digests, l.Digest)
		files = append(files, f)
	}
	b := newEnv(t)
	b.store.SetRemote(RemoteConfig{Store: st, CacheMax: 2<<20 + 512<<10}) // two images fit, not three
	local := b.build(t, "mine", "1", writeTree(t, filepath.Join(b.root, "mine"), map[string]string{"big": string(bytes.Repeat([]byte("y"), 3<<20))}))
	has := func(i int) bool {
		_, err := os.Stat(b.store.ImagePath(digests[i]))
		return err == nil
	}
	use := func(i int, release bool) {
		t.Helper()
		if _, err := b.store.Resolve(digests[i]); err != nil {
			t.Fatal(err)
		}
		dir, err := b.store.Acquire(digests[i])
		if err != nil {
			t.Fatal(err)
		}
		for name, want := range files[i] {
			if got, err := os.ReadFile(filepath.Join(dir, name)); err != nil || !bytes.Equal(got, want) {
				t.Fatalf("image %d: %s differs (%v)", i, name, err)
			}
			break
		}
		if release {
			if err := b.store.Release(digests[i]); err != nil {
				t.Fatal(err)
			}
		}
	}
	use(0, true)
	use(1, true)
	if !has(0) || !has(1) {
		t.Fatal("two images under the cap: both should be kept")
	}
	use(2, true) // three copies: the least recently used (0) goes
	if has(0) || !has(1) || !has(2) {
		t.Fatalf("after a third image: kept %v %v %v, want 0 evicted", has(0), has(1), has(2))
	}
	use(1, false) // 1 in use, most recent
	use(0, true)  // fetched again; 2 is the LRU one not in use
	if !has(0) || !has(1) || has(2) {
		t.Fatalf("after using 0 again with 1 mounted: kept %v %v %v, want 2 evicted", has(0), has(1), has(2))
	}
	use(2, true) // 0 is the LRU, 1 is still mounted
	if has(0) || !has(1) || !has(2) {
		t.Fatalf("with 1 mounted: kept %v %v %v, want 0 evicted and 1 kept", has(0), has(1), has(2))
	}
	if err := b.store.Release(digests[1]); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(b.store.ImagePath(local.Digest)); errors.Is(err, os.ErrNotExist) {
		t.Fatal("a layer built on the node was evicted")
	}
}

package layer

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	lstore "github.com/shoal-sandbox/shoal/internal/layer/remote"
)

// testRegistry is go-containerregistry's in-process registry, counting the
// blob GETs it serves; wrap, if set, sees every request first.
type testRegistry struct {
	srv  *httptest.Server
	host string
	mu   sync.Mutex
	gets map[string]int // blob digest -> GETs
	wrap func(w http.ResponseWriter, r *http.Request, next http.Handler)
}

func newTestRegistry(t testing.TB) *testRegistry {
	t.Helper()
	tr := &testRegistry{gets: map[string]int{}}
	reg := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	tr.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet && strings.Contains(r.URL.Path, "/blobs/sha256:") {
			tr.mu.Lock()
			tr.gets[r.URL.Path[strings.LastIndex(r.URL.Path, "/")+1:]]++
			tr.mu.Unlock()
		}
		if tr.wrap != nil {
			tr.wrap(w, r, reg)
			return
		}
		reg.ServeHTTP(w, r)
	}))
	t.Cleanup(tr.srv.Close)
	tr.host = strings.TrimPrefix(tr.srv.URL, "http://")
	return tr
}

func (tr *testRegistry) blobGets(d v1.Hash) int {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return tr.gets[d.String()]
}

func (tr *testRegistry) push(t testing.TB, repoTag string, img v1.Image) string {
	t.Helper()
	ref, err := name.ParseReference(tr.host + "/" + repoTag)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(ref, img); err != nil {
		t.Fatal(err)
	}
	return ref.Name()
}

// tarLayer makes an OCI layer (gzip) of tar entries.
func tarLayer(t testing.TB, entries ...tarEntry) v1.Layer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := e.hdr
		h.Size = int64(len(e.body))
		if h.Typeflag != tar.TypeReg {
			h.Size = 0
		}
		h.ModTime = time.Unix(1700000000, 0)
		h.Format = tar.FormatPAX
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatal(err)
		}
		io.WriteString(tw, e.body)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	data := buf.Bytes()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil })
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func testImage(t testing.TB, cfg v1.Config, layers ...v1.Layer) v1.Image {
	t.Helper()
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture, cf.Config = "linux", runtime.GOARCH, cfg
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// The layers of the test images: a base with hard links, a layer that
// deletes files and directories and makes a directory opaque, a layer
// that whites out a directory and makes it again, and the tops that
// tell the images apart.
func baseLayer(t testing.TB) v1.Layer {
	return tarLayer(t,
		dir("etc/"), file("etc/a", "a1"), file("etc/b", "b1"), hardlink("etc/a-link", "etc/a"),
		file("etc/c", "c1"), hardlink("etc/c-link", "etc/c"),
		dir("usr/"), dir("usr/lib/"), file("usr/lib/x", "x1"), dir("usr/lib/sub/"), file("usr/lib/sub/y", "y1"),
		dir("opt/"), dir("opt/d/"), file("opt/d/1", "d1"), file("opt/d/2", "d2"),
		dir("bin/"), symlink("bin/sh", "busybox"), file("bin/busybox", "bb"),
		dir("home/"), dir("home/u/"), file("home/u/.profile", "p"),
	)
}

func changeLayer(t testing.TB) v1.Layer {
	wh := func(name string) tarEntry { return file(name, "") }
	return tarLayer(t,
		dir("etc/"), wh("etc/.wh.b"), file("etc/d", "d2"), wh("etc/.wh.c-link"),
		dir("opt/"), dir("opt/d/"), wh("opt/d/.wh..wh..opq"), file("opt/d/3", "d3"),
		dir("usr/"), wh("usr/.wh.lib"), file("usr/new", "n"),
		wh("home/.wh.u"),
		dir("srv/"), file("srv/f", "f"), hardlink("srv/f-link", "srv/f"),
	)
}

func topLayer(t testing.TB, tag string) v1.Layer {
	return tarLayer(t, dir("testbed/"), file("testbed/"+tag, tag), file("etc/d", "d-"+tag))
}

// stackTree lists a tree: path -> "type mode uid:gid content-or-target".
func stackTree(t testing.TB, root string) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if rel == "." {
			return nil
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		st := fi.Sys().(*syscall.Stat_t)
		v := fmt.Sprintf("%s %o %d:%d", fi.Mode().Type(), fi.Mode().Perm(), st.Uid, st.Gid)
		switch {
		case fi.Mode().IsRegular():
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			v += " " + string(b)
		case fi.Mode()&fs.ModeSymlink != 0:
			target, _ := os.Readlink(p)
			v += " -> " + target
		}
		out[rel] = v
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// flattened is go-containerregistry's flattening of img, extracted.
func flattened(t testing.TB, img v1.Image) map[string]string {
	t.Helper()
	rc := mutate.Extract(img)
	defer rc.Close()
	dst := filepath.Join(t.TempDir(), "flat")
	x, err := newExtractor(dst, false)
	if err != nil {
		t.Fatal(err)
	}
	defer x.close()
	if err := x.apply(context.Background(), rc); err != nil {
		t.Fatal(err)
	}
	if err := x.finishDirs(); err != nil {
		t.Fatal(err)
	}
	return stackTree(t, dst)
}

// mountStack stacks the image's layers with overlayfs and returns the
// merged tree's root.
func mountStack(t testing.TB, e *testEnv, im PulledImage) string {
	t.Helper()
	base, ws := im.Stack()
	stack, err := e.store.ResolveStack(base, ws, nil)
	if err != nil {
		t.Fatal(err)
	}
	var lowers []string
	for _, l := range stack {
		p, err := e.store.Acquire(l.Digest)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { e.store.Release(l.Digest) })
		lowers = append(lowers, p)
	}
	sb, err := os.MkdirTemp(e.root, "sb-")
	if err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(sb, "root")
	if err := Compose(target, lowers, filepath.Join(sb, "u"), filepath.Join(sb, "w"), true); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { Unmount(target) })
	return target
}

func diffStack(t testing.TB, got, want map[string]string) {
	t.Helper()
	for _, k := range slices.Sorted(func(yield func(string) bool) {
		seen := map[string]bool{}
		for k := range got {
			seen[k] = true
		}
		for k := range want {
			seen[k] = true
		}
		for k := range seen {
			if !yield(k) {
				return
			}
		}
	}) {
		if got[k] != want[k] {
			t.Errorf("%s: stacked layers have %q, the flattened image %q", k, got[k], want[k])
		}
	}
}

func TestPullImage(t *testing.T) {
	e := newEnv(t)
	reg := newTestRegistry(t)
	base, change := baseLayer(t), changeLayer(t)
	cfg := v1.Config{Env: []string{"PATH=/opt/bin:/usr/bin:/bin", "LANG=C.UTF-8"}, WorkingDir: "/testbed", User: "1000", Cmd: []string{"pytest"}}
	img1 := testImage(t, cfg, base, change, topLayer(t, "one"))
	img2 := testImage(t, cfg, base, change, topLayer(t, "two"))
	ref1 := reg.push(t, "swe/task:one", img1)
	ref2 := reg.push(t, "swe/task:two", img2)

	var stages []string
	im1, err := e.store.PullImage(context.Background(), PullOptions{Image: ref1, Progress: func(p Progress) {
		if p.Message != "" {
			stages = append(stages, p.Stage+": "+p.Message)
		}
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("progress:\n%s", strings.Join(stages, "\n"))
	if len(im1.Layers) != 3 || im1.Reused != 0 || im1.Fetched == 0 {
		t.Errorf("first pull: %d layers, %d reused, %d bytes fetched", len(im1.Layers), im1.Reused, im1.Fetched)
	}
	if !strings.HasPrefix(im1.Layers[0], OCIBaseName+":sha256-") || !strings.HasPrefix(im1.Layers[1], OCILayerName+":sha256-") {
		t.Errorf("layer tags: %v", im1.Layers)
	}
	if !slices.Equal(im1.Config.Env, cfg.Env) || im1.Config.WorkingDir != "/testbed" || im1.Config.User != "1000" || !slices.Equal(im1.Config.Cmd, cfg.Cmd) {
		t.Errorf("config: %+v", im1.Config)
	}
	d1, _ := img1.Digest()
	if im1.Digest != d1.String() {
		t.Errorf("digest %s, pushed %s", im1.Digest, d1)
	}

	// Stacked, the layers are the flattened image.
	diffStack(t, stackTree(t, mountStack(t, e, im1)), flattened(t, img1))

	// The second image fetches only its own top layer.
	im2, err := e.store.PullImage(context.Background(), PullOptions{Image: ref2})
	if err != nil {
		t.Fatal(err)
	}
	if im2.Reused != 2 {
		t.Errorf("second image: %d layers reused, want 2", im2.Reused)
	}
	for _, l := range []v1.Layer{base, change} {
		d, _ := l.Digest()
		if n := reg.blobGets(d); n != 1 {
			t.Errorf("shared layer %s fetched %d times, want 1", d, n)
		}
	}
	if !slices.Equal(im1.Layers[:2], im2.Layers[:2]) || im1.Layers[2] == im2.Layers[2] {
		t.Errorf("layers: %v and %v", im1.Layers, im2.Layers)
	}
	diffStack(t, stackTree(t, mountStack(t, e, im2)), flattened(t, img2))

	// Pulled again: nothing fetched; found by its reference.
	before := reg.blobGets(mustDigest(t, topLayer(t, "one")))
	im1b, err := e.store.PullImage(context.Background(), PullOptions{Image: ref1})
	if err != nil {
		t.Fatal(err)
	}
	if im1b.Fetched != 0 || im1b.Reused != 3 || reg.blobGets(mustDigest(t, topLayer(t, "one"))) != before {
		t.Errorf("second pull: %d bytes fetched, %d reused", im1b.Fetched, im1b.Reused)
	}
	cfgDigest, _ := img1.ConfigName()
	if n := reg.blobGets(cfgDigest); n != 1 {
		t.Errorf("the config of an image pulled again at the same digest fetched %d times, want 1", n)
	}
	if got, err := e.store.LookupPulledImage(ref1); err != nil || got.Digest != im1.Digest {
		t.Errorf("LookupPulledImage: %+v, %v", got, err)
	}

	// A layer that is the bottom of one image and above another's: its
	// whiteouts, which hide nothing there, dropped from the bottom's
	// conversion (so fetched again, once).
	img3 := testImage(t, cfg, change, topLayer(t, "three"))
	im3, err := e.store.PullImage(context.Background(), PullOptions{Image: reg.push(t, "swe/other:1", img3)})
	if err != nil {
		t.Fatal(err)
	}
	if n := reg.blobGets(mustDigest(t, change)); n != 2 || im3.Reused != 0 {
		t.Errorf("changes layer as a base: fetched %d times, %d reused", n, im3.Reused)
	}
	diffStack(t, stackTree(t, mountStack(t, e, im3)), flattened(t, img3))
}

func mustDigest(t testing.TB, l v1.Layer) v1.Hash {
	t.Helper()
	d, err := l.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func TestPullImageIndex(t *testing.T) {
	e := newEnv(t)
	reg := newTestRegistry(t)
	other := "arm64"
	if runtime.GOARCH == "arm64" {
		other = "amd64"
	}
	mine := testImage(t, v1.Config{Env: []string{"ARCH=mine"}}, tarLayer(t, file("arch", runtime.GOARCH)))
	theirs := testImage(t, v1.Config{Env: []string{"ARCH=theirs"}}, tarLayer(t, file("arch", other)))
	theirCF, _ := theirs.ConfigFile()
	theirCF = theirCF.DeepCopy()
	theirCF.Architecture = other
	theirs, _ = mutate.ConfigFile(theirs, theirCF)
	idx := mutate.AppendManifests(empty.Index,
		mutate.IndexAddendum{Add: theirs, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: other}}},
		mutate.IndexAddendum{Add: mine, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: runtime.GOARCH}}},
	)
	ref, _ := name.ParseReference(reg.host + "/multi:1")
	if err := remote.WriteIndex(ref, idx); err != nil {
		t.Fatal(err)
	}
	im, err := e.store.PullImage(context.Background(), PullOptions{Image: ref.Name()})
	if err != nil {
		t.Fatal(err)
	}
	md, _ := mine.Digest()
	if im.Digest != md.String() || !slices.Equal(im.Config.Env, []string{"ARCH=mine"}) {
		t.Errorf("pulled %s (%v), want this platform's %s", im.Digest, im.Config.Env, md)
	}

	// An index without this platform: a clear error, nothing kept.
	only := mutate.AppendManifests(empty.Index, mutate.IndexAddendum{Add: theirs, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: other}}})
	ref2, _ := name.ParseReference(reg.host + "/foreign:1")
	if err := remote.WriteIndex(ref2, only); err != nil {
		t.Fatal(err)
	}
	// A single image of another platform, and one whose config names none.
	ref3, _ := name.ParseReference(reg.host + "/foreign-image:1")
	if err := remote.Write(ref3, theirs); err != nil {
		t.Fatal(err)
	}
	if _, err := e.store.PullImage(context.Background(), PullOptions{Image: ref3.Name()}); !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "linux/"+other) {
		t.Errorf("pull of another platform's image: %v", err)
	}
	bare, _ := mutate.AppendLayers(empty.Image, tarLayer(t, file("bare", "x")))
	ref4, _ := name.ParseReference(reg.host + "/bare:1")
	if err := remote.Write(ref4, bare); err != nil {
		t.Fatal(err)
	}
	if im, err := e.store.PullImage(context.Background(), PullOptions{Image: ref4.Name()}); err != nil || im.Platform != "linux/"+runtime.GOARCH {
		t.Errorf("pull of an image whose config names no platform: %+v, %v", im, err)
	}
	before, _ := e.store.List()
	_, err = e.store.PullImage(context.Background(), PullOptions{Image: ref2.Name()})
	if !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "linux/"+other) {
		t.Errorf("pull of another platform's image: %v", err)
	}
	t.Log(err)
	if after, _ := e.store.List(); len(after) != len(before) {
		t.Errorf("a failed pull left layers: %d before, %d after", len(before), len(after))
	}
}

func TestPullImageRefused(t *testing.T) {
	e := newEnv(t)
	reg := newTestRegistry(t)
	good := tarLayer(t, file("ok", "ok"))
	bad := map[string]v1.Layer{
		"escapes":      tarLayer(t, file("../../etc/evil", "x")),
		"device":       tarLayer(t, tarEntry{tar.Header{Typeflag: tar.TypeChar, Name: "dev/null", Devmajor: 1, Devminor: 3, Mode: 0o666}, ""}),
		"fifo":         tarLayer(t, tarEntry{tar.Header{Typeflag: tar.TypeFifo, Name: "fifo", Mode: 0o666}, ""}),
		"through":      tarLayer(t, symlink("etc", "/etc"), file("etc/passwd", "x")),
		"bad-whiteout": tarLayer(t, file("a/.wh..", "")),
	}
	for what, l := range bad {
		t.Run(what, func(t *testing.T) {
			ref := reg.push(t, "bad/"+what+":1", testImage(t, v1.Config{}, good, l))
			_, err := e.store.PullImage(context.Background(), PullOptions{Image: ref})
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("pull: %v, want invalid argument", err)
			}
			t.Log(err)
			if _, err := e.store.Resolve(ociTag(KindWorkspace, mustDigest(t, l))); !errors.Is(err, ErrNotFound) {
				t.Errorf("the refused layer is tagged: %v", err)
			}
			if _, err := e.store.LookupPulledImage(ref); !errors.Is(err, ErrNotFound) {
				t.Errorf("the refused image is recorded: %v", err)
			}
		})
	}
	// The good bottom layer was kept: a pull resumes from it.
	if _, err := e.store.Resolve(ociTag(KindBase, mustDigest(t, good))); err != nil {
		t.Errorf("the good layer: %v", err)
	}
	if ents, _ := os.ReadDir(e.store.tmp); len(ents) != 0 {
		t.Errorf("scratch left in tmp: %v", ents)
	}

	for _, ref := range []string{"", "UPPER/case", "a b", strings.Repeat("a", 600), "x@sha256:123"} {
		if _, err := e.store.PullImage(context.Background(), PullOptions{Image: ref}); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("pull %q: %v, want invalid argument", ref, err)
		}
	}
	if _, err := e.store.PullImage(context.Background(), PullOptions{Image: reg.host + "/no/such:1"}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("pull of an unknown image: %v, want not found", err)
	}
}

func TestPullImageBounds(t *testing.T) {
	e := newEnv(t)
	reg := newTestRegistry(t)
	small := tarLayer(t, file("small", "x"))
	big := tarLayer(t, file("big", strings.Repeat("y", 2<<20)))
	ref := reg.push(t, "big:1", testImage(t, v1.Config{}, small, big))
	e.store.SetRegistry(RegistryConfig{MaxPullBytes: 1 << 20})
	_, err := e.store.PullImage(context.Background(), PullOptions{Image: ref})
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "more than 1.0 MiB uncompressed") {
		t.Errorf("pull of an image past the byte bound: %v", err)
	}
	if _, err := e.store.Resolve(ociTag(KindWorkspace, mustDigest(t, big))); !errors.Is(err, ErrNotFound) {
		t.Errorf("the layer past the bound is tagged: %v", err)
	}

	defer func(n int) { maxLayerEntries = n }(maxLayerEntries)
	maxLayerEntries = 10
	var many []tarEntry
	for i := range 11 {
		many = append(many, file(fmt.Sprint("f", i), ""))
	}
	ref = reg.push(t, "many:1", testImage(t, v1.Config{}, tarLayer(t, many...)))
	e.store.SetRegistry(RegistryConfig{})
	if _, err := e.store.PullImage(context.Background(), PullOptions{Image: ref}); !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "more than 10 entries") {
		t.Errorf("pull of a layer past the entry bound: %v", err)
	}
}

func TestPullImageCorruptBlob(t *testing.T) {
	e := newEnv(t)
	reg := newTestRegistry(t)
	l := tarLayer(t, file("data", strings.Repeat("x", 1<<16)))
	d := mustDigest(t, l)
	ref := reg.push(t, "corrupt:1", testImage(t, v1.Config{}, l))
	reg.wrap = func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		if !strings.HasSuffix(r.URL.Path, "/blobs/"+d.String()) {
			next.ServeHTTP(w, r)
			return
		}
		rec := httptest.NewRecorder()
		next.ServeHTTP(rec, r)
		body := rec.Body.Bytes()
		body[4] ^= 0xff // the gzip header's mtime: the same content, another digest
		for k, v := range rec.Header() {
			w.Header()[k] = v
		}
		w.WriteHeader(rec.Code)
		w.Write(body)
	}
	_, err := e.store.PullImage(context.Background(), PullOptions{Image: ref})
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), d.Hex) {
		t.Fatalf("a blob that does not match its digest: %v, want invalid argument naming the digest", err)
	}
	t.Log(err)
	if _, err := e.store.Resolve(ociTag(KindBase, d)); !errors.Is(err, ErrNotFound) {
		t.Errorf("the corrupt layer is tagged: %v", err)
	}
}

func TestPullImageStall(t *testing.T) {
	e := newEnv(t)
	reg := newTestRegistry(t)
	l := tarLayer(t, file("data", "x"))
	ref := reg.push(t, "stall:1", testImage(t, v1.Config{}, l))
	release := make(chan struct{})
	defer close(release)
	reg.wrap = func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		if strings.Contains(r.URL.Path, "/blobs/") && r.Method == http.MethodGet && strings.HasSuffix(r.URL.Path, mustDigest(t, l).String()) {
			size, _ := l.Size()
			w.Header().Set("Content-Length", fmt.Sprint(size))
			w.WriteHeader(http.StatusOK)
			w.Write([]byte{0x1f, 0x8b})
			w.(http.Flusher).Flush()
			select { // a registry that stops sending
			case <-release:
			case <-r.Context().Done():
			}
			return
		}
		next.ServeHTTP(w, r)
	}
	e.store.SetRegistry(RegistryConfig{StallTimeout: 300 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := e.store.PullImage(ctx, PullOptions{Image: ref})
	if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "stalled") {
		t.Errorf("pull from a stalled registry: %v, want unavailable (stalled)", err)
	}
	if ctx.Err() != nil {
		t.Error("the pull ended by the test's deadline, not by the stall timeout")
	}

	// A manifest whose body stops half-way.
	reg.wrap = func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		if strings.Contains(r.URL.Path, "/manifests/") && r.Method == http.MethodGet {
			w.Header().Set("Content-Type", "application/vnd.oci.image.manifest.v1+json")
			w.Header().Set("Content-Length", "1000")
			w.WriteHeader(http.StatusOK)
			w.Write([]byte("{"))
			w.(http.Flusher).Flush()
			select {
			case <-release:
			case <-r.Context().Done():
			}
			return
		}
		next.ServeHTTP(w, r)
	}
	_, err = e.store.PullImage(ctx, PullOptions{Image: ref})
	if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "stalled") || ctx.Err() != nil {
		t.Errorf("pull of a manifest that stalls: %v, want unavailable (stalled)", err)
	}
}

func TestPullImageAuthAndMirror(t *testing.T) {
	e := newEnv(t)
	reg := newTestRegistry(t)
	l := tarLayer(t, file("hello", "world"))
	ref := reg.push(t, "library/private:1", testImage(t, v1.Config{}, l))
	reg.wrap = func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		if u, p, ok := r.BasicAuth(); !ok || u != "alice" || p != "s3cret" {
			w.Header().Set("WWW-Authenticate", `Basic realm="test"`)
			http.Error(w, `{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}`, http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	}
	_, err := e.store.PullImage(context.Background(), PullOptions{Image: ref})
	if !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Errorf("pull without credentials: %v, want permission denied", err)
	}
	wrong := []Credential{{Registry: reg.host, Username: "alice", Password: "nope"}}
	if _, err := e.store.PullImage(context.Background(), PullOptions{Image: ref, Credentials: wrong}); !errors.Is(err, errdefs.ErrPermissionDenied) || strings.Contains(err.Error(), "nope") {
		t.Errorf("pull with a wrong password: %v", err)
	}
	creds := []Credential{{Registry: "elsewhere.example", Username: "bob", Password: "x"}, {Registry: reg.host, Username: "alice", Password: "s3cret"}}
	if _, err := e.store.PullImage(context.Background(), PullOptions{Image: ref, Credentials: creds}); err != nil {
		t.Fatalf("pull with credentials: %v", err)
	}
	if fmt.Sprint(creds) != "[credential for elsewhere.example credential for "+reg.host+"]" {
		t.Errorf("credentials print their secrets: %v", creds)
	}

	// A Docker Hub name through a mirror: docker.io is never reached.
	e2 := newEnv(t)
	mirror := newTestRegistry(t)
	mirror.push(t, "library/busy:1", testImage(t, v1.Config{Env: []string{"FROM=mirror"}}, l))
	e2.store.SetRegistry(RegistryConfig{Mirrors: map[string][]string{"docker.io": {"http://127.0.0.1:1", "http://" + mirror.host}}})
	im, err := e2.store.PullImage(context.Background(), PullOptions{Image: "busy:1"})
	if err != nil {
		t.Fatal(err)
	}
	if im.Ref != "index.docker.io/library/busy:1" || !slices.Equal(im.Config.Env, []string{"FROM=mirror"}) {
		t.Errorf("pulled %s %v through the mirror", im.Ref, im.Config.Env)
	}

	// Which bases are images: with a "/", always (pulled if need be);
	// without, only one pulled before and no layer of that name.
	for _, c := range []struct {
		base, image string
		pull        bool
	}{
		{"busy:1", "busy:1", false},
		{"docker.io/library/busy:1", "docker.io/library/busy:1", false},
		{"library/busy:1", "library/busy:1", false},
		{"busy:2", "", false},
		{"python:3.12", "", false},
		{mirror.host + "/library/busy:9", mirror.host + "/library/busy:9", true},
	} {
		if image, pull := e2.store.ImageForBase(c.base); image != c.image || pull != c.pull {
			t.Errorf("ImageForBase(%q) = %q, %v; want %q, %v", c.base, image, pull, c.image, c.pull)
		}
	}
	if _, _, err := e2.store.Tag(im.Layers[0], "busy:1"); err != nil { // a layer of that name wins
		t.Fatal(err)
	}
	if image, _ := e2.store.ImageForBase("busy:1"); image != "" {
		t.Errorf("ImageForBase of a layer's tag: %q", image)
	}
}

// TestPullImageFleet: with a layer store written through, a node pulls
// from the store, not from the registry, the layers another node
// converted; it fetches only the manifest and config from the registry.
func TestPullImageFleet(t *testing.T) {
	a := newEnv(t)
	st, err := lstore.Open("file://"+filepath.Join(a.root, "store"), lstore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	a.store.SetRemote(RemoteConfig{Store: st, WriteThrough: true})
	reg := newTestRegistry(t)
	base, change := baseLayer(t), changeLayer(t)
	img := testImage(t, v1.Config{}, base, change, topLayer(t, "fleet"))
	ref := reg.push(t, "fleet:1", img)
	if _, err := a.store.PullImage(context.Background(), PullOptions{Image: ref}); err != nil {
		t.Fatal(err)
	}

	b := newEnv(t)
	b.store.SetRemote(RemoteConfig{Store: st})
	im, err := b.store.PullImage(context.Background(), PullOptions{Image: ref})
	if err != nil {
		t.Fatal(err)
	}
	if im.Reused != 3 || im.Fetched != 0 {
		t.Errorf("second node: %d layers reused, %d bytes fetched; want 3 and 0", im.Reused, im.Fetched)
	}
	for _, l := range []v1.Layer{base, change} {
		if n := reg.blobGets(mustDigest(t, l)); n != 1 {
			t.Errorf("layer %s fetched %d times from the registry, want 1 (by the first node)", mustDigest(t, l), n)
		}
	}
	diffStack(t, stackTree(t, mountStack(t, b, im)), flattened(t, img))
}

// A tenant's pull is its own: another tenant does not see the image, its
// record or its layers' tags, cannot create from it by name, and pulls it
// only with credentials of its own (then without fetching the layers
// again: it holds tags of its own to the same images); the admin's pulls
// are shared.
func TestPullImageTenants(t *testing.T) {
	e := newEnv(t)
	reg := newTestRegistry(t)
	l := tarLayer(t, file("secret", "of a"))
	ref := reg.push(t, "corp/private:1", testImage(t, v1.Config{Env: []string{"A=1"}}, l))
	reg.wrap = func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		if u, p, ok := r.BasicAuth(); !ok || u != "a" || p != "pw" {
			w.Header().Set("WWW-Authenticate", `Basic realm="test"`)
			http.Error(w, `{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}`, http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	}
	creds := []Credential{{Registry: reg.host, Username: "a", Password: "pw"}}
	a, b := e.store.As(Owner{Tenant: "a"}), e.store.As(Owner{Tenant: "b"})
	im, err := a.PullImage(context.Background(), PullOptions{Image: ref, Credentials: creds})
	if err != nil {
		t.Fatal(err)
	}
	if im.Tenant != "a" {
		t.Errorf("a's pull recorded for %q", im.Tenant)
	}
	if _, err := a.LookupPulledImage(ref); err != nil {
		t.Errorf("a's own image: %v", err)
	}
	if _, err := b.LookupPulledImage(ref); !errors.Is(err, ErrNotFound) {
		t.Errorf("b sees a's image: %v", err)
	}
	if _, err := e.store.LookupPulledImage(ref); !errors.Is(err, ErrNotFound) {
		t.Errorf("a tenant's pull is shared: %v", err)
	}
	if image, pull := b.ImageForBase(ref); image != ref || !pull {
		t.Errorf("b's ImageForBase(%s) = %q, %v: want a pull of its own", ref, image, pull)
	}
	for _, tag := range im.Layers {
		if _, err := b.Resolve(tag); !errors.Is(err, ErrNotFound) {
			t.Errorf("b resolves a's layer %s: %v", tag, err)
		}
		if _, err := a.Resolve(tag); err != nil {
			t.Errorf("a's layer %s: %v", tag, err)
		}
	}
	if ls, _ := b.List(); len(ls) != 0 {
		t.Errorf("b lists a's layers: %+v", ls)
	}
	if _, err := b.PullImage(context.Background(), PullOptions{Image: ref}); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Errorf("b's pull without credentials: %v, want permission denied", err)
	}
	gets := reg.blobGets(mustDigest(t, l))
	imb, err := b.PullImage(context.Background(), PullOptions{Image: ref, Credentials: creds})
	if err != nil {
		t.Fatal(err)
	}
	if imb.Reused != len(imb.Layers) || reg.blobGets(mustDigest(t, l)) != gets {
		t.Errorf("b's pull of converted layers: reused %d of %d, layer fetched %d more times", imb.Reused, len(imb.Layers), reg.blobGets(mustDigest(t, l))-gets)
	}
	for _, tag := range imb.Layers {
		if _, err := b.Resolve(tag); err != nil {
			t.Errorf("b's own tag %s: %v", tag, err)
		}
	}
	if _, err := a.Remove(im.Layers[0], nil); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Resolve(imb.Layers[0]); err != nil {
		t.Errorf("b's tag gone with a's: %v", err)
	}
	// The admin's pull is shared: every tenant sees it.
	reg.wrap = nil
	pub := reg.push(t, "library/public:1", testImage(t, v1.Config{}, tarLayer(t, file("p", "q"))))
	if _, err := e.store.PullImage(context.Background(), PullOptions{Image: pub}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.LookupPulledImage(pub); err != nil {
		t.Errorf("a shared image, as b: %v", err)
	}
	// A layer reference qualified by its namespace is a layer, never an
	// image to pull (an environment's references are qualified).
	shared, err := b.LookupPulledImage(pub)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		v    View
		base string
	}{
		{b, "/" + shared.Layers[0]},
		{e.store.As(AdminOwner), "/" + shared.Layers[0]},
		{b, "b/" + imb.Layers[0]},
		{e.store.As(AdminOwner), "b/" + imb.Layers[0]},
	} {
		if image, pull := c.v.ImageForBase(c.base); image != "" || pull {
			t.Errorf("ImageForBase(%q) as %+v = %q, %v: want a layer", c.base, c.v.Owner(), image, pull)
		}
	}
	if image, pull := a.ImageForBase("b/" + imb.Layers[0]); image == "" || !pull {
		t.Errorf("another tenant's qualified layer, as a: %q %v; want an image reference (a's to pull)", image, pull)
	}
}

package layer

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

func (e *testEnv) buildKind(t testing.TB, kind Kind, ref string, files map[string]string) Layer {
	t.Helper()
	name, version, err := ParseTag(ref)
	if err != nil {
		t.Fatal(err)
	}
	l, err := e.store.Build(context.Background(), BuildOptions{Kind: kind, Name: name, Version: version, Source: writeTree(t, t.TempDir(), files)})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func exists(p string) bool { _, err := os.Stat(p); return err == nil }

func TestTag(t *testing.T) {
	e := newEnv(t)
	a := e.buildKind(t, KindToolkit, "pytest:8", map[string]string{"v": "8"})
	b := e.buildKind(t, KindToolkit, "pytest:9", map[string]string{"v": "9"})
	tests := []struct {
		source, target string
		wantDigest     string
		wantPrev       string
		errIs          error
		wantErr        string
	}{
		{source: "pytest:8", target: "pytest:stable", wantDigest: a.Digest},
		{source: "pytest:9", target: "pytest:stable", wantDigest: b.Digest, wantPrev: a.Digest}, // moves
		{source: a.Digest, target: "pt:old", wantDigest: a.Digest},
		{source: "pytest@" + b.Digest, target: "pt:new", wantDigest: b.Digest},
		{source: "pytest:9", target: "pytest", errIs: errdefs.ErrInvalidArgument, wantErr: "give name:version"},
		{source: "pytest:9", target: "pytest@" + a.Digest, errIs: errdefs.ErrInvalidArgument, wantErr: "want a tag"},
		{source: "pytest:10", target: "x:1", errIs: ErrNotFound, wantErr: "pytest:10"},
	}
	for _, tt := range tests {
		t.Run(tt.source+"->"+tt.target, func(t *testing.T) {
			l, prev, err := e.store.Tag(tt.source, tt.target)
			if tt.errIs != nil {
				if !errors.Is(err, tt.errIs) || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("Tag error = %v, want %v containing %q", err, tt.errIs, tt.wantErr)
				}
				return
			}
			if err != nil || l.Digest != tt.wantDigest || prev != tt.wantPrev || l.Ref() != tt.target || l.Kind != KindToolkit {
				t.Fatalf("Tag = %+v, %q, %v", l, prev, err)
			}
			if got, err := e.store.Resolve(tt.target); err != nil || got.Digest != tt.wantDigest {
				t.Errorf("Resolve(%s) = %s, %v", tt.target, got.Digest, err)
			}
		})
	}
	if tags, _ := e.store.Tags(a.Digest); !slices.Equal(tags, []string{"pt:old", "pytest:8"}) {
		t.Errorf("Tags(a) = %v", tags)
	}
}

// TestTagMovesAtomically: readers resolving a tag while it is moved back and
// forth always see one of the two layers.
func TestTagMovesAtomically(t *testing.T) {
	e := newEnv(t)
	a := e.buildKind(t, KindBase, "os:a", map[string]string{"v": "a"})
	b := e.buildKind(t, KindBase, "os:b", map[string]string{"v": "b"})
	if _, _, err := e.store.Tag("os:a", "os:current"); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for range 4 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				l, err := e.store.Resolve("os:current")
				if err != nil || (l.Digest != a.Digest && l.Digest != b.Digest) {
					t.Errorf("Resolve during moves: %+v, %v", l, err)
					return
				}
			}
		})
	}
	for i := range 200 {
		src := []string{"os:a", "os:b"}[i%2]
		if _, _, err := e.store.Tag(src, "os:current"); err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	wg.Wait()
}

func TestRemove(t *testing.T) {
	tests := []struct {
		name         string
		setup        func(t *testing.T, e *testEnv, l Layer) Usage
		ref          func(l Layer) string
		wantUntagged []string
		wantRemoved  bool
		errIs        error
		wantErr      string
	}{{
		name:         "last tag: image goes too",
		ref:          func(l Layer) string { return "ws:1" },
		wantUntagged: []string{"ws:1"},
		wantRemoved:  true,
	}, {
		name: "another tag keeps the image",
		setup: func(t *testing.T, e *testEnv, l Layer) Usage {
			must(t, tagErr(e.store.Tag("ws:1", "ws:latest")))
			return nil
		},
		ref:          func(l Layer) string { return "ws:1" },
		wantUntagged: []string{"ws:1"},
	}, {
		name:         "a sandbox keeps the image",
		setup:        func(t *testing.T, e *testEnv, l Layer) Usage { return Usage{l.Digest: {"sandbox1"}} },
		ref:          func(l Layer) string { return "ws:1" },
		wantUntagged: []string{"ws:1"},
	}, {
		name: "a mount keeps the image",
		setup: func(t *testing.T, e *testEnv, l Layer) Usage {
			_, err := e.store.Acquire(l.Digest)
			must(t, err)
			t.Cleanup(func() { e.store.Release(l.Digest) })
			return nil
		},
		ref:          func(l Layer) string { return "ws:1" },
		wantUntagged: []string{"ws:1"},
	}, {
		name: "a tag an environment names is refused",
		setup: func(t *testing.T, e *testEnv, l Layer) Usage {
			_, err := e.store.CreateEnv(Env{Name: "env1", Base: "os:1", Workspaces: []string{"ws:1"}}, false)
			must(t, err)
			return nil
		},
		ref:     func(l Layer) string { return "ws:1" },
		errIs:   ErrInUse,
		wantErr: "environment env1 names it",
	}, {
		name:    "by digest while tagged is refused",
		ref:     func(l Layer) string { return l.Digest },
		errIs:   errdefs.ErrFailedPrecondition,
		wantErr: "tagged as ws:1",
	}, {
		name: "by digest while used by a sandbox is refused",
		setup: func(t *testing.T, e *testEnv, l Layer) Usage {
			_, err := e.store.Remove("ws:1", Usage{l.Digest: {"sb"}})
			must(t, err)
			return Usage{l.Digest: {"sb", "sb2"}}
		},
		ref:     func(l Layer) string { return "ws@" + l.Digest },
		errIs:   ErrInUse,
		wantErr: "used by sandbox sb, sb2",
	}, {
		name: "by digest while mounted is refused",
		setup: func(t *testing.T, e *testEnv, l Layer) Usage {
			_, err := e.store.Acquire(l.Digest)
			must(t, err)
			t.Cleanup(func() { e.store.Release(l.Digest) })
			_, err = e.store.Remove("ws:1", nil)
			must(t, err)
			return nil
		},
		ref:     func(l Layer) string { return l.Digest },
		errIs:   ErrInUse,
		wantErr: "mounted",
	}, {
		name: "by digest once unused",
		setup: func(t *testing.T, e *testEnv, l Layer) Usage {
			_, err := e.store.Remove("ws:1", Usage{l.Digest: {"sb"}})
			must(t, err)
			return nil
		},
		ref:         func(l Layer) string { return l.Digest },
		wantRemoved: true,
	}, {
		name:    "unknown",
		ref:     func(l Layer) string { return "ws:2" },
		errIs:   ErrNotFound,
		wantErr: "ws:2",
	}, {
		name:    "malformed",
		ref:     func(l Layer) string { return "ws" },
		errIs:   errdefs.ErrInvalidArgument,
		wantErr: "give name:version",
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t)
			e.buildKind(t, KindBase, "os:1", map[string]string{"os": "1"})
			l := e.buildKind(t, KindWorkspace, "ws:1", map[string]string{"repo": "x"})
			var usage Usage
			if tt.setup != nil {
				usage = tt.setup(t, e, l)
			}
			res, err := e.store.Remove(tt.ref(l), usage)
			if tt.errIs != nil {
				if !errors.Is(err, tt.errIs) || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("Remove error = %v, want %v containing %q", err, tt.errIs, tt.wantErr)
				}
				if errors.Is(err, ErrInUse) && !errors.Is(err, errdefs.ErrFailedPrecondition) {
					t.Errorf("in-use error not marked failed precondition: %v", err)
				}
				if !exists(e.store.ImagePath(l.Digest)) {
					t.Error("refused Remove deleted the image")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(res.Untagged, tt.wantUntagged) {
				t.Errorf("untagged %v, want %v", res.Untagged, tt.wantUntagged)
			}
			if removed := len(res.Removed) == 1 && res.Removed[0].Digest == l.Digest; removed != tt.wantRemoved {
				t.Errorf("removed %v, want %v", res.Removed, tt.wantRemoved)
			}
			if exists(e.store.ImagePath(l.Digest)) == tt.wantRemoved {
				t.Errorf("image file exists: %v, want %v", !tt.wantRemoved, !tt.wantRemoved)
			}
			if tt.wantRemoved && res.FreedBytes != l.Size {
				t.Errorf("freed %d, want %d", res.FreedBytes, l.Size)
			}
			if _, err := e.store.Resolve(l.Digest); (err == nil) == tt.wantRemoved {
				t.Errorf("Resolve by digest after Remove: %v", err)
			}
		})
	}
}

func tagErr(_ Layer, _ string, err error) error { return err }

func TestGC(t *testing.T) {
	e := newEnv(t)
	e.buildKind(t, KindBase, "os:1", map[string]string{"os": "1"})
	tagged := e.buildKind(t, KindToolkit, "tk:1", map[string]string{"v": "1"})
	old := tagged
	tagged = e.buildKind(t, KindToolkit, "tk:1", map[string]string{"v": "2"}) // old is now dangling
	used := e.buildKind(t, KindToolkit, "used:1", map[string]string{"v": "used"})
	mounted := e.buildKind(t, KindToolkit, "mounted:1", map[string]string{"v": "mounted"})
	pinned := e.buildKind(t, KindToolkit, "pinned:1", map[string]string{"v": "pinned"})
	_, err := e.store.CreateEnv(Env{Name: "pin", Base: "os:1", Toolkits: []string{"pinned@" + pinned.Digest}}, false)
	must(t, err)
	for _, ref := range []string{"used:1", "mounted:1", "pinned:1"} {
		_, err := e.store.Remove(ref, Usage{used.Digest: {"sb1"}, mounted.Digest: {"x"}, pinned.Digest: {"x"}})
		must(t, err)
	}
	_, err = e.store.Acquire(mounted.Digest)
	must(t, err)
	defer e.store.Release(mounted.Digest)
	orphan := "sha256:" + strings.Repeat("ab", 32)
	must(t, os.WriteFile(e.store.ImagePath(orphan), []byte("left by a crash"), 0o444))
	usage := Usage{used.Digest: {"sb1"}}

	dry, err := e.store.GC(usage, true)
	must(t, err)
	var digests []string
	for _, l := range dry.Removed {
		digests = append(digests, l.Digest)
	}
	slices.Sort(digests)
	want := []string{old.Digest, orphan}
	slices.Sort(want)
	if !slices.Equal(digests, want) || dry.Kept != 5 {
		t.Fatalf("dry run would remove %v (kept %d), want %v (kept 5)", digests, dry.Kept, want)
	}
	if !exists(e.store.ImagePath(old.Digest)) {
		t.Fatal("dry run removed an image")
	}
	res, err := e.store.GC(usage, false)
	must(t, err)
	if len(res.Removed) != 2 || res.FreedBytes != old.Size+int64(len("left by a crash")) {
		t.Errorf("GC removed %+v, freed %d", res.Removed, res.FreedBytes)
	}
	for _, l := range []Layer{old} {
		if exists(e.store.ImagePath(l.Digest)) {
			t.Errorf("%s not collected", l.Digest)
		}
	}
	if exists(e.store.ImagePath(orphan)) {
		t.Error("orphan file not collected")
	}
	for _, l := range []Layer{tagged, used, mounted, pinned} {
		if !exists(e.store.ImagePath(l.Digest)) {
			t.Errorf("%s (%s) collected", l.Digest, l.Name)
		}
	}
	// Once nothing uses them, they go.
	must(t, e.store.DeleteEnv("pin"))
	must(t, e.store.Release(mounted.Digest))
	res, err = e.store.GC(nil, false)
	must(t, err)
	if len(res.Removed) != 3 {
		t.Errorf("second GC removed %d images, want 3 (used, mounted, pinned)", len(res.Removed))
	}
	_, err = e.store.Acquire(mounted.Digest) // for the deferred Release
	if !errors.Is(err, ErrNotFound) {
		t.Errorf("Acquire of a collected image: %v", err)
	}
	e.store.Acquire(tagged.Digest)
	ims, err := e.store.Images()
	must(t, err)
	if len(ims) != 2 {
		t.Errorf("%d images left, want os:1 and tk:1: %+v", len(ims), ims)
	}
}

// TestGCConcurrentBuilds: GC running alongside builds never collects a
// freshly built image before it is tagged.
func TestGCConcurrentBuilds(t *testing.T) {
	e := newEnv(t)
	var wg sync.WaitGroup
	stop := make(chan struct{})
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := e.store.GC(nil, false); err != nil {
				t.Error(err)
				return
			}
		}
	})
	for i := range 10 {
		l := e.buildKind(t, KindToolkit, "t:"+string(rune('a'+i)), map[string]string{"i": string(rune('a' + i))})
		p, err := e.store.Acquire(l.Digest)
		if err != nil {
			t.Fatalf("build %d: image collected before use: %v", i, err)
		}
		e.store.Release(l.Digest)
		_ = p
	}
	close(stop)
	wg.Wait()
}

func TestEnvs(t *testing.T) {
	e := newEnv(t)
	osl := e.buildKind(t, KindBase, "os:1", map[string]string{"os": "1"})
	ws := e.buildKind(t, KindWorkspace, "repo:1", map[string]string{"repo": "1"})
	tk1 := e.buildKind(t, KindToolkit, "tk:1", map[string]string{"tk": "1"})
	tk2 := e.buildKind(t, KindToolkit, "tk:2", map[string]string{"tk": "2"})
	tests := []struct {
		name    string
		env     Env
		replace bool
		errIs   error
		wantErr string
	}{
		{name: "ok", env: Env{Name: "py", Base: "os:1", Workspaces: []string{"repo:1"}, Toolkits: []string{"tk:1", "tk@" + tk2.Digest}}},
		{name: "exists", env: Env{Name: "py", Base: "os:1"}, errIs: errdefs.ErrAlreadyExists, wantErr: "environment py exists"},
		{name: "replace", env: Env{Name: "py", Base: "os:1", Toolkits: []string{"tk:1", "tk:2"}, Workspaces: []string{"repo:1"}}, replace: true},
		{name: "no base", env: Env{Name: "nobase"}, errIs: errdefs.ErrInvalidArgument, wantErr: "a base layer is required"},
		{name: "wrong kind", env: Env{Name: "wk", Base: "os:1", Toolkits: []string{"repo:1"}}, errIs: errdefs.ErrInvalidArgument, wantErr: "layer repo:1 is a workspace layer, not a toolkit layer"},
		{name: "base not a base", env: Env{Name: "wb", Base: "tk:1"}, errIs: errdefs.ErrInvalidArgument, wantErr: "not a base layer"},
		{name: "missing layer", env: Env{Name: "ml", Base: "os:1", Workspaces: []string{"repo:2"}}, errIs: ErrNotFound, wantErr: "repo:2"},
		{name: "bad name", env: Env{Name: "Py!", Base: "os:1"}, errIs: errdefs.ErrInvalidArgument, wantErr: `layer name "Py!"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := e.store.CreateEnv(tt.env, tt.replace)
			if tt.errIs != nil {
				if !errors.Is(err, tt.errIs) || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("CreateEnv error = %v, want %v containing %q", err, tt.errIs, tt.wantErr)
				}
				return
			}
			must(t, err)
		})
	}
	got, err := e.store.GetEnv("py")
	must(t, err)
	if !slices.Equal(got.Toolkits, []string{"tk:1", "tk:2"}) {
		t.Errorf("replaced env: %+v", got)
	}
	stack, err := e.store.ResolveStack(got.Base, got.Workspaces, got.Toolkits)
	must(t, err)
	var order []string
	for _, l := range stack {
		order = append(order, l.Digest)
	}
	if !slices.Equal(order, []string{tk1.Digest, tk2.Digest, ws.Digest, osl.Digest}) {
		t.Errorf("stack order (top first) %v", order)
	}
	envs, err := e.store.Envs()
	if err != nil || len(envs) != 1 {
		t.Errorf("Envs = %+v, %v", envs, err)
	}
	must(t, e.store.DeleteEnv("py"))
	if _, err := e.store.GetEnv("py"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("GetEnv after delete: %v", err)
	}
	if err := e.store.DeleteEnv("py"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("second DeleteEnv: %v", err)
	}
}

func TestExportImport(t *testing.T) {
	src := newEnv(t)
	l := src.buildKind(t, KindToolkit, "pytest:8", map[string]string{"bin/pytest": "#!/bin/sh\n"})
	var buf bytes.Buffer
	if _, err := src.store.Export(context.Background(), "pytest:8", &buf); err != nil {
		t.Fatal(err)
	}
	export := buf.Bytes()

	// tamper rewrites entry name's content with fn.
	tamper := func(name string, fn func([]byte) []byte) []byte {
		var out bytes.Buffer
		tr, tw := tar.NewReader(bytes.NewReader(export)), tar.NewWriter(&out)
		for {
			h, err := tr.Next()
			if err == io.EOF {
				break
			}
			must(t, err)
			b, _ := io.ReadAll(tr)
			if h.Name == name {
				b = fn(b)
				h.Size = int64(len(b))
			}
			tw.WriteHeader(h)
			tw.Write(b)
		}
		tw.Close()
		return out.Bytes()
	}
	flip := func(b []byte) []byte { b = slices.Clone(b); b[len(b)/2] ^= 1; return b }

	tests := []struct {
		name    string
		data    []byte
		tag     string
		wantRef string
		errIs   error
		wantErr string
	}{
		{name: "round trip", data: export, wantRef: "pytest:8"},
		{name: "again (already there)", data: export, wantRef: "pytest:8"},
		{name: "under another tag", data: export, tag: "pytest:imported", wantRef: "pytest:imported"},
		{name: "bad tag", data: export, tag: "pytest", errIs: errdefs.ErrInvalidArgument, wantErr: "give name:version"},
		{name: "flipped bit", data: tamper(exportImageName, flip), errIs: errdefs.ErrInvalidArgument, wantErr: "digest mismatch"},
		{name: "truncated", data: export[:len(export)/2], errIs: errdefs.ErrInvalidArgument, wantErr: "read image"},
		{name: "edited metadata", data: tamper(exportMetaName, func(b []byte) []byte {
			return bytes.Replace(b, []byte(l.Digest), []byte("sha256:"+strings.Repeat("0", 64)), 1)
		}), errIs: errdefs.ErrInvalidArgument, wantErr: "digest mismatch"},
		{name: "wrong format", data: tamper(exportMetaName, func(b []byte) []byte {
			return bytes.Replace(b, []byte(ExportFormat), []byte("shoal-layer/v9"), 1)
		}), errIs: errdefs.ErrInvalidArgument, wantErr: `export format "shoal-layer/v9"`},
		{name: "not a tar", data: []byte("hello"), errIs: errdefs.ErrInvalidArgument, wantErr: "not a layer export"},
		{name: "some other tar", data: tarBytes(t, file("x", "y")), errIs: errdefs.ErrInvalidArgument, wantErr: `first entry is "x"`},
	}
	dst := newEnv(t)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := dst.store.Import(context.Background(), bytes.NewReader(tt.data), ImportOptions{Tag: tt.tag, AllowSetID: true})
			if tt.errIs != nil {
				if !errors.Is(err, tt.errIs) || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("Import error = %v, want %v containing %q", err, tt.errIs, tt.wantErr)
				}
				return
			}
			must(t, err)
			if got.Digest != l.Digest || got.Ref() != tt.wantRef || got.Kind != KindToolkit || got.Size != l.Size || got.Source != l.Source {
				t.Errorf("imported %+v, exported %+v", got, l)
			}
			mnt, err := dst.store.Acquire(got.Digest)
			must(t, err)
			defer dst.store.Release(got.Digest)
			if b, _ := os.ReadFile(filepath.Join(mnt, "bin/pytest")); string(b) != "#!/bin/sh\n" {
				t.Errorf("imported content %q", b)
			}
		})
	}
	if tmp, _ := os.ReadDir(filepath.Join(dst.dir, "tmp")); len(tmp) != 0 {
		t.Errorf("imports left %d entries in tmp/", len(tmp))
	}
	ims, _ := dst.store.Images()
	if len(ims) != 1 {
		t.Errorf("%d images after imports, want 1", len(ims))
	}
	if _, err := src.store.Export(context.Background(), "nope:1", io.Discard); !errors.Is(err, ErrNotFound) {
		t.Errorf("export of a missing layer: %v", err)
	}
}

package layer

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/klauspost/compress/zstd"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// tarBytes makes an uncompressed tar of entries.
func tarBytes(t testing.TB, entries ...tarEntry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := e.hdr
		h.Size = int64(len(e.body))
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
	return buf.Bytes()
}

func zstdBytes(t testing.TB, b []byte) []byte {
	var buf bytes.Buffer
	zw, err := zstd.NewWriter(&buf)
	if err != nil {
		t.Fatal(err)
	}
	zw.Write(b)
	zw.Close()
	return buf.Bytes()
}

func gzipBytes(b []byte) []byte {
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	zw.Write(b)
	zw.Close()
	return buf.Bytes()
}

// imageLayer makes an image layer (gzip-compressed blob) of entries.
func imageLayer(t testing.TB, entries ...tarEntry) v1.Layer {
	t.Helper()
	b := tarBytes(t, entries...)
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func image(t testing.TB, layers ...v1.Layer) v1.Image {
	t.Helper()
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// whiteoutImage is three layers exercising whiteouts and opaque
// directories; wantWhiteoutTree is its flattened tree.
func whiteoutImage(t testing.TB) v1.Image {
	return image(t,
		imageLayer(t,
			dir("etc/"), file("etc/a", "a1"), file("etc/b", "b1"),
			dir("data/"), file("data/old1", "x"), dir("data/sub/"), file("data/sub/old2", "x"),
			dir("keep/"), file("keep/k", "k1"),
			dir("hl/"), file("hl/orig", "o"),
			dir("dir2/"), file("dir2/x", "x"),
		),
		imageLayer(t,
			file("etc/.wh.a", ""),               // delete a file
			dir("data/"), file("data/new", "n"), // made before the opaque marker:
			dir("data/sub/"), file("data/sub/mine", "m"), // kept, lower content of sub is not
			file("data/.wh..wh..opq", ""),
			file("keep/k", "k2"),           // replace
			hardlink("hl/link", "hl/orig"), // a hard link to a lower layer's file
			file(".wh.dir2", ""),           // delete a directory
			dir("fresh/"), file("fresh/.wh..wh..opq", ""), file("fresh/f", "f"),
			file(".wh..wh.plnk", ""), // AUFS metadata: ignored
		),
		imageLayer(t,
			file("etc/a", "a3"), // back after its whiteout
			file("data/sub/again", "g"),
			file("etc/.wh.nothing", ""), // whiteout of a missing file: no-op
		),
	)
}

var wantWhiteoutTree = map[string]string{
	"etc": "d", "etc/a": "f:a3", "etc/b": "f:b1",
	"data": "d", "data/new": "f:n", "data/sub": "d", "data/sub/mine": "f:m", "data/sub/again": "f:g",
	"keep": "d", "keep/k": "f:k2",
	"hl": "d", "hl/orig": "f:o", "hl/link": "f:o",
	"fresh": "d", "fresh/f": "f:f",
}

// treeOf describes every entry under dir: "d", "f:<content>", "l:<target>"
// or "c:<major>:<minor>".
func treeOf(t testing.TB, dir string) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		fi, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			out[rel] = "d"
		case d.Type()&fs.ModeSymlink != 0:
			target, _ := os.Readlink(p)
			out[rel] = "l:" + target
		case d.Type()&fs.ModeCharDevice != 0:
			rdev := fi.Sys().(*syscall.Stat_t).Rdev
			out[rel] = fmt.Sprintf("c:%d:%d", rdev>>8, rdev&0xff)
		case !d.Type().IsRegular():
			out[rel] = d.Type().String()
		default:
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			out[rel] = "f:" + string(b)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func diffTrees(got, want map[string]string) string {
	var d []string
	for _, k := range slices.Sorted(maps.Keys(want)) {
		if got[k] != want[k] {
			d = append(d, fmt.Sprintf("%s: got %q want %q", k, got[k], want[k]))
		}
	}
	for _, k := range slices.Sorted(maps.Keys(got)) {
		if _, ok := want[k]; !ok {
			d = append(d, fmt.Sprintf("%s: unexpected %q", k, got[k]))
		}
	}
	return strings.Join(d, "\n")
}

func writeLayout(t testing.TB, dir string, imgs map[string]v1.Image) string {
	t.Helper()
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	for _, ref := range slices.Sorted(maps.Keys(imgs)) {
		if err := p.AppendImage(imgs[ref], layout.WithAnnotations(map[string]string{annotationRefName: ref})); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func writeDockerArchive(t testing.TB, path string, imgs map[string]v1.Image) string {
	t.Helper()
	refs := map[name.Reference]v1.Image{}
	for tag, img := range imgs {
		ref, err := name.NewTag(tag)
		if err != nil {
			t.Fatal(err)
		}
		refs[ref] = img
	}
	if err := tarball.MultiRefWriteToFile(path, refs); err != nil {
		t.Fatal(err)
	}
	return path
}

// tarDir makes a tar of a directory's content with the system tar.
func tarDir(t testing.TB, dir, out string) string {
	t.Helper()
	if b, err := exec.Command("tar", "-C", dir, "-cf", out, ".").CombinedOutput(); err != nil {
		t.Fatalf("tar: %v: %s", err, b)
	}
	return out
}

func TestBuildSources(t *testing.T) {
	e := newEnv(t)
	src := t.TempDir()
	wo := whiteoutImage(t)
	other := image(t, imageLayer(t, file("other", "2")))
	rootfs := tarBytes(t, dir("bin/"), file("bin/tool", "t"), symlink("bin/t", "tool"), file(".wh.notawhiteout", "plain"))
	wantRootfs := map[string]string{"bin": "d", "bin/tool": "f:t", "bin/t": "l:tool", ".wh.notawhiteout": "f:plain"}
	platformIdx := mutate.AppendManifests(empty.Index,
		mutate.IndexAddendum{Add: image(t, imageLayer(t, file("arch", "other"))), Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "s390x"}}},
		mutate.IndexAddendum{Add: image(t, imageLayer(t, file("arch", runtime.GOARCH))), Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: runtime.GOARCH}}},
	)

	tests := []struct {
		name       string
		source     func(t *testing.T) string
		image      string
		want       map[string]string
		wantSource string // prefix of Layer.Source
		wantErr    string
	}{{
		name:       "tar.zst",
		source:     func(t *testing.T) string { return writeFile(t, filepath.Join(src, "r.tar.zst"), zstdBytes(t, rootfs)) },
		want:       wantRootfs,
		wantSource: "tar.zst ",
	}, {
		name:       "zstd without extension",
		source:     func(t *testing.T) string { return writeFile(t, filepath.Join(src, "r.bin"), zstdBytes(t, rootfs)) },
		want:       wantRootfs,
		wantSource: "tar.zst ",
	}, {
		name:       "tar.gz",
		source:     func(t *testing.T) string { return writeFile(t, filepath.Join(src, "r.tgz"), gzipBytes(rootfs)) },
		want:       wantRootfs,
		wantSource: "tar.gz ",
	}, {
		name: "OCI image layout directory",
		source: func(t *testing.T) string {
			return writeLayout(t, filepath.Join(src, "oci"), map[string]v1.Image{"1": wo})
		},
		want:       wantWhiteoutTree,
		wantSource: "oci-layout ",
	}, {
		name: "OCI image layout tar",
		source: func(t *testing.T) string {
			return tarDir(t, writeLayout(t, filepath.Join(src, "oci-t"), map[string]v1.Image{"1": wo}), filepath.Join(src, "oci.tar"))
		},
		want:       wantWhiteoutTree,
		wantSource: "oci-archive " + filepath.Join(src, "oci.tar"),
	}, {
		name: "docker-archive",
		source: func(t *testing.T) string {
			return writeDockerArchive(t, filepath.Join(src, "d.tar"), map[string]v1.Image{"wo:1": wo})
		},
		want:       wantWhiteoutTree,
		wantSource: "docker-archive ",
	}, {
		name: "docker-archive gzip",
		source: func(t *testing.T) string {
			b, _ := os.ReadFile(writeDockerArchive(t, filepath.Join(src, "d2.tar"), map[string]v1.Image{"wo:1": wo}))
			return writeFile(t, filepath.Join(src, "d2.tar.gz"), gzipBytes(b))
		},
		want: wantWhiteoutTree,
	}, {
		name: "docker-archive with two images, chosen",
		source: func(t *testing.T) string {
			return writeDockerArchive(t, filepath.Join(src, "two.tar"), map[string]v1.Image{"wo:1": wo, "other:2": other})
		},
		image: "other:2",
		want:  map[string]string{"other": "f:2"},
	}, {
		name: "docker-archive with two images, none chosen",
		source: func(t *testing.T) string {
			return writeDockerArchive(t, filepath.Join(src, "two2.tar"), map[string]v1.Image{"wo:1": wo, "other:2": other})
		},
		wantErr: "choose one with --image",
	}, {
		name: "docker-archive, unknown image",
		source: func(t *testing.T) string {
			return writeDockerArchive(t, filepath.Join(src, "two3.tar"), map[string]v1.Image{"wo:1": wo})
		},
		image:   "nope:1",
		wantErr: "not found in tarball",
	}, {
		name: "OCI layout with two images, chosen by ref name",
		source: func(t *testing.T) string {
			return writeLayout(t, filepath.Join(src, "oci2"), map[string]v1.Image{"wo": wo, "other": other})
		},
		image: "other",
		want:  map[string]string{"other": "f:2"},
	}, {
		name: "OCI layout with two images, none chosen",
		source: func(t *testing.T) string {
			return writeLayout(t, filepath.Join(src, "oci3"), map[string]v1.Image{"wo": wo, "other": other})
		},
		wantErr: "choose one with --image",
	}, {
		name: "OCI layout with a multi-platform index",
		source: func(t *testing.T) string {
			p, err := layout.Write(filepath.Join(src, "multi"), empty.Index)
			if err != nil {
				t.Fatal(err)
			}
			if err := p.AppendIndex(platformIdx); err != nil {
				t.Fatal(err)
			}
			return filepath.Join(src, "multi")
		},
		want: map[string]string{"arch": "f:" + runtime.GOARCH},
	}, {
		name: "OCI layout with a corrupt layer",
		source: func(t *testing.T) string {
			d := writeLayout(t, filepath.Join(src, "bad"), map[string]v1.Image{"1": image(t, imageLayer(t, file("f", "right")))})
			l := imageLayer(t, file("f", "wrong"))
			digest, _ := l.Digest()
			good, _ := image(t, imageLayer(t, file("f", "right"))).Layers()
			gd, _ := good[0].Digest()
			rc, _ := l.Compressed()
			b, _ := io.ReadAll(rc)
			_ = digest
			os.Chmod(filepath.Join(d, "blobs/sha256", gd.Hex), 0o644)
			writeFile(t, filepath.Join(d, "blobs/sha256", gd.Hex), b)
			return d
		},
		wantErr: "sha256",
	}, {
		name: "image layer with a device node",
		source: func(t *testing.T) string {
			return writeLayout(t, filepath.Join(src, "dev"), map[string]v1.Image{"1": image(t, imageLayer(t,
				tarEntry{tar.Header{Typeflag: tar.TypeChar, Name: "etc/null", Mode: 0o666, Devmajor: 1, Devminor: 3}, ""}))})
		},
		wantErr: "device nodes and fifos are not allowed",
	}, {
		name: "image layer escaping the root",
		source: func(t *testing.T) string {
			return writeLayout(t, filepath.Join(src, "esc"), map[string]v1.Image{"1": image(t, imageLayer(t, file("../../evil", "x")))})
		},
		wantErr: "escapes the root",
	}, {
		name: "whiteout escaping the root",
		source: func(t *testing.T) string {
			return writeLayout(t, filepath.Join(src, "esc2"), map[string]v1.Image{"1": image(t,
				imageLayer(t, file("a", "x")), imageLayer(t, file(".wh..", "")))})
		},
		wantErr: "bad whiteout",
	}, {
		name: "--image on a plain directory",
		source: func(t *testing.T) string {
			return writeTree(t, filepath.Join(src, "plain"), map[string]string{"a": "1"})
		},
		image:   "x:1",
		wantErr: "plain directory, not an image",
	}, {
		name: "garbage",
		source: func(t *testing.T) string {
			return writeFile(t, filepath.Join(src, "junk.tar"), bytes.Repeat([]byte("junk"), 1000))
		},
		wantErr: "not a tar archive",
	}, {
		name: "truncated zstd",
		source: func(t *testing.T) string {
			return writeFile(t, filepath.Join(src, "cut.tar.zst"), zstdBytes(t, rootfs)[:40])
		},
		wantErr: "layer",
	}, {
		name: "image archive without manifest",
		source: func(t *testing.T) string {
			return writeFile(t, filepath.Join(src, "noman.tar"), tarBytes(t, file("index.json", "{}")))
		},
		wantErr: "neither manifest.json",
	}}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l, err := e.store.Build(context.Background(), BuildOptions{
				Kind: KindToolkit, Name: "src", Version: fmt.Sprint(i), Source: tt.source(t), Image: tt.image,
			})
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error = %v, want one containing %q", err, tt.wantErr)
				}
				if !errors.Is(err, errdefs.ErrInvalidArgument) {
					t.Errorf("error %v is not marked invalid argument", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !strings.HasPrefix(l.Source, tt.wantSource) {
				t.Errorf("Source = %q, want prefix %q", l.Source, tt.wantSource)
			}
			mnt, err := e.store.Acquire(l.Digest)
			if err != nil {
				t.Fatal(err)
			}
			defer e.store.Release(l.Digest)
			if d := diffTrees(treeOf(t, mnt), tt.want); d != "" {
				t.Errorf("tree:\n%s", d)
			}
			if l.Files != int64(len(tt.want)) {
				t.Errorf("Files = %d, want %d", l.Files, len(tt.want))
			}
			if tt.want["hl/link"] != "" {
				a, _ := os.Stat(filepath.Join(mnt, "hl/orig"))
				b, _ := os.Stat(filepath.Join(mnt, "hl/link"))
				if !os.SameFile(a, b) {
					t.Error("hl/link is not a hard link of hl/orig")
				}
			}
		})
	}
	if tmp, _ := os.ReadDir(filepath.Join(e.dir, "tmp")); len(tmp) != 0 {
		t.Errorf("builds left %d entries in tmp/", len(tmp))
	}
}

// TestFlattenMatchesExtract cross-checks the flattening against
// go-containerregistry's mutate.Extract (top-down, a different algorithm):
// the same image gives the same EROFS image, so the same digest.
func TestFlattenMatchesExtract(t *testing.T) {
	e := newEnv(t)
	src := t.TempDir()
	img := image(t,
		imageLayer(t, dir("a/"), file("a/1", "1"), dir("a/b/"), file("a/b/2", "2"), file("c", "c"), dir("d/"), file("d/x", "x")),
		imageLayer(t, dir("a/"), file("a/.wh..wh..opq", ""), file("a/new", "n"), file(".wh.c", ""), file("d/y", "y")),
		imageLayer(t, file("c", "c again"), file("d/.wh.x", ""), symlink("s", "/a/new")),
	)
	ours, err := e.store.Build(context.Background(), BuildOptions{Kind: KindBase, Name: "ours", Version: "1",
		Source: writeLayout(t, filepath.Join(src, "oci"), map[string]v1.Image{"1": img})})
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(filepath.Join(src, "extract.tar"))
	if err != nil {
		t.Fatal(err)
	}
	rc := mutate.Extract(img)
	io.Copy(f, rc)
	rc.Close()
	f.Close()
	theirs, err := e.store.Build(context.Background(), BuildOptions{Kind: KindBase, Name: "theirs", Version: "1", Source: f.Name()})
	if err != nil {
		t.Fatal(err)
	}
	if ours.Digest != theirs.Digest {
		m1, _ := e.store.Acquire(ours.Digest)
		m2, _ := e.store.Acquire(theirs.Digest)
		defer e.store.Release(ours.Digest)
		defer e.store.Release(theirs.Digest)
		t.Errorf("flattened image differs from mutate.Extract's:\n%s", diffTrees(treeOf(t, m1), treeOf(t, m2)))
	}
}

func writeFile(t testing.TB, path string, b []byte) string {
	t.Helper()
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestBuildProgress(t *testing.T) {
	e := newEnv(t)
	src := t.TempDir()
	big := bytes.Repeat([]byte("0123456789abcdef"), 1<<20) // 16 MiB
	tarball := writeFile(t, filepath.Join(src, "big.tar.zst"), zstdBytes(t, tarBytes(t, file("big", string(big)), file("small", "s"))))
	var reports []Progress
	_, err := e.store.Build(context.Background(), BuildOptions{Kind: KindBase, Name: "p", Version: "1", Source: tarball,
		Progress: func(p Progress) { reports = append(reports, p) }})
	if err != nil {
		t.Fatal(err)
	}
	var stages []string
	last := map[string]Progress{}
	for _, p := range reports {
		if p.Message != "" && (len(stages) == 0 || stages[len(stages)-1] != p.Stage) {
			stages = append(stages, p.Stage)
		}
		if p.Message == "" {
			if p.Total > 0 && p.Done > p.Total {
				t.Errorf("%s: done %d > total %d", p.Stage, p.Done, p.Total)
			}
			last[p.Stage] = p
		}
	}
	if want := []string{StageExtract, StageScan, StageMkfs, StageHash, StageDone}; !slices.Equal(stages, want) {
		t.Errorf("stages %v, want %v", stages, want)
	}
	for _, st := range []string{StageExtract, StageMkfs, StageHash} {
		if p := last[st]; p.Total == 0 || p.Done != p.Total || p.Unit != "bytes" {
			t.Errorf("stage %s ended at %+v, want done == total in bytes", st, p)
		}
	}
	if p := last[StageMkfs]; p.Total != int64(len(big))+1 {
		t.Errorf("mkfs total %d, want the tree's %d bytes", p.Total, len(big)+1)
	}
}

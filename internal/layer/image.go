package layer

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"runtime"
	"slices"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// OCI and containerd annotations that name an image in an index.
const (
	annotationRefName        = "org.opencontainers.image.ref.name"
	annotationContainerdName = "io.containerd.image.name"
)

// openDockerArchive opens the image of a `docker save` tarball. selector
// chooses among several images by tag ("debian:12"); it may be empty when
// the archive holds one image.
func openDockerArchive(path, selector string) (v1.Image, string, error) {
	opener := func() (io.ReadCloser, error) { return openPlain(path) }
	m, err := tarball.LoadManifest(opener)
	if err != nil {
		return nil, "", fmt.Errorf("read manifest.json: %w", err)
	}
	if len(m) == 0 {
		return nil, "", errors.New("manifest.json lists no image")
	}
	var tags []string
	for _, d := range m {
		tags = append(tags, d.RepoTags...)
	}
	if selector == "" {
		if len(m) > 1 {
			return nil, "", fmt.Errorf("the archive holds %d images (%s): choose one with --image", len(m), strings.Join(tags, ", "))
		}
		img, err := tarball.Image(opener, nil)
		desc := ""
		if len(tags) > 0 {
			desc = tags[0]
		}
		return img, desc, err
	}
	tag, err := name.NewTag(selector)
	if err != nil {
		return nil, "", fmt.Errorf("--image %q: %w", selector, err)
	}
	img, err := tarball.Image(opener, &tag)
	if err != nil {
		return nil, "", fmt.Errorf("image %s: %w (the archive has: %s)", selector, err, strings.Join(tags, ", "))
	}
	return img, selector, nil
}

// openPlain opens a file as an uncompressed stream (for the tarball package,
// which reads the archive again for each file it needs).
func openPlain(path string) (io.ReadCloser, error) {
	t, err := openTar(path, nil)
	if err != nil {
		return nil, err
	}
	return struct {
		io.Reader
		io.Closer
	}{t.r, closerFunc(t.Close)}, nil
}

type closerFunc func()

func (f closerFunc) Close() error { f(); return nil }

// openLayout opens an image of the OCI image layout in dir. selector chooses
// among several images by their "org.opencontainers.image.ref.name" or
// "io.containerd.image.name" annotation (or a tag that parses to the same
// name); an index of several platforms is narrowed to linux/GOARCH.
func openLayout(dir, selector string) (v1.Image, string, error) {
	idx, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		return nil, "", fmt.Errorf("read OCI image layout: %w", err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		return nil, "", fmt.Errorf("read index.json: %w", err)
	}
	if len(im.Manifests) == 0 {
		return nil, "", errors.New("index.json lists no image")
	}
	names := func(d v1.Descriptor) []string {
		var out []string
		for _, a := range []string{annotationRefName, annotationContainerdName} {
			if v := d.Annotations[a]; v != "" {
				out = append(out, v)
			}
		}
		return out
	}
	var all []string
	for _, d := range im.Manifests {
		all = append(all, names(d)...)
	}
	var chosen *v1.Descriptor
	switch {
	case selector != "":
		want := normalizeImageName(selector)
		for i, d := range im.Manifests {
			for _, n := range names(d) {
				if n == selector || (want != "" && normalizeImageName(n) == want) {
					chosen = &im.Manifests[i]
				}
			}
		}
		if chosen == nil {
			return nil, "", fmt.Errorf("no image %q in the layout (it has: %s)", selector, strings.Join(all, ", "))
		}
	case len(im.Manifests) == 1:
		chosen = &im.Manifests[0]
	default:
		// Several entries: either the platforms of one image, or several
		// images (which need a selector).
		named := slices.DeleteFunc(slices.Clone(all), func(s string) bool { return s == "" })
		if len(slices.Compact(slices.Sorted(slices.Values(named)))) > 1 {
			return nil, "", fmt.Errorf("the layout holds several images (%s): choose one with --image", strings.Join(all, ", "))
		}
		img, err := pickPlatform(idx)
		return img, firstOr(all, ""), err
	}
	desc := firstOr(names(*chosen), selector)
	if chosen.MediaType.IsIndex() {
		sub, err := idx.ImageIndex(chosen.Digest)
		if err != nil {
			return nil, "", err
		}
		img, err := pickPlatform(sub)
		return img, desc, err
	}
	img, err := idx.Image(chosen.Digest)
	return img, desc, err
}

// pickPlatform returns the image of an index for linux on this machine's
// architecture (looking into nested indexes).
func pickPlatform(idx v1.ImageIndex) (v1.Image, error) {
	im, err := idx.IndexManifest()
	if err != nil {
		return nil, err
	}
	want := v1.Platform{OS: "linux", Architecture: runtime.GOARCH}
	var seen []string
	for _, d := range im.Manifests {
		if d.MediaType.IsIndex() {
			sub, err := idx.ImageIndex(d.Digest)
			if err != nil {
				return nil, err
			}
			if img, err := pickPlatform(sub); err == nil {
				return img, nil
			}
			continue
		}
		if d.Platform == nil {
			if len(im.Manifests) == 1 {
				return idx.Image(d.Digest)
			}
			continue
		}
		seen = append(seen, d.Platform.String())
		if d.Platform.OS == want.OS && d.Platform.Architecture == want.Architecture {
			return idx.Image(d.Digest)
		}
	}
	return nil, fmt.Errorf("no image for %s in the index (it has: %s)", want.String(), strings.Join(seen, ", "))
}

func normalizeImageName(s string) string {
	ref, err := name.ParseReference(s)
	if err != nil {
		return ""
	}
	return ref.Name()
}

func firstOr(ss []string, def string) string {
	if len(ss) > 0 {
		return ss[0]
	}
	return def
}

// flattenImage applies the layers of img, bottom first, to a new tree at
// dst: later layers' files replace earlier ones and their whiteouts delete
// them (".wh.NAME" a path, ".wh..wh..opq" a directory's earlier content).
// Each layer's uncompressed content is checked against its diff ID from the
// image config. The same rules as for root file system tarballs apply (no
// device nodes but under /dev, left out; no fifos, no writes through
// symlinks).
func flattenImage(ctx context.Context, img v1.Image, dst string, rep *reporter) error {
	layers, err := img.Layers()
	if err != nil {
		return fmt.Errorf("read image layers: %w", err)
	}
	// The diff IDs of the config, not the layers' own DiffID (which may be
	// computed from the very content it is meant to check).
	cf, err := img.ConfigFile()
	if err != nil {
		return fmt.Errorf("read image config: %w", err)
	}
	if n := len(cf.RootFS.DiffIDs); n != len(layers) {
		return fmt.Errorf("the image has %d layers and its config %d diff IDs: the image is corrupt", len(layers), n)
	}
	x, err := newExtractor(dst, true)
	if err != nil {
		return err
	}
	defer x.close()
	x.rootfs = true
	for i, l := range layers {
		rep.update(int64(i), int64(len(layers)))
		if err := applyImageLayer(ctx, x, l, cf.RootFS.DiffIDs[i]); err != nil {
			return fmt.Errorf("image layer %d of %d: %w", i+1, len(layers), err)
		}
	}
	rep.update(int64(len(layers)), int64(len(layers)))
	if err := x.finishDirs(); err != nil {
		return err
	}
	noteDevLeftOut(rep, x.devLeftOut, x.devLeft)
	return nil
}

func applyImageLayer(ctx context.Context, x *extractor, l v1.Layer, diffID v1.Hash) error {
	if diffID.Algorithm != "sha256" {
		return fmt.Errorf("diff ID %s: only sha256 is supported", diffID)
	}
	rc, err := l.Uncompressed()
	if err != nil {
		return err
	}
	defer rc.Close()
	h := sha256.New()
	r := io.TeeReader(rc, h)
	if err := x.apply(ctx, r); err != nil {
		return err
	}
	if _, err := io.Copy(io.Discard, r); err != nil { // the tar's padding
		return err
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != diffID.Hex {
		return fmt.Errorf("content is sha256:%s, the image config says %s: the image is corrupt", got, diffID)
	}
	return nil
}

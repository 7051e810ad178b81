package bench

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"time"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// LayersOptions configure the layer benchmark. Trees are written under
// WorkDir and uploaded to the server (as `shoal layer build` does), so the
// build times include tarring and sending them.
type LayersOptions struct {
	N        int // combinations (one workspace each) that use the upgraded toolkit
	Bases    int // m
	Toolkits int // k
	// BaseTree is a root file system for the bases (e.g. a debootstrap
	// tree); empty: a synthetic tree of BaseMiB.
	BaseTree     string
	BaseMiB      int
	ToolkitMiB   int
	WorkspaceMiB int
	// MonolithicSample is how many of the N monolithic images are really
	// built; the rest is extrapolated from their mean. 0 or >= N: all N.
	MonolithicSample int
	Compression      string // of every image: none, lz4, lz4hc
	WorkDir          string // "" = a temporary directory
	Keep             bool   // keep the layers built (default: removed, then gc)
	Progress         func(format string, args ...any)
}

// LayersResult is the JSON printed by `shoal bench layers`.
type LayersResult struct {
	Bench       string `json:"bench"`
	N           int    `json:"n"`
	Bases       int    `json:"bases"`
	Toolkits    int    `json:"toolkits"`
	Compression string `json:"compression"`
	CPUs        int    `json:"cpus"`
	Trees       struct {
		Base      TreeSize `json:"base"`
		Toolkit   TreeSize `json:"toolkit"`
		Workspace TreeSize `json:"workspace"`
	} `json:"trees"`
	Setup struct {
		LayersBuilt int     `json:"layers_built"`
		Seconds     float64 `json:"seconds"`
		Bytes       int64   `json:"bytes"`
	} `json:"setup"`
	// Upgrade of one toolkit used by all N combinations.
	Layered struct {
		ImagesBuilt int     `json:"images_built"`
		Seconds     float64 `json:"seconds"`
		Bytes       int64   `json:"bytes"`
		// A sandbox of one of the combinations, created after the upgrade,
		// runs on the new toolkit: create and first exec.
		FirstSandboxMs float64 `json:"first_sandbox_on_new_version_ms"`
	} `json:"layered_upgrade"`
	Monolithic struct {
		ImagesToBuild int `json:"images_to_build"`
		Sampled       int `json:"images_built_in_sample"`
		// Per image: copying base + workspace + toolkits into one tree,
		// then building its EROFS image.
		AssembleSecondsPerImage float64 `json:"assemble_seconds_per_image"`
		BuildSecondsPerImage    float64 `json:"build_seconds_per_image"`
		BytesPerImage           int64   `json:"bytes_per_image"`
		Seconds                 float64 `json:"seconds"` // N x (assemble + build)
		Bytes                   int64   `json:"bytes"`   // N x image
		Extrapolated            bool    `json:"extrapolated"`
	} `json:"monolithic_rebuild"`
	SpeedupTime  float64 `json:"monolithic_over_layered_time"`
	SpeedupBytes float64 `json:"monolithic_over_layered_bytes"`
	// EROFS builds against `tar czf` of the same trees.
	BuildVsTar []BuildVsTar `json:"build_vs_tar_czf"`
}

// TreeSize describes a source tree.
type TreeSize struct {
	Files int   `json:"files"`
	Bytes int64 `json:"bytes"`
}

// BuildVsTar compares building an image of a tree with archiving it.
type BuildVsTar struct {
	Tree        string  `json:"tree"`
	Files       int     `json:"files"`
	TreeBytes   int64   `json:"tree_bytes"`
	ErofsSec    float64 `json:"erofs_none_seconds"`
	ErofsBytes  int64   `json:"erofs_none_bytes"`
	Lz4hcSec    float64 `json:"erofs_lz4hc_seconds"`
	Lz4hcBytes  int64   `json:"erofs_lz4hc_bytes"`
	TarCzfSec   float64 `json:"tar_czf_seconds"`
	TarCzfBytes int64   `json:"tar_czf_bytes"`
}

// Layers measures what it costs to serve an upgrade of one toolkit to N
// combinations (base + workspace + toolkits): with layers, one toolkit image
// is rebuilt; with monolithic images, N images are. It also compares image
// builds with `tar czf` of the same trees.
func Layers(ctx context.Context, c *shoal.Client, o LayersOptions) (*LayersResult, error) {
	if o.N <= 0 || o.Bases <= 0 || o.Toolkits <= 0 {
		return nil, errors.New("-n, --bases and --toolkits must be positive")
	}
	if o.MonolithicSample <= 0 || o.MonolithicSample > o.N {
		o.MonolithicSample = o.N
	}
	if o.Compression == "" {
		o.Compression = "none"
	}
	logf := o.Progress
	if logf == nil {
		logf = func(string, ...any) {}
	}
	res := &LayersResult{Bench: "layers", N: o.N, Bases: o.Bases, Toolkits: o.Toolkits, Compression: o.Compression, CPUs: runtime.NumCPU()}
	work := o.WorkDir
	if work == "" {
		var err error
		if work, err = os.MkdirTemp("/var/tmp", "shoal-bench-layers-"); err != nil {
			return nil, err
		}
		defer os.RemoveAll(work)
	}
	b := &layerBench{c: c, o: o, work: work, logf: logf}
	defer b.cleanup()

	// Trees.
	baseTree := o.BaseTree
	if baseTree == "" {
		baseTree = filepath.Join(work, "base")
		if err := synthTree(baseTree, "base", o.BaseMiB, 1); err != nil {
			return nil, err
		}
	}
	var err error
	if res.Trees.Base, err = sizeOf(baseTree); err != nil {
		return nil, err
	}
	toolkits := make([]string, o.Toolkits)
	for i := range toolkits {
		toolkits[i] = filepath.Join(work, fmt.Sprint("toolkit", i))
		if err := synthTree(toolkits[i], fmt.Sprint("toolkit", i), o.ToolkitMiB, uint64(100+i)); err != nil {
			return nil, err
		}
	}
	res.Trees.Toolkit, _ = sizeOf(toolkits[0])
	workspaces := make([]string, o.N)
	for i := range workspaces {
		workspaces[i] = filepath.Join(work, fmt.Sprint("ws", i))
		if err := synthTree(workspaces[i], fmt.Sprint("workspace", i), o.WorkspaceMiB, uint64(1000+i)); err != nil {
			return nil, err
		}
	}
	res.Trees.Workspace, _ = sizeOf(workspaces[0])

	// Set-up: m bases (one image, m tags), k toolkits, N workspaces.
	logf("setup: building 1 base (%d tags), %d toolkits, %d workspaces", o.Bases, o.Toolkits, o.N)
	t0 := time.Now()
	base, err := b.build(ctx, pb.LayerKind_LAYER_KIND_BASE, "bench-base0:1", baseTree, o.Compression)
	if err != nil {
		return nil, err
	}
	res.Setup.Bytes += base.Size
	for i := 1; i < o.Bases; i++ {
		if err := b.tag("bench-base0:1", fmt.Sprintf("bench-base%d:1", i)); err != nil {
			return nil, err
		}
	}
	for i, t := range toolkits {
		l, err := b.build(ctx, pb.LayerKind_LAYER_KIND_TOOLKIT, fmt.Sprintf("bench-tk%d:1", i), t, o.Compression)
		if err != nil {
			return nil, err
		}
		res.Setup.Bytes += l.Size
	}
	for i, w := range workspaces {
		l, err := b.build(ctx, pb.LayerKind_LAYER_KIND_WORKSPACE, fmt.Sprintf("bench-ws%d:1", i), w, o.Compression)
		if err != nil {
			return nil, err
		}
		res.Setup.Bytes += l.Size
	}
	res.Setup.Seconds = secsOf(time.Since(t0))
	res.Setup.LayersBuilt = 1 + o.Toolkits + o.N
	// Combination i: base i%m, workspace i, toolkit 0 (the one upgraded)
	// and, with k > 1, toolkit 1 + i%(k-1).
	combo := func(i int) []string {
		tks := []string{toolkits[0]}
		if o.Toolkits > 1 {
			tks = append(tks, toolkits[1+i%(o.Toolkits-1)])
		}
		return append([]string{baseTree, workspaces[i]}, tks...)
	}

	// The upgrade: a new version of toolkit 0.
	if err := upgradeTree(toolkits[0]); err != nil {
		return nil, err
	}
	logf("layered upgrade: rebuilding toolkit 0")
	t0 = time.Now()
	up, err := b.build(ctx, pb.LayerKind_LAYER_KIND_TOOLKIT, "bench-tk0:1", toolkits[0], o.Compression)
	if err != nil {
		return nil, err
	}
	res.Layered.Seconds = secsOf(time.Since(t0))
	res.Layered.Bytes = up.Size
	res.Layered.ImagesBuilt = 1
	if ms, err := b.firstSandbox(ctx, o, up.Digest); err != nil {
		logf("first sandbox on the new version: %v (left out)", err)
	} else {
		res.Layered.FirstSandboxMs = ms
	}

	// Monolithic: each combination flattened into one tree and built.
	logf("monolithic rebuild: %d of %d images", o.MonolithicSample, o.N)
	var assemble, build time.Duration
	var bytes int64
	for s := range o.MonolithicSample {
		i := s * o.N / o.MonolithicSample // spread over the combinations
		dir := filepath.Join(work, "mono")
		os.RemoveAll(dir)
		t0 := time.Now()
		if err := mergeTrees(ctx, dir, combo(i)); err != nil {
			return nil, err
		}
		t1 := time.Now()
		l, err := b.build(ctx, pb.LayerKind_LAYER_KIND_BASE, fmt.Sprintf("bench-mono%d:1", i), dir, o.Compression)
		if err != nil {
			return nil, err
		}
		assemble += t1.Sub(t0)
		build += time.Since(t1)
		bytes += l.Size
		os.RemoveAll(dir)
		if !o.Keep { // one at a time: N monolithic images may not fit
			b.remove(fmt.Sprintf("bench-mono%d:1", i))
		}
	}
	m := &res.Monolithic
	n := float64(o.MonolithicSample)
	m.ImagesToBuild, m.Sampled, m.Extrapolated = o.N, o.MonolithicSample, o.MonolithicSample < o.N
	m.AssembleSecondsPerImage = roundMilli(assemble.Seconds() / n)
	m.BuildSecondsPerImage = roundMilli(build.Seconds() / n)
	m.BytesPerImage = int64(float64(bytes) / n)
	m.Seconds = roundMilli((assemble + build).Seconds() / n * float64(o.N))
	m.Bytes = m.BytesPerImage * int64(o.N)
	if res.Layered.Seconds > 0 {
		res.SpeedupTime = roundTenth(m.Seconds / res.Layered.Seconds)
	}
	if res.Layered.Bytes > 0 {
		res.SpeedupBytes = roundTenth(float64(m.Bytes) / float64(res.Layered.Bytes))
	}

	// Image builds against tar czf.
	for _, tr := range []struct{ name, dir string }{{"base", baseTree}, {"toolkit", toolkits[0]}} {
		logf("build vs tar czf: %s", tr.name)
		r, err := b.buildVsTar(ctx, tr.name, tr.dir)
		if err != nil {
			return nil, err
		}
		res.BuildVsTar = append(res.BuildVsTar, r)
	}
	return res, nil
}

type layerBench struct {
	c     *shoal.Client
	o     LayersOptions
	work  string
	logf  func(string, ...any)
	built []string // tags to remove at the end
}

func (b *layerBench) build(ctx context.Context, kind pb.LayerKind, ref, src, compression string) (*pb.Layer, error) {
	l, err := b.c.BuildLayerFrom(ctx, &pb.BuildLayerRequest{Kind: kind, Ref: ref, Compression: compression}, src, nil)
	if err != nil {
		return nil, fmt.Errorf("build %s: %w", ref, err)
	}
	b.built = append(b.built, ref)
	return l, nil
}

func (b *layerBench) tag(src, dst string) error {
	_, err := b.c.Layers.TagLayer(context.Background(), connect.NewRequest(&pb.TagLayerRequest{Source: src, Target: dst}))
	if err == nil {
		b.built = append(b.built, dst)
	}
	return err
}

func (b *layerBench) remove(ref string) {
	b.c.Layers.DeleteLayer(context.Background(), connect.NewRequest(&pb.DeleteLayerRequest{Ref: ref}))
}

// cleanup removes the benchmark's tags and collects their images.
func (b *layerBench) cleanup() {
	if b.o.Keep {
		return
	}
	for _, ref := range b.built {
		b.remove(ref)
	}
	b.c.Layers.GarbageCollectLayers(context.Background(), connect.NewRequest(&pb.GarbageCollectLayersRequest{}))
}

// firstSandbox creates a sandbox of combination 0 after the upgrade, checks
// it runs on the new toolkit and returns create + first exec in ms. The
// synthetic base has no shell: this needs a real root file system.
func (b *layerBench) firstSandbox(ctx context.Context, o LayersOptions, digest string) (float64, error) {
	if o.BaseTree == "" {
		return 0, errors.New("needs --base-tree (the synthetic base cannot run commands)")
	}
	tks := []string{"bench-tk0:1"}
	if o.Toolkits > 1 {
		tks = append(tks, "bench-tk1:1")
	}
	t0 := time.Now()
	sb, err := b.c.Create(ctx, &pb.CreateSandboxRequest{Base: "bench-base0:1", Workspaces: []string{"bench-ws0:1"}, Toolkits: tks, TimeoutSeconds: 300})
	if err != nil {
		return 0, err
	}
	defer b.c.Delete(context.Background(), sb.Id)
	st, err := b.c.Exec(ctx, sb.Id, shoal.ExecOptions{Args: []string{"test", "-e", "/opt/toolkit0/VERSION-2"}})
	d := time.Since(t0)
	if err != nil {
		return 0, err
	}
	if st.Code != 0 || sb.Layers[0].Digest != digest {
		return 0, fmt.Errorf("the new sandbox does not run on the new toolkit (exit %d, layer %s)", st.Code, sb.Layers[0].Digest)
	}
	return roundMilli(float64(d.Microseconds()) / 1000), nil
}

func (b *layerBench) buildVsTar(ctx context.Context, name, dir string) (BuildVsTar, error) {
	r := BuildVsTar{Tree: name}
	ts, err := sizeOf(dir)
	if err != nil {
		return r, err
	}
	r.Files, r.TreeBytes = ts.Files, ts.Bytes
	for _, c := range []string{"none", "lz4hc"} {
		ref := fmt.Sprintf("bench-cmp-%s-%s:1", name, c)
		t0 := time.Now()
		l, err := b.build(ctx, pb.LayerKind_LAYER_KIND_BASE, ref, dir, c)
		if err != nil {
			return r, err
		}
		d := secsOf(time.Since(t0))
		if c == "none" {
			r.ErofsSec, r.ErofsBytes = d, l.Size
		} else {
			r.Lz4hcSec, r.Lz4hcBytes = d, l.Size
		}
		if !b.o.Keep {
			b.remove(ref)
		}
	}
	out := filepath.Join(b.work, name+".tar.gz")
	t0 := time.Now()
	if msg, err := exec.CommandContext(ctx, "tar", "czf", out, "-C", dir, ".").CombinedOutput(); err != nil {
		return r, fmt.Errorf("tar czf: %v: %s", err, msg)
	}
	r.TarCzfSec = secsOf(time.Since(t0))
	fi, err := os.Stat(out)
	if err != nil {
		return r, err
	}
	r.TarCzfBytes = fi.Size()
	os.Remove(out)
	return r, nil
}

// synthTree writes a tree of about mib MiB under dir: a few directories of
// source-like text files (compressible) and some binary-like files (half
// random), deterministic for a seed.
func synthTree(dir, label string, mib int, seed uint64) error {
	rng := rand.New(rand.NewPCG(seed, 42))
	total := int64(mib) << 20
	prefix := map[string]string{"base": "usr/lib", "toolkit": "opt"}[trimDigits(label)]
	if prefix == "" {
		prefix = "work/repo"
	}
	root := filepath.Join(dir, prefix, label)
	var written int64
	for i := 0; written < total || i == 0; i++ {
		size := int64(512 + rng.IntN(32<<10))
		if i%20 == 0 {
			size = int64(256<<10 + rng.IntN(512<<10)) // a "binary"
		}
		size = min(size, max(total-written, 64))
		b := make([]byte, size)
		if i%20 == 0 {
			for j := range b[:len(b)/2] {
				b[j] = byte(rng.Uint32())
			}
			copy(b[len(b)/2:], b[:len(b)/2]) // compressible half
		} else {
			words := []string{"func ", "return ", "if err != nil {\n", "}\n", "\tx := ", label, " // comment\n", "import \"fmt\"\n"}
			for j := 0; j < len(b); {
				j += copy(b[j:], words[rng.IntN(len(words))])
			}
		}
		p := filepath.Join(root, fmt.Sprintf("d%02d", i%16), fmt.Sprintf("f%05d", i))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(p, b, 0o644); err != nil {
			return err
		}
		written += size
	}
	return os.WriteFile(filepath.Join(root, "VERSION-1"), []byte("1\n"), 0o644)
}

func trimDigits(s string) string {
	for len(s) > 0 && s[len(s)-1] >= '0' && s[len(s)-1] <= '9' {
		s = s[:len(s)-1]
	}
	return s
}

// upgradeTree makes "version 2" of a synthetic toolkit: a marker file and
// every tenth file changed.
func upgradeTree(dir string) error {
	n := 0
	var marker string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		if filepath.Base(p) == "VERSION-1" {
			marker = p
			return nil
		}
		if n++; n%10 == 0 {
			f, err := os.OpenFile(p, os.O_APPEND|os.O_WRONLY, 0)
			if err != nil {
				return err
			}
			defer f.Close()
			_, err = f.WriteString("// version 2\n")
			return err
		}
		return nil
	})
	if err != nil {
		return err
	}
	if marker == "" {
		return fmt.Errorf("%s is not a synthetic toolkit", dir)
	}
	if err := os.Rename(marker, filepath.Join(filepath.Dir(marker), "VERSION-2")); err != nil {
		return err
	}
	// The sandbox test looks for /opt/toolkit0/VERSION-2.
	return nil
}

// mergeTrees copies trees into dst, later ones over earlier ones (what a
// monolithic image build does).
func mergeTrees(ctx context.Context, dst string, trees []string) error {
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return err
	}
	for _, t := range trees {
		if out, err := exec.CommandContext(ctx, "cp", "-a", "--reflink=auto", t+"/.", dst+"/").CombinedOutput(); err != nil {
			return fmt.Errorf("cp -a %s: %v: %s", t, err, out)
		}
	}
	return nil
}

func sizeOf(dir string) (TreeSize, error) {
	var ts TreeSize
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		ts.Files++
		if d.Type().IsRegular() {
			fi, err := d.Info()
			if err != nil {
				return err
			}
			ts.Bytes += fi.Size()
		}
		return nil
	})
	return ts, err
}

func secsOf(d time.Duration) float64 { return roundMilli(d.Seconds()) }
func roundMilli(f float64) float64   { return math.Round(f*1000) / 1000 }
func roundTenth(f float64) float64   { return math.Round(f*10) / 10 }

package bench

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// ImagesOptions configure `shoal bench images`.
type ImagesOptions struct {
	N       int // images
	Sample  int // images also imported flattened (the rest extrapolated)
	BaseMiB int // the shared base layer (busybox plus this much data)
	EnvMiB  int // the shared environment layer
	TopMiB  int // each image's own top layer
	Keep    bool
	// Listen: where the bench's registry listens; it must be reachable
	// from the server (default 127.0.0.1:0: a server on this machine).
	Listen   string
	Progress func(format string, args ...any)
}

// ImagesResult is the JSON `shoal bench images` prints.
type ImagesResult struct {
	Bench   string `json:"bench"`
	N       int    `json:"n"`
	Sample  int    `json:"flattened_sample"`
	BaseMiB int    `json:"base_mib"`
	EnvMiB  int    `json:"env_mib"`
	TopMiB  int    `json:"top_mib"`
	// Shoal: each image pulled with its layers kept (shared ones fetched
	// and stored once).
	ShoalFetchedBytes int64 `json:"shoal_fetched_bytes"`
	ShoalStoredBytes  int64 `json:"shoal_stored_bytes"`
	// Flattened: the sample imported as one flattened layer each (the
	// whole image fetched and stored each time), extrapolated to N.
	FlatFetchedBytes int64   `json:"flattened_fetched_bytes_extrapolated"`
	FlatStoredBytes  int64   `json:"flattened_stored_bytes_extrapolated"`
	RatioFetched     float64 `json:"ratio_fetched_flattened_vs_shoal"`
	RatioStored      float64 `json:"ratio_stored_flattened_vs_shoal"`
	// Never seen to first exec: pull + create + `true`.
	FirstImageMs  float64 `json:"first_image_to_first_exec_ms"`
	OtherImagesMs Dist    `json:"other_images_to_first_exec"`
	FlatImageMs   Dist    `json:"flattened_import_to_first_exec"`
	// A pulled image pulled again.
	RepullMs      Dist  `json:"repull"`
	RepullFetched int64 `json:"repull_fetched_bytes"`
	// Pulling an image of one fresh layer of EnvMiB (resolve, fetch over
	// loopback, gunzip, extract, mkfs.erofs, hash, sync) against `tar
	// -xzf` of the same blob into a tmpfs: medians of 3.
	ConvertMs     float64 `json:"convert_layer_p50_ms"`
	TarXzfMs      float64 `json:"tar_xzf_tmpfs_p50_ms"`
	ConvertVsTar  float64 `json:"ratio_tar_xzf_vs_convert_speed"`
	RegistryBytes int64   `json:"registry_bytes_served"`
}

// countingRegistry is go-containerregistry's registry, counting the bytes
// of the blobs it serves.
type countingRegistry struct {
	h     http.Handler
	bytes atomic.Int64
}

type countingWriter struct {
	http.ResponseWriter
	n *atomic.Int64
}

func (w countingWriter) Write(b []byte) (int, error) {
	n, err := w.ResponseWriter.Write(b)
	w.n.Add(int64(n))
	return n, err
}

func (r *countingRegistry) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	if req.Method == http.MethodGet && strings.Contains(req.URL.Path, "/blobs/") {
		w = countingWriter{w, &r.bytes}
	}
	r.h.ServeHTTP(w, req)
}

// Images pushes N images that share a base and an environment layer and
// differ in a top layer (as SWE-bench's do) to a registry of its own, then
// pulls each through the server and runs its first command; a sample is
// also imported flattened, as a single layer each, for comparison.
func Images(ctx context.Context, c *shoal.Client, o ImagesOptions) (*ImagesResult, error) {
	if o.N <= 0 || o.BaseMiB < 0 || o.EnvMiB <= 0 || o.TopMiB <= 0 {
		return nil, errors.New("-n, --env-mib and --top-mib must be positive")
	}
	if o.Sample <= 0 || o.Sample > o.N {
		o.Sample = min(o.N, 5)
	}
	if o.Listen == "" {
		o.Listen = "127.0.0.1:0"
	}
	logf := o.Progress
	if logf == nil {
		logf = func(string, ...any) {}
	}
	bb, err := exec.LookPath("busybox")
	if err != nil {
		return nil, errors.New("needs busybox (a static one: busybox-static) for the images' base")
	}
	res := &ImagesResult{Bench: "images", N: o.N, Sample: o.Sample, BaseMiB: o.BaseMiB, EnvMiB: o.EnvMiB, TopMiB: o.TopMiB}

	reg := &countingRegistry{h: registry.New(registry.Logger(log.New(io.Discard, "", 0)))}
	ln, err := net.Listen("tcp", o.Listen)
	if err != nil {
		return nil, err
	}
	srv := &http.Server{Handler: reg}
	go srv.Serve(ln)
	defer srv.Close()
	host := ln.Addr().String()

	// The layers: a nonce in every file, so no layer of an earlier run is
	// found on the server.
	nonce := rand.Uint64()
	rng := rand.New(rand.NewPCG(nonce, 39))
	logf("making the layers (%d MiB base, %d MiB environment, %d × %d MiB tops)", o.BaseMiB, o.EnvMiB, o.N, o.TopMiB)
	base, err := baseLayer(bb, o.BaseMiB, rng, nonce)
	if err != nil {
		return nil, err
	}
	envTar := randomTar("opt/env", o.EnvMiB, rng, nonce)
	env, err := layerOf(envTar)
	if err != nil {
		return nil, err
	}
	cfg := v1.Config{Env: []string{"PATH=/opt/env:/bin"}, WorkingDir: "/testbed"}
	var refs []string
	for i := range o.N {
		top, err := layerOf(randomTar("testbed", o.TopMiB, rng, nonce+uint64(i)+1))
		if err != nil {
			return nil, err
		}
		img, err := mutate.AppendLayers(empty.Image, base, env, top)
		if err != nil {
			return nil, err
		}
		cf, _ := img.ConfigFile()
		cf = cf.DeepCopy()
		cf.OS, cf.Architecture, cf.Config = "linux", runtime.GOARCH, cfg
		if img, err = mutate.ConfigFile(img, cf); err != nil {
			return nil, err
		}
		ref := fmt.Sprintf("%s/bench-%x/task-%d:latest", host, nonce&0xffffff, i)
		r, _ := name.ParseReference(ref)
		if err := remote.Write(r, img, remote.WithContext(ctx)); err != nil {
			return nil, fmt.Errorf("push %s: %w", ref, err)
		}
		refs = append(refs, ref)
	}
	reg.bytes.Store(0)

	var tags []string
	defer func() {
		if o.Keep {
			return
		}
		for _, t := range tags {
			c.Layers.DeleteLayer(context.Background(), connect.NewRequest(&pb.DeleteLayerRequest{Ref: t}))
		}
	}()
	firstExec := func(req *pb.CreateSandboxRequest) error {
		req.TimeoutSeconds = 300
		sb, err := c.Create(ctx, req)
		if err != nil {
			return err
		}
		defer c.Delete(context.Background(), sb.Id)
		st, err := c.Exec(ctx, sb.Id, shoal.ExecOptions{Args: []string{"true"}})
		if err != nil {
			return err
		}
		if st.Code != 0 {
			return fmt.Errorf("true exited %d", st.Code)
		}
		return nil
	}

	// Shoal: pull each image (layers kept), create, first exec.
	var others []time.Duration
	seen := map[string]bool{}
	for i, ref := range refs {
		logf("image %d/%d: pull, create, exec", i+1, o.N)
		var marks []progressMark
		t0 := time.Now()
		im, err := c.PullImage(ctx, &pb.PullImageRequest{Image: ref}, func(line string, _ *pb.BuildProgress) {
			if line != "" {
				marks = append(marks, progressMark{time.Now(), line})
			}
		})
		if err != nil {
			return nil, err
		}
		if err := firstExec(&pb.CreateSandboxRequest{Base: ref}); err != nil {
			return nil, fmt.Errorf("image %s: %w", ref, err)
		}
		d := time.Since(t0)
		if i == 0 {
			res.FirstImageMs = ms(d)
			for j, m := range marks {
				if j > 0 {
					logf("  +%6.1f ms  %s", ms(m.at.Sub(marks[j-1].at)), marks[j-1].line)
				}
			}
		} else {
			others = append(others, d)
		}
		for _, t := range im.Layers {
			if !seen[t] {
				seen[t] = true
				tags = append(tags, t)
				l, err := c.Layers.GetLayer(ctx, connect.NewRequest(&pb.GetLayerRequest{Ref: t}))
				if err != nil {
					return nil, err
				}
				res.ShoalStoredBytes += l.Msg.Size
			}
		}
	}
	res.ShoalFetchedBytes = reg.bytes.Load()
	res.OtherImagesMs = dist(others)

	// Pulled again: nothing fetched.
	var repulls []time.Duration
	before := reg.bytes.Load()
	for i := range min(o.N, 20) {
		t0 := time.Now()
		if _, err := c.PullImage(ctx, &pb.PullImageRequest{Image: refs[i]}, nil); err != nil {
			return nil, err
		}
		repulls = append(repulls, time.Since(t0))
	}
	res.RepullMs, res.RepullFetched = dist(repulls), reg.bytes.Load()-before

	// Flattened: fetch the whole image, import it as one layer, first exec.
	work, err := os.MkdirTemp("/var/tmp", "shoal-bench-images-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(work)
	var flat []time.Duration
	var flatFetched, flatStored int64
	for i := range o.Sample {
		logf("flattened %d/%d: fetch, import, create, exec", i+1, o.Sample)
		before := reg.bytes.Load()
		t0 := time.Now()
		r, _ := name.ParseReference(refs[i])
		img, err := remote.Image(r, remote.WithContext(ctx))
		if err != nil {
			return nil, err
		}
		archive := filepath.Join(work, fmt.Sprint(i, ".tar"))
		if err := tarball.WriteToFile(archive, r, img); err != nil {
			return nil, err
		}
		flatFetched += reg.bytes.Load() - before
		tag := fmt.Sprintf("bench-flat-%x-%d:1", nonce&0xffffff, i)
		l, err := c.BuildLayerFrom(ctx, &pb.BuildLayerRequest{Kind: pb.LayerKind_LAYER_KIND_BASE, Ref: tag}, archive, nil)
		os.Remove(archive)
		if err != nil {
			return nil, err
		}
		tags = append(tags, tag)
		flatStored += l.Size
		if err := firstExec(&pb.CreateSandboxRequest{Base: tag}); err != nil {
			return nil, err
		}
		flat = append(flat, time.Since(t0))
	}
	res.FlatImageMs = dist(flat)
	res.FlatFetchedBytes = flatFetched * int64(o.N) / int64(o.Sample)
	res.FlatStoredBytes = flatStored * int64(o.N) / int64(o.Sample)
	res.RatioFetched = bytesRatio(res.FlatFetchedBytes, res.ShoalFetchedBytes)
	res.RatioStored = bytesRatio(res.FlatStoredBytes, res.ShoalStoredBytes)

	// Conversion: images of one fresh layer of --env-mib, pulled (resolve,
	// fetch over loopback, gunzip, extract, mkfs.erofs, hash, sync),
	// against tar -xzf of the same blobs into a tmpfs; medians of 3.
	var conv, untar []time.Duration
	for i := range 3 {
		l, err := layerOf(randomTar("opt/conv", o.EnvMiB, rng, nonce+uint64(1000+i)))
		if err != nil {
			return nil, err
		}
		img, err := mutate.AppendLayers(empty.Image, l)
		if err != nil {
			return nil, err
		}
		ref := fmt.Sprintf("%s/bench-%x/convert-%d:latest", host, nonce&0xffffff, i)
		r, _ := name.ParseReference(ref)
		if err := remote.Write(r, img, remote.WithContext(ctx)); err != nil {
			return nil, err
		}
		t0 := time.Now()
		im, err := c.PullImage(ctx, &pb.PullImageRequest{Image: ref}, nil)
		if err != nil {
			return nil, err
		}
		conv = append(conv, time.Since(t0))
		tags = append(tags, im.Layers...)
		d, err := tarXzf(l)
		if err != nil {
			return nil, fmt.Errorf("tar -xzf: %w", err)
		}
		untar = append(untar, d)
	}
	res.ConvertMs, res.TarXzfMs = dist(conv).P50, dist(untar).P50
	res.ConvertVsTar = res.TarXzfMs / res.ConvertMs
	res.RegistryBytes = reg.bytes.Load()
	return res, nil
}

type progressMark struct {
	at   time.Time
	line string
}

func bytesRatio(a, b int64) float64 {
	if b == 0 {
		return 0
	}
	return float64(a) / float64(b)
}

// baseLayer: busybox (sh, true) with a passwd, and mib of data.
func baseLayer(busybox string, mib int, rng *rand.Rand, nonce uint64) (v1.Layer, error) {
	bin, err := os.ReadFile(busybox)
	if err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, d := range []string{"bin/", "etc/", "tmp/", "proc/", "sys/", "dev/", "root/"} {
		tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d, Mode: 0o755})
	}
	tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "bin/busybox", Mode: 0o755, Size: int64(len(bin))})
	tw.Write(bin)
	for _, a := range []string{"sh", "true", "cat", "ls"} {
		tw.WriteHeader(&tar.Header{Typeflag: tar.TypeSymlink, Name: "bin/" + a, Linkname: "busybox", Mode: 0o777})
	}
	passwd := []byte("root:x:0:0:root:/root:/bin/sh\n")
	tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "etc/passwd", Mode: 0o644, Size: int64(len(passwd))})
	tw.Write(passwd)
	writeRandomFiles(tw, "usr/lib/bench", mib, rng, nonce)
	tw.Close()
	return layerOf(buf.Bytes())
}

// randomTar: mib of files under dir, 1 MiB each, half random and half
// text-like (so gzip has something to do).
func randomTar(dir string, mib int, rng *rand.Rand, nonce uint64) []byte {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	writeRandomFiles(tw, dir, mib, rng, nonce)
	tw.Close()
	return buf.Bytes()
}

func writeRandomFiles(tw *tar.Writer, dir string, mib int, rng *rand.Rand, nonce uint64) {
	parts := strings.Split(dir, "/")
	for i := range parts {
		tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: strings.Join(parts[:i+1], "/") + "/", Mode: 0o755})
	}
	data := make([]byte, 1<<20)
	for i := range mib {
		for j := 0; j < len(data); j += 8 {
			v := rng.Uint64()
			if j >= len(data)/2 {
				v = 0x2020202020202020 | v&0x0f0f0f0f0f0f0f0f // text-like
			}
			for k := range 8 {
				data[j+k] = byte(v >> (8 * k))
			}
		}
		copy(data, fmt.Sprintf("%x-%d\n", nonce, i))
		tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: fmt.Sprintf("%s/f%04d", dir, i), Mode: 0o644, Size: int64(len(data))})
		tw.Write(data)
	}
}

func layerOf(tarBytes []byte) (v1.Layer, error) {
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(tarBytes)), nil })
}

// tarXzf times `tar -xzf` of the layer's blob into a directory on a tmpfs
// (/dev/shm).
func tarXzf(l v1.Layer) (time.Duration, error) {
	rc, err := l.Compressed()
	if err != nil {
		return 0, err
	}
	blob, err := io.ReadAll(rc)
	rc.Close()
	if err != nil {
		return 0, err
	}
	dir, err := os.MkdirTemp("/dev/shm", "shoal-bench-tar-")
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(dir)
	f := filepath.Join(dir, "layer.tar.gz")
	if err := os.WriteFile(f, blob, 0o600); err != nil {
		return 0, err
	}
	out := filepath.Join(dir, "out")
	os.Mkdir(out, 0o755)
	t0 := time.Now()
	if b, err := exec.Command("tar", "-xzf", f, "-C", out).CombinedOutput(); err != nil {
		return 0, fmt.Errorf("%v: %s", err, b)
	}
	return time.Since(t0), nil
}

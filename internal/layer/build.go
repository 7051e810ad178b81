package layer

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// BuildOptions says what to build and under which tag.
type BuildOptions struct {
	Kind    Kind
	Name    string // [a-z0-9][a-z0-9._-]{0,127}
	Version string // [A-Za-z0-9][A-Za-z0-9._-]{0,127}
	// Source is, told apart by its content (not its name):
	//   - a directory;
	//   - a tar file of a root file system, plain or gzip- or
	//     zstd-compressed;
	//   - an OCI image layout, as a directory or a tar file;
	//   - a docker-archive tarball (`docker save`), plain or compressed.
	// An image is flattened: its layers applied bottom first, whiteouts
	// deleting what lower layers had. Device nodes under /dev (a root made
	// by debootstrap or docker export has /dev/console, /dev/null...) are
	// left out with one warning to Progress: the sandbox gets its own /dev.
	// Other device nodes, fifos and sockets are refused; so are tar entries that would land outside the tree or be
	// written through a symlink.
	Source string
	// Opened, if not nil, is the source already opened (O_PATH will do;
	// see BuildRoots.Open): it is read through its descriptor, never
	// looked up by path again, and Source only names it in messages and
	// in the layer's record.
	Opened *os.File
	// Image chooses among the images of an image source that holds several:
	// a tag ("debian:12") or an OCI ref name annotation. Empty for sources
	// with one image; refused for other sources.
	Image string
	// Compression is "" or "none" (uncompressed, the fastest to mount and
	// read), "plain" (uncompressed, and no file's tail packed into its
	// inode: every file's data in whole blocks, which a VM's pmem layer
	// mounted with DAX reads in place; a little bigger), "lz4" or "lz4hc"
	// (about half the size, slower to build).
	Compression string
	// Progress, if not nil, receives a report at each stage (with a line
	// to print) and updates within stages (for a progress bar). It is
	// called from one goroutine at a time.
	Progress func(Progress)
	// Tenant is the namespace of the tag (owner.go); "" for a shared one
	// (the admin's).
	Tenant string
}

// Image building parameters fixed for reproducibility: the same tree always
// gives the same bytes, so the same digest. Note that mkfs.erofs 1.5 applies
// the -T timestamp to every inode: file mtimes are 0 in the image.
const (
	mkfsTimestamp = "-T0"
	mkfsUUID      = "-U00000000-0000-0000-0000-000000000000"
)

// Build makes an EROFS image of o.Source, stores it under its digest and
// points the tag o.Name:o.Version at it. Rebuilding a tag with different
// content moves the tag atomically and keeps the old image (sandboxes may
// still use it; it stays resolvable by digest until Remove or GC). Rebuilding
// with the same content and kind returns the existing layer unchanged. ctx
// bounds the build; a cancelled or failed build leaves nothing behind. Bad
// options and bad sources are marked errdefs.ErrInvalidArgument.
func (s *Store) Build(ctx context.Context, o BuildOptions) (Layer, error) {
	l, err := s.build(ctx, o)
	if err != nil {
		return Layer{}, fmt.Errorf("build layer %s:%s: %w", o.Name, o.Version, err)
	}
	return l, nil
}

func (s *Store) build(ctx context.Context, o BuildOptions) (Layer, error) {
	start := time.Now()
	rep := newReporter(o.Progress)
	spec, err := newSpec(o.Kind, o.Name, o.Version, o.Compression)
	if err != nil {
		return Layer{}, err
	}
	if spec.tenant, err = checkTenant(o.Tenant); err != nil {
		return Layer{}, err
	}
	work, err := os.MkdirTemp(s.tmp, "build-")
	if err != nil {
		return Layer{}, err
	}
	defer os.RemoveAll(work)
	tree, source, err := unpackSource(ctx, o, work, rep)
	if err != nil {
		if ctx.Err() != nil {
			return Layer{}, ctx.Err()
		}
		return Layer{}, errdefs.Mark(errdefs.ErrInvalidArgument, err)
	}
	spec.source, spec.tree, spec.start = source, tree, start
	return s.make(ctx, work, spec, rep)
}

// unpackSource turns o.Source into a directory tree: the source itself if it
// is a plain directory, else a tree extracted under work. It returns the
// tree and a description of the source.
func unpackSource(ctx context.Context, o BuildOptions, work string, rep *reporter) (tree, source string, err error) {
	// src is where the source is read; o.Source what it is called.
	src := o.Source
	if o.Opened != nil {
		src = fdPath(o.Opened)
	}
	fi, err := os.Stat(src)
	if err != nil {
		if o.Opened != nil {
			return "", "", fmt.Errorf("source %s: %w", o.Source, err)
		}
		return "", "", fmt.Errorf("source: %w", err)
	}
	root := filepath.Join(work, "root")
	flatten := func(kind, path string, open func(path, selector string) (v1.Image, string, error)) (string, string, error) {
		img, name, err := open(path, o.Image)
		if err != nil {
			return "", "", fmt.Errorf("source %s: %w", o.Source, err)
		}
		desc := kind + " " + o.Source
		if name != "" {
			desc += " (" + name + ")"
		}
		rep.start(StageUnpack, "layers", 0, "unpacking %s", desc)
		if err := flattenImage(ctx, img, root, rep); err != nil {
			return "", "", fmt.Errorf("unpack %s: %w", desc, err)
		}
		return root, desc, nil
	}
	switch {
	case fi.IsDir():
		if _, err := os.Stat(filepath.Join(src, "oci-layout")); err == nil {
			tree, desc, err := flatten("oci-layout", src, openLayout)
			return tree, strings.Replace(desc, src, o.Source, 1), err
		}
		if o.Image != "" {
			return "", "", fmt.Errorf("--image %q: source %s is a plain directory, not an image", o.Image, o.Source)
		}
		if o.Opened != nil {
			// The directory that was opened (and checked to be inside
			// a build root), whatever its path leads to now: "/." makes
			// the walk enter it rather than see the /proc link.
			return src + "/.", "dir " + o.Source, nil
		}
		// The checks walk the tree without following symlinks, mkfs.erofs
		// follows the one it is given: give both the real directory.
		dir, err := filepath.EvalSymlinks(o.Source)
		if err != nil {
			return "", "", fmt.Errorf("source: %w", err)
		}
		return dir, "dir " + o.Source, nil
	case fi.Mode().IsRegular():
		layout, compression, err := tarLayout(src)
		if err != nil {
			return "", "", fmt.Errorf("source %s: %w: want a directory, a tarball (tar, tar.gz, tar.zst), an OCI image layout or a docker-archive", o.Source, err)
		}
		switch layout {
		case layoutRootfs:
			if o.Image != "" {
				return "", "", fmt.Errorf("--image %q: source %s is a root file system tarball, not an image", o.Image, o.Source)
			}
			rep.start(StageExtract, "bytes", fi.Size(), "extracting %s", o.Source)
			if err := extractTarball(ctx, src, root, true, rep); err != nil {
				return "", "", fmt.Errorf("extract %s: %w", o.Source, err)
			}
			return root, compression + " " + o.Source, nil
		case layoutDockerArchive:
			archive := src
			if compression != "tar" { // the tarball reader reads the archive once per file
				rep.start(StageExtract, "bytes", 0, "decompressing %s", o.Source)
				archive = filepath.Join(work, "image.tar")
				if err := decompressTar(src, archive); err != nil {
					return "", "", err
				}
			}
			tree, desc, err := flatten("docker-archive", archive, openDockerArchive)
			return tree, strings.Replace(desc, archive, o.Source, 1), err
		case layoutOCIArchive:
			rep.start(StageExtract, "bytes", fi.Size(), "extracting OCI image layout %s", o.Source)
			dir := filepath.Join(work, "oci")
			if err := extractTarball(ctx, src, dir, false, rep); err != nil {
				return "", "", fmt.Errorf("extract %s: %w", o.Source, err)
			}
			tree, desc, err := flatten("oci-archive", dir, openLayout)
			return tree, strings.Replace(desc, dir, o.Source, 1), err
		}
	}
	return "", "", fmt.Errorf("source %s: want a directory, a tarball (tar, tar.gz, tar.zst), an OCI image layout or a docker-archive", o.Source)
}

// buildSpec is what make needs: validated options and the tree to image.
type buildSpec struct {
	kind          Kind
	name, version string
	compression   string
	mkfsArgs      []string // mkfs.erofs's options of the compression
	source        string   // description recorded in the Layer
	tree          string
	whiteouts     bool // the tree may hold overlay whiteouts (a commit)
	start         time.Time
	tenant        string // the tag's namespace ("": shared)
}

// checkTenant validates the namespace of a build's tag ("": shared).
func checkTenant(t string) (string, error) {
	if t == "" {
		return "", nil
	}
	if err := validateTenant(t); err != nil {
		return "", errdefs.Mark(errdefs.ErrInvalidArgument, err)
	}
	return t, nil
}

// newSpec validates the parts of a build common to every source; its
// errors are marked errdefs.ErrInvalidArgument.
func newSpec(kind Kind, name, version, compression string) (buildSpec, error) {
	if _, err := ParseKind(string(kind)); err != nil {
		return buildSpec{}, errdefs.Mark(errdefs.ErrInvalidArgument, err)
	}
	if err := validateName(name); err != nil {
		return buildSpec{}, errdefs.Mark(errdefs.ErrInvalidArgument, err)
	}
	if err := validateVersion(version); err != nil {
		return buildSpec{}, errdefs.Mark(errdefs.ErrInvalidArgument, err)
	}
	c, args, err := parseCompression(compression)
	if err != nil {
		return buildSpec{}, errdefs.Mark(errdefs.ErrInvalidArgument, err)
	}
	return buildSpec{kind: kind, name: name, version: version, compression: c, mkfsArgs: args}, nil
}

// make checks the tree, runs mkfs.erofs into work, installs the image and
// tags it.
func (s *Store) make(ctx context.Context, work string, b buildSpec, rep *reporter) (Layer, error) {
	rep.start(StageScan, "files", 0, "checking the tree")
	st, err := checkTree(ctx, b.tree, b.whiteouts, rep)
	if err != nil {
		if ctx.Err() != nil {
			return Layer{}, ctx.Err()
		}
		return Layer{}, errdefs.Mark(errdefs.ErrInvalidArgument, fmt.Errorf("source %s: %w", b.source, err))
	}
	noteDevLeftOut(rep, st.devLeftOut, len(st.devLeftOut))
	for _, rel := range st.devLeftOut {
		b.mkfsArgs = append(slices.Clip(b.mkfsArgs), "--exclude-path="+rel)
	}

	rep.start(StageMkfs, "bytes", st.bytes, "building erofs (%d files, %.1f MiB, %s)", st.files, mib(st.bytes), b.compression)
	img := filepath.Join(work, "image.erofs")
	if err := runMkfs(ctx, img, b, st.bytes, rep); err != nil {
		return Layer{}, err
	}

	fi, err := os.Stat(img)
	if err != nil {
		return Layer{}, err
	}
	rep.start(StageHash, "bytes", fi.Size(), "hashing the image (%.1f MiB)", mib(fi.Size()))
	digest, size, err := seal(img, rep)
	if err != nil {
		return Layer{}, err
	}
	l := Layer{
		Name:         b.name,
		Version:      b.version,
		Kind:         b.kind,
		Digest:       digest,
		Size:         size,
		Compression:  b.compression,
		Created:      time.Now().UTC().Truncate(time.Millisecond),
		Source:       b.source,
		Files:        int64(st.files),
		ContentBytes: st.bytes,
		Tenant:       b.tenant,
	}
	l, err = s.installAndTag(img, l)
	if err != nil {
		return Layer{}, err
	}
	rep.start(StageDone, "", 0, "done in %.1fs: %s, %.1f MiB (%d files, %.1f MiB of content)",
		time.Since(b.start).Seconds(), digest, mib(size), st.files, mib(st.bytes))
	return l, nil
}

// runMkfs runs mkfs.erofs on b.tree, reporting how much of the tree's
// content it has read.
func runMkfs(ctx context.Context, img string, b buildSpec, total int64, rep *reporter) error {
	args := []string{mkfsTimestamp, mkfsUUID, "--quiet"}
	args = append(args, b.mkfsArgs...)
	args = append(args, img, b.tree)
	cmd := exec.CommandContext(ctx, "mkfs.erofs", args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.WaitDelay = time.Second
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("mkfs.erofs: %w", err)
	}
	done := make(chan struct{})
	polled := make(chan struct{})
	go func() {
		defer close(polled)
		tick := time.NewTicker(progressInterval)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
				if n, err := procReadBytes(cmd.Process.Pid); err == nil {
					rep.update(min(n, max(total-1, 0)), total)
				}
			}
		}
	}()
	err := cmd.Wait()
	close(done)
	<-polled
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return fmt.Errorf("mkfs.erofs: %w: %s", err, strings.TrimSpace(lastBytes(out.String(), 1024)))
	}
	rep.update(total, total)
	return nil
}

func parseCompression(c string) (name string, mkfsArgs []string, err error) {
	switch c {
	case "", "none":
		return "none", nil, nil
	case "plain":
		// EROFS's DAX reads only files of the FLAT_PLAIN layout
		// (fs/erofs/inode.c), which packing a tail makes FLAT_INLINE.
		return c, []string{"-Enoinline_data"}, nil
	case "lz4", "lz4hc":
		return c, []string{"-z" + c}, nil
	}
	return "", nil, fmt.Errorf("unknown compression %q: valid are none, plain, lz4, lz4hc", c)
}

// seal hashes the image, flushes it to disk and returns its digest and size.
func seal(img string, rep *reporter) (digest string, size int64, err error) {
	f, err := os.OpenFile(img, os.O_RDWR, 0)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return "", 0, err
	}
	h := sha256.New()
	if size, err = io.Copy(h, &countingReader{r: f, total: fi.Size(), rep: rep}); err != nil {
		return "", 0, fmt.Errorf("hash image: %w", err)
	}
	if err := f.Sync(); err != nil {
		return "", 0, fmt.Errorf("sync image: %w", err)
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), size, f.Close()
}

// installAndTag installs a sealed image and points l's tag at it, with no
// garbage collection in between.
func (s *Store) installAndTag(img string, l Layer) (Layer, error) {
	s.gcMu.RLock()
	defer s.gcMu.RUnlock()
	if err := s.install(img, l.Digest); err != nil {
		return Layer{}, err
	}
	if s.cluster != nil {
		// In the store before the cluster's tag names it: every node
		// that resolves the tag finds the image.
		if err := s.pushAfterInstall(l); err != nil {
			return Layer{}, err
		}
	}
	tagged, old, err := s.tag(l)
	if err != nil {
		return Layer{}, fmt.Errorf("tag: %w", err)
	}
	if s.cluster == nil {
		if err := s.pushAfterInstall(tagged); err != nil {
			return Layer{}, err
		}
	}
	switch old {
	case "":
		s.log.Info("layer built", "layer", tagged.Key(), "digest", tagged.Digest, "size", tagged.Size, "source", l.Source)
	case tagged.Digest:
		s.log.Info("layer rebuilt unchanged", "layer", tagged.Key(), "digest", tagged.Digest)
	default:
		s.log.Info("layer tag moved", "layer", tagged.Key(), "from", old, "to", tagged.Digest)
	}
	return tagged, nil
}

// install moves a sealed image into blobs under its digest. An image that is
// already there (same digest, so same bytes) is kept as it is: it may be
// mounted. The caller holds gcMu (shared) until the image is recorded.
func (s *Store) install(img, digest string) error {
	dst := s.ImagePath(digest)
	if _, err := os.Stat(dst); err == nil {
		return nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if err := os.Chmod(img, 0o444); err != nil {
		return err
	}
	if err := os.Rename(img, dst); err != nil {
		return fmt.Errorf("install image: %w", err)
	}
	d, err := os.Open(s.blobs)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", s.blobs, err)
	}
	return nil
}

func mib(n int64) float64 { return float64(n) / (1 << 20) }

func lastBytes(s string, n int) string {
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}

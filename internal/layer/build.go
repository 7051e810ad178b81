package layer

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// BuildOptions says what to build and under which tag.
type BuildOptions struct {
	Kind    Kind
	Name    string // [a-z0-9][a-z0-9._-]{0,127}
	Version string // [A-Za-z0-9][A-Za-z0-9._-]{0,127}
	// Source is a directory, or a .tar, .tar.gz or .tgz file. Device nodes,
	// fifos and sockets are refused; so are tar entries that would land
	// outside the tree.
	Source string
	// Compression is "" or "none" (uncompressed, the fastest to mount and
	// read), "lz4" or "lz4hc" (about half the size, slower to build).
	Compression string
	// Progress, if not nil, receives one human-readable line per stage.
	Progress io.Writer
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
// still use it; it stays resolvable by digest). Rebuilding with the same
// content and kind returns the existing layer unchanged. ctx bounds the
// build; a cancelled or failed build leaves nothing behind.
func (s *Store) Build(ctx context.Context, o BuildOptions) (Layer, error) {
	l, err := s.build(ctx, o)
	if err != nil {
		return Layer{}, fmt.Errorf("build layer %s:%s: %w", o.Name, o.Version, err)
	}
	return l, nil
}

func (s *Store) build(ctx context.Context, o BuildOptions) (Layer, error) {
	start := time.Now()
	progress := func(format string, args ...any) {
		if o.Progress != nil {
			fmt.Fprintf(o.Progress, format+"\n", args...)
		}
	}
	if _, err := ParseKind(string(o.Kind)); err != nil {
		return Layer{}, errdefs.Mark(errdefs.ErrInvalidArgument, err)
	}
	if err := validateName(o.Name); err != nil {
		return Layer{}, errdefs.Mark(errdefs.ErrInvalidArgument, err)
	}
	if err := validateVersion(o.Version); err != nil {
		return Layer{}, errdefs.Mark(errdefs.ErrInvalidArgument, err)
	}
	compression, mkfsZ, err := parseCompression(o.Compression)
	if err != nil {
		return Layer{}, errdefs.Mark(errdefs.ErrInvalidArgument, err)
	}
	fi, err := os.Stat(o.Source)
	if err != nil {
		return Layer{}, errdefs.Mark(errdefs.ErrInvalidArgument, fmt.Errorf("source: %w", err))
	}

	work, err := os.MkdirTemp(s.tmp, "build-")
	if err != nil {
		return Layer{}, err
	}
	defer os.RemoveAll(work)

	var tree string
	var st treeStats
	switch {
	case fi.IsDir():
		tree = o.Source
		if st, err = checkTree(ctx, tree); err != nil {
			return Layer{}, errdefs.Mark(errdefs.ErrInvalidArgument, fmt.Errorf("source %s: %w", o.Source, err))
		}
	case fi.Mode().IsRegular() && isTarball(o.Source):
		progress("extracting %s", o.Source)
		tree = filepath.Join(work, "root")
		if st, err = extractTarball(ctx, o.Source, tree); err != nil {
			return Layer{}, errdefs.Mark(errdefs.ErrInvalidArgument, fmt.Errorf("extract %s: %w", o.Source, err))
		}
	default:
		return Layer{}, errdefs.New(errdefs.ErrInvalidArgument, "source %s: want a directory or a .tar, .tar.gz or .tgz file", o.Source)
	}

	progress("building erofs (%d files, %.1f MiB, %s)", st.files, mib(st.bytes), compression)
	img := filepath.Join(work, "image.erofs")
	args := []string{mkfsTimestamp, mkfsUUID, "--quiet"}
	if mkfsZ != "" {
		args = append(args, "-z"+mkfsZ)
	}
	args = append(args, img, tree)
	cmd := exec.CommandContext(ctx, "mkfs.erofs", args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.WaitDelay = time.Second
	if err := cmd.Run(); err != nil {
		if ctx.Err() != nil {
			return Layer{}, ctx.Err()
		}
		return Layer{}, fmt.Errorf("mkfs.erofs: %w: %s", err, strings.TrimSpace(lastBytes(out.String(), 1024)))
	}

	digest, size, err := seal(img)
	if err != nil {
		return Layer{}, err
	}
	if err := s.install(img, digest); err != nil {
		return Layer{}, err
	}
	l := Layer{
		Name:        o.Name,
		Version:     o.Version,
		Kind:        o.Kind,
		Digest:      digest,
		Size:        size,
		Compression: compression,
		Created:     time.Now().UTC().Truncate(time.Millisecond),
	}
	l, old, err := s.tag(l)
	if err != nil {
		return Layer{}, fmt.Errorf("tag: %w", err)
	}
	switch old {
	case "":
		s.log.Info("layer built", "layer", l.Ref(), "digest", digest, "size", size)
	case digest:
		s.log.Info("layer rebuilt unchanged", "layer", l.Ref(), "digest", digest)
	default:
		s.log.Info("layer tag moved", "layer", l.Ref(), "from", old, "to", digest)
	}
	progress("done in %.1fs: %s, %.1f MiB", time.Since(start).Seconds(), digest, mib(size))
	return l, nil
}

func parseCompression(c string) (name, mkfsZ string, err error) {
	switch c {
	case "", "none":
		return "none", "", nil
	case "lz4", "lz4hc":
		return c, c, nil
	}
	return "", "", fmt.Errorf("unknown compression %q: valid are none, lz4, lz4hc", c)
}

// seal hashes the image, flushes it to disk and returns its digest and size.
func seal(img string) (digest string, size int64, err error) {
	f, err := os.OpenFile(img, os.O_RDWR, 0)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	h := sha256.New()
	if size, err = io.Copy(h, f); err != nil {
		return "", 0, fmt.Errorf("hash image: %w", err)
	}
	if err := f.Sync(); err != nil {
		return "", 0, fmt.Errorf("sync image: %w", err)
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), size, f.Close()
}

// install moves a sealed image into blobs under its digest. An image that is
// already there (same digest, so same bytes) is kept as it is: it may be
// mounted.
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

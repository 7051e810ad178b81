package layer

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// The export format: a tar of two files, the metadata first so that an
// import checks it before reading the image.
const (
	ExportFormat    = "shoal-layer/v1"
	exportMetaName  = "shoal-layer.json"
	exportImageName = "image.erofs"
	maxExportMeta   = 1 << 20
)

// erofsMagic is the EROFS superblock magic, at byte 1024 of an image.
const erofsMagic = 0xE0F5E1E2

type exportMeta struct {
	Format string `json:"format"`
	Layer  Layer  `json:"layer"`
}

// Export writes the layer ref names to w in the export format: a tar holding
// "shoal-layer.json" (format and the Layer's metadata) then "image.erofs".
// The image is opened before anything is written, so a concurrent GC cannot
// cut it short.
func (s *Store) Export(ctx context.Context, ref string, w io.Writer) (Layer, error) {
	l, err := s.export(ctx, ref, w)
	if err != nil {
		return l, fmt.Errorf("export layer %s: %w", ref, err)
	}
	return l, nil
}

// OpenExport resolves ref and opens its image, for callers that want to
// know the layer (and fail cleanly) before they start writing. Close the
// returned file after WriteExport. A layer this node knows by a tag (the
// cluster's) but whose image it does not hold is fetched from the layer
// store first, when the node has one.
func (s *Store) OpenExport(ctx context.Context, ref string) (Layer, *os.File, error) {
	return s.As(AdminOwner).OpenExport(ctx, ref)
}

// OpenExport is Store.OpenExport of a layer the owner sees (its own or a
// shared one).
func (v View) OpenExport(ctx context.Context, ref string) (Layer, *os.File, error) {
	s := v.s
	l, err := v.Resolve(ref)
	if err != nil {
		return Layer{}, nil, fmt.Errorf("export layer %s: %w", ref, err)
	}
	f, err := os.Open(s.ImagePath(l.Digest))
	if errors.Is(err, os.ErrNotExist) && s.remote != nil {
		if derr := s.download(ctx, l); derr != nil {
			return Layer{}, nil, fmt.Errorf("export layer %s: image of %s: not on this node, and from %s: %w", ref, l.Digest, s.remote.Store.URL(), derr)
		}
		f, err = os.Open(s.ImagePath(l.Digest))
	}
	if err != nil {
		return Layer{}, nil, fmt.Errorf("export layer %s: image of %s: %w", ref, l.Digest, err)
	}
	fi, err := f.Stat()
	if err != nil || fi.Size() != l.Size {
		f.Close()
		return Layer{}, nil, fmt.Errorf("export layer %s: image of %s has %d bytes, its record says %d", ref, l.Digest, fi.Size(), l.Size)
	}
	return l, f, nil
}

func (s *Store) export(ctx context.Context, ref string, w io.Writer) (Layer, error) {
	l, f, err := s.OpenExport(ctx, ref)
	if err != nil {
		return Layer{}, err
	}
	defer f.Close()
	return l, WriteExport(ctx, w, l, f)
}

// WriteExport writes the export tar of layer l, whose image is img.
func WriteExport(ctx context.Context, w io.Writer, l Layer, img io.Reader) error {
	l.Remote, l.Mirrored, l.Tenant = "", 0, "" // an import says whose it is
	meta, err := json.MarshalIndent(exportMeta{Format: ExportFormat, Layer: l}, "", "  ")
	if err != nil {
		return err
	}
	tw := tar.NewWriter(w)
	mtime := l.Created
	if mtime.IsZero() {
		mtime = time.Unix(0, 0)
	}
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: exportMetaName, Mode: 0o644, Size: int64(len(meta)), ModTime: mtime}); err != nil {
		return err
	}
	if _, err := tw.Write(meta); err != nil {
		return err
	}
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: exportImageName, Mode: 0o444, Size: l.Size, ModTime: mtime}); err != nil {
		return err
	}
	if _, err := io.Copy(tw, ctxReader{ctx, img}); err != nil {
		return fmt.Errorf("write image: %w", err)
	}
	return tw.Close()
}

type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}

// ImportOptions says under which tag an import is stored and what its
// image may hold.
type ImportOptions struct {
	// Tag, if not empty, replaces the tag of the metadata ("name:version").
	Tag string
	// Tenant is the namespace of the tag (owner.go); "" for a shared one
	// (the admin's).
	Tenant string
	// AllowSetID lets the image hold set-user-ID and set-group-ID files
	// (the admin's imports).
	AllowSetID bool
}

// Import reads a layer in the export format from r, checks that the image
// is an EROFS image whose SHA-256 and size are those its metadata states
// and that it passes the checks of an untrusted image (verify.go: Shoal's
// walk of every inode, then fsck.erofs), stores it and points its tag at
// it (moving the tag if it pointed elsewhere). Anything malformed, an
// image that does not match its digest or breaks a rule is marked
// errdefs.ErrInvalidArgument and leaves nothing behind.
func (s *Store) Import(ctx context.Context, r io.Reader, o ImportOptions) (Layer, error) {
	l, err := s.importLayer(ctx, r, o)
	if err != nil {
		return Layer{}, fmt.Errorf("import layer: %w", err)
	}
	return l, nil
}

func (s *Store) importLayer(ctx context.Context, r io.Reader, o ImportOptions) (Layer, error) {
	bad := func(format string, args ...any) error {
		return errdefs.New(errdefs.ErrInvalidArgument, format, args...)
	}
	tenant, err := checkTenant(o.Tenant)
	if err != nil {
		return Layer{}, err
	}
	tr := tar.NewReader(ctxReader{ctx, r})
	hdr, err := tr.Next()
	if err != nil {
		if ctx.Err() != nil {
			return Layer{}, ctx.Err()
		}
		return Layer{}, bad("not a layer export (a tar from shoal layer export): %v", err)
	}
	if hdr.Name != exportMetaName || hdr.Size > maxExportMeta {
		return Layer{}, bad("not a layer export: its first entry is %q, want %s", hdr.Name, exportMetaName)
	}
	raw, err := io.ReadAll(tr)
	if err != nil {
		return Layer{}, bad("read %s: %v", exportMetaName, err)
	}
	var meta exportMeta
	if err := json.Unmarshal(raw, &meta); err != nil {
		return Layer{}, bad("decode %s: %v", exportMetaName, err)
	}
	if meta.Format != ExportFormat {
		return Layer{}, bad("export format %q: this server reads %s", meta.Format, ExportFormat)
	}
	l := meta.Layer
	l.Tenant, l.Remote, l.Mirrored = tenant, "", 0
	if o.Tag != "" {
		if l.Name, l.Version, err = ParseTag(o.Tag); err != nil {
			return Layer{}, errdefs.Mark(errdefs.ErrInvalidArgument, err)
		}
	}
	if _, err := newSpec(l.Kind, l.Name, l.Version, l.Compression); err != nil {
		return Layer{}, fmt.Errorf("metadata: %w", err)
	}
	if err := validateDigest(l.Digest); err != nil {
		return Layer{}, errdefs.Mark(errdefs.ErrInvalidArgument, fmt.Errorf("metadata: %w", err))
	}

	hdr, err = tr.Next()
	if err != nil {
		if ctx.Err() != nil {
			return Layer{}, ctx.Err()
		}
		return Layer{}, bad("no image after the metadata: %v", err)
	}
	if hdr.Name != exportImageName {
		return Layer{}, bad("second entry is %q, want %s", hdr.Name, exportImageName)
	}
	if hdr.Size != l.Size {
		return Layer{}, bad("image has %d bytes, its metadata says %d", hdr.Size, l.Size)
	}
	f, err := os.CreateTemp(s.tmp, "import-*.erofs")
	if err != nil {
		return Layer{}, err
	}
	defer os.Remove(f.Name())
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(f, h), tr)
	if err != nil {
		if ctx.Err() != nil {
			return Layer{}, ctx.Err()
		}
		return Layer{}, bad("read image: %v (after %d of %d bytes)", err, n, l.Size)
	}
	if got := "sha256:" + hex.EncodeToString(h.Sum(nil)); got != l.Digest {
		return Layer{}, bad("digest mismatch: the metadata says %s, the image hashes to %s: the file is corrupt or was modified", l.Digest, got)
	}
	// Nothing of a tenant reaches the host kernel unchecked (verify.go).
	st, err := checkErofs(ctx, f, l.Size, o.AllowSetID)
	if err != nil {
		if ctx.Err() != nil {
			return Layer{}, ctx.Err()
		}
		return Layer{}, err
	}
	if err := fsckErofs(ctx, f.Name()); err != nil {
		return Layer{}, err
	}
	l.Files, l.ContentBytes = st.files, st.bytes
	if err := f.Sync(); err != nil {
		return Layer{}, err
	}
	if err := f.Close(); err != nil {
		return Layer{}, err
	}
	if l.Created.IsZero() {
		l.Created = time.Now().UTC().Truncate(time.Millisecond)
	}
	tagged, err := s.installAndTag(f.Name(), l)
	if err != nil {
		return Layer{}, err
	}
	return tagged, nil
}

package remote

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// Dir is a store in a directory: each key is a file under it, written to
// a temporary file and renamed in, so readers never see a partial object.
type Dir struct {
	root string
}

var _ Store = (*Dir)(nil)

// OpenDir opens (creating) the store rooted at the absolute path dir.
func OpenDir(dir string) (*Dir, error) {
	if !filepath.IsAbs(dir) {
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "layer store directory %q: want an absolute path", dir)
	}
	if err := os.MkdirAll(filepath.Join(dir, "tmp"), 0o755); err != nil {
		return nil, fmt.Errorf("open layer store %s: %w", dir, err)
	}
	return &Dir{root: filepath.Clean(dir)}, nil
}

func (d *Dir) URL() string { return "file://" + d.root }

func (d *Dir) path(key string) (string, error) {
	if err := checkKey(key); err != nil {
		return "", err
	}
	return filepath.Join(d.root, filepath.FromSlash(key)), nil
}

func (d *Dir) LocalPath(key string) string {
	p, err := d.path(key)
	if err != nil {
		return ""
	}
	return p
}

func (d *Dir) Put(ctx context.Context, key string, r io.Reader, size int64) error {
	p, err := d.path(key)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return fmt.Errorf("put %s: %w", key, err)
	}
	f, err := os.CreateTemp(filepath.Join(d.root, "tmp"), "put-*")
	if err != nil {
		return fmt.Errorf("put %s: %w", key, err)
	}
	defer os.Remove(f.Name())
	defer f.Close()
	n, err := io.Copy(f, ctxReader{ctx, r})
	if err != nil {
		return fmt.Errorf("put %s: %w", key, err)
	}
	if size >= 0 && n != size {
		return fmt.Errorf("put %s: wrote %d bytes, want %d", key, n, size)
	}
	if err := f.Chmod(0o444); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("put %s: %w", key, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("put %s: %w", key, err)
	}
	if err := os.Rename(f.Name(), p); err != nil {
		return fmt.Errorf("put %s: %w", key, err)
	}
	return nil
}

func (d *Dir) Get(ctx context.Context, key string) (io.ReadCloser, int64, error) {
	p, err := d.path(key)
	if err != nil {
		return nil, 0, err
	}
	f, err := os.Open(p)
	if err != nil {
		return nil, 0, notFound(key, err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, 0, err
	}
	return f, fi.Size(), nil
}

func (d *Dir) ReadAt(ctx context.Context, key string, p []byte, off int64) (int, error) {
	path, err := d.path(key)
	if err != nil {
		return 0, err
	}
	f, err := os.Open(path)
	if err != nil {
		return 0, notFound(key, err)
	}
	defer f.Close()
	n, err := f.ReadAt(p, off)
	if errors.Is(err, io.EOF) {
		err = nil
	}
	return n, err
}

func (d *Dir) Stat(ctx context.Context, key string) (int64, error) {
	p, err := d.path(key)
	if err != nil {
		return 0, err
	}
	fi, err := os.Stat(p)
	if err != nil {
		return 0, notFound(key, err)
	}
	return fi.Size(), nil
}

func notFound(key string, err error) error {
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%s: %w", key, ErrNotFound)
	}
	return fmt.Errorf("%s: %w", key, err)
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

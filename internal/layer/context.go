package layer

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// ExtractContext receives a build context sent by a client (a tar, plain,
// gzip or zstd: at most max bytes, more is errdefs.ErrResourceExhausted)
// and unpacks it, as extractTarball does (no entry lands outside it,
// nothing is followed, no device nodes), into a new directory of the
// store's scratch space. remove deletes it; call it whatever happens.
func (s *Store) ExtractContext(ctx context.Context, r io.Reader, max int64) (dir string, remove func(), err error) {
	work, err := os.MkdirTemp(s.tmp, "context-")
	if err != nil {
		return "", nil, err
	}
	remove = func() { os.RemoveAll(work) }
	tarPath := filepath.Join(work, "context.tar")
	f, err := os.Create(tarPath)
	if err != nil {
		remove()
		return "", nil, err
	}
	n, err := io.Copy(f, io.LimitReader(r, max+1))
	f.Close()
	if err != nil {
		remove()
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		return "", nil, fmt.Errorf("receive the build context: %w", err)
	}
	if n > max {
		remove()
		return "", nil, errdefs.New(errdefs.ErrResourceExhausted, "the build context is larger than %d bytes, the most this server takes (shoal serve --build-upload-max)", max)
	}
	dir = filepath.Join(work, "context")
	if err := extractTarball(ctx, tarPath, dir, false, newReporter(nil)); err != nil {
		remove()
		if ctx.Err() != nil {
			return "", nil, ctx.Err()
		}
		return "", nil, errdefs.Mark(errdefs.ErrInvalidArgument, fmt.Errorf("unpack the build context: %w", err))
	}
	os.Remove(tarPath)
	return dir, remove, nil
}

// ScratchDir makes a new directory in the store's scratch space (on the
// same file system as its layers: an overlay's upper for a build step).
func (s *Store) ScratchDir(prefix string) (string, error) {
	return os.MkdirTemp(s.tmp, prefix)
}

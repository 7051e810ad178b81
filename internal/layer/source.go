package layer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// ErrOutsideBuildRoots marks a build from a server path that is not inside
// any of the configured build roots (it is also errdefs.ErrPermissionDenied).
var ErrOutsideBuildRoots = errors.New("server path not allowed")

// BuildRoots are the directories of the server's machine that builds from a
// server path may read (serve --build-root). Everything else a client sends
// as an upload. The zero value (and nil) allows no server path at all.
type BuildRoots struct {
	dirs []string // absolute, symlinks resolved, cleaned
}

// NewBuildRoots checks that each dir exists and is a directory, and keeps
// it with its symlinks resolved.
func NewBuildRoots(dirs []string) (*BuildRoots, error) {
	b := &BuildRoots{}
	for _, d := range dirs {
		if !filepath.IsAbs(d) {
			return nil, fmt.Errorf("build root %q must be an absolute path", d)
		}
		real, err := filepath.EvalSymlinks(d)
		if err != nil {
			return nil, fmt.Errorf("build root: %w", err)
		}
		fi, err := os.Stat(real)
		if err != nil {
			return nil, fmt.Errorf("build root: %w", err)
		}
		if !fi.IsDir() {
			return nil, fmt.Errorf("build root %s is not a directory", d)
		}
		b.dirs = append(b.dirs, filepath.Clean(real))
	}
	return b, nil
}

// Dirs returns the roots, symlinks resolved.
func (b *BuildRoots) Dirs() []string {
	if b == nil {
		return nil
	}
	return b.dirs
}

// Open opens the build source p, an absolute path on this machine, if it
// lies inside one of the roots once its symlinks are resolved, and returns
// it opened (O_PATH: opening has no side effect, even on a device) for
// BuildOptions.Opened. The path is resolved once and the open itself is
// confined to the root (os.Root): a symlink that leads out of the root, or
// a component swapped for one meanwhile, is refused, never followed. Only
// a directory or a regular file is accepted. An error other than a missing
// path is marked ErrOutsideBuildRoots and errdefs.ErrPermissionDenied.
func (b *BuildRoots) Open(p string) (*os.File, error) {
	if !filepath.IsAbs(p) {
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "source %q must be an absolute path on the server", p)
	}
	refuse := func(why string) error {
		roots := "none is configured"
		if len(b.Dirs()) > 0 {
			roots = "they are " + strings.Join(b.Dirs(), ", ")
		}
		return errdefs.Mark(errdefs.ErrPermissionDenied, fmt.Errorf("%w: %s %s: the server builds from its own file system only inside the directories given to `shoal serve --build-root DIR` (%s); upload the source instead (the CLI's `layer build` without --server-path, the SDKs' build without server_path)",
			ErrOutsideBuildRoots, p, why, roots))
	}
	real, err := filepath.EvalSymlinks(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, errdefs.Mark(errdefs.ErrNotFound, fmt.Errorf("source %s does not exist on the server", p))
	}
	if err != nil {
		return nil, refuse("cannot be resolved (" + err.Error() + ")")
	}
	for _, dir := range b.Dirs() {
		rel, err := filepath.Rel(dir, real)
		if err != nil || !filepath.IsLocal(rel) && rel != "." {
			continue
		}
		root, err := os.OpenRoot(dir)
		if err != nil {
			return nil, err
		}
		defer root.Close()
		f, err := root.OpenFile(rel, unix.O_PATH, 0)
		if err != nil {
			return nil, refuse("changed while it was being opened (" + err.Error() + ")")
		}
		fi, err := f.Stat()
		if err != nil {
			f.Close()
			return nil, err
		}
		if !fi.IsDir() && !fi.Mode().IsRegular() {
			f.Close()
			if fi.Mode()&fs.ModeSymlink != 0 {
				return nil, refuse("changed while it was being opened (now a symlink)")
			}
			return nil, errdefs.New(errdefs.ErrInvalidArgument, "source %s is a %s: want a directory or a file", p, typeName(fi.Mode().Type()))
		}
		return f, nil
	}
	if real != p {
		return nil, refuse("(which is " + real + ") is not inside a build root")
	}
	return nil, refuse("is not inside a build root")
}

// fdPath names an open file by its descriptor, for this process and its
// children (mkfs.erofs) alike: opening it reaches the same inode whatever
// happened to the path it was opened by.
func fdPath(f *os.File) string {
	return fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), f.Fd())
}

// DefaultUploadMax bounds an uploaded build source (serve --build-upload-max).
const DefaultUploadMax int64 = 32 << 30

// BuildUpload builds a layer from a source sent by a client: r is a tar
// stream (plain, gzip or zstd), an OCI image layout as a tar or a
// docker-archive, told apart by content as for a server path. It is first
// written to a temporary file of the store (at most max bytes; more is
// errdefs.ErrResourceExhausted), which is removed when the build ends
// however it ends (an error of r, a client gone, a cancelled ctx). o.Source
// only names the upload in messages and in the layer's record; the options
// are checked before anything is read from r.
func (s *Store) BuildUpload(ctx context.Context, r io.Reader, max int64, o BuildOptions) (Layer, error) {
	if _, err := newSpec(o.Kind, o.Name, o.Version, o.Compression); err != nil {
		return Layer{}, fmt.Errorf("build layer %s:%s: %w", o.Name, o.Version, err)
	}
	if o.Source == "" {
		o.Source = "upload"
	}
	f, err := os.CreateTemp(s.tmp, "upload-")
	if err != nil {
		return Layer{}, fmt.Errorf("build layer %s:%s: %w", o.Name, o.Version, err)
	}
	defer os.Remove(f.Name())
	defer f.Close()
	n, err := io.Copy(f, io.LimitReader(r, max+1))
	if err != nil {
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		return Layer{}, fmt.Errorf("build layer %s:%s: receive the upload: %w", o.Name, o.Version, err)
	}
	if n > max {
		return Layer{}, errdefs.New(errdefs.ErrResourceExhausted, "build layer %s:%s: the upload is larger than %d bytes, the most this server takes (shoal serve --build-upload-max)", o.Name, o.Version, max)
	}
	o.Opened = f
	return s.Build(ctx, o)
}

// Package remote is where a fleet's layers live when they are not on a
// node: a layer store given by URL, file:///path (a local directory or a
// mounted shared file system such as CephFS, JuiceFS, NFS or 3FS) or
// s3://bucket/prefix on any S3-compatible server.
//
// A Store is a flat namespace of objects under keys the layer package lays
// out (blobs/sha256/<hex>, blobs/sha256/<hex>.json, blobs/sha256/<hex>.chunks,
// tags/<name>/<version>); keys are built from validated digests and tags,
// never from raw client input, and are checked again here. A Store is safe
// for concurrent use.
package remote

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"regexp"
	"strings"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// Store is an object store holding layers.
type Store interface {
	// URL is the store's address as configured (credentials left out).
	URL() string
	// Put writes size bytes from r under key, replacing what was there;
	// readers see the old or the new object, never part of one.
	Put(ctx context.Context, key string, r io.Reader, size int64) error
	// Get opens the object under key; a missing one wraps ErrNotFound.
	Get(ctx context.Context, key string) (io.ReadCloser, int64, error)
	// ReadAt fills p from the object at offset off (one ranged read);
	// fewer bytes only at the object's end.
	ReadAt(ctx context.Context, key string, p []byte, off int64) (int, error)
	// Stat returns the object's size; a missing one wraps ErrNotFound.
	Stat(ctx context.Context, key string) (int64, error)
	// LocalPath is the object's path on this machine's file system if the
	// store is a directory (the kernel can mount an image straight from
	// it), else "".
	LocalPath(key string) string
}

// ErrNotFound: no object under this key.
var ErrNotFound = errdefs.Mark(errdefs.ErrNotFound, errors.New("not in the layer store"))

// Options configure an s3:// store; zero values take the environment's
// (SHOAL_S3_ENDPOINT, AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
// SHOAL_S3_PATH_STYLE, SHOAL_S3_INSECURE).
type Options struct {
	Endpoint  string // host:port, or a URL http(s)://host:port
	Region    string
	AccessKey string
	SecretKey string
	PathStyle bool // bucket in the path, not the host name (minio, versitygw, most on-premise servers)
	Insecure  bool // plain http
}

// Open returns the store at rawURL: file:///abs/dir or s3://bucket[/prefix].
func Open(rawURL string, o Options) (Store, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "layer store %q: %v", rawURL, err)
	}
	switch u.Scheme {
	case "file":
		if u.Host != "" && u.Host != "localhost" {
			return nil, errdefs.New(errdefs.ErrInvalidArgument, "layer store %q: a file:// URL names a local path (file:///dir)", rawURL)
		}
		return OpenDir(u.Path)
	case "s3":
		return openS3(u, o)
	}
	return nil, errdefs.New(errdefs.ErrInvalidArgument, "layer store %q: want file:///path or s3://bucket/prefix", rawURL)
}

var keyRE = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$`)

// checkKey refuses keys that could leave the store's root.
func checkKey(key string) error {
	if len(key) > 512 || !keyRE.MatchString(key) || strings.Contains(key, "..") {
		return fmt.Errorf("layer store key %q: %w", key, errdefs.ErrInvalidArgument)
	}
	return nil
}

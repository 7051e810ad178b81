package remote

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// S3 is a store in a bucket of an S3-compatible server, under a prefix.
type S3 struct {
	url    string
	bucket string
	prefix string // "" or ending in "/"
	c      *minio.Client
}

var _ Store = (*S3)(nil)

func openS3(u *url.URL, o Options) (*S3, error) {
	bucket := u.Host
	if bucket == "" {
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "layer store %q: no bucket (s3://bucket/prefix)", u.String())
	}
	env := func(v *string, name string) {
		if *v == "" {
			*v = os.Getenv(name)
		}
	}
	env(&o.Endpoint, "SHOAL_S3_ENDPOINT")
	env(&o.Region, "AWS_REGION")
	env(&o.AccessKey, "AWS_ACCESS_KEY_ID")
	env(&o.SecretKey, "AWS_SECRET_ACCESS_KEY")
	if os.Getenv("SHOAL_S3_PATH_STYLE") == "1" || os.Getenv("SHOAL_S3_PATH_STYLE") == "true" {
		o.PathStyle = true
	}
	if os.Getenv("SHOAL_S3_INSECURE") == "1" || os.Getenv("SHOAL_S3_INSECURE") == "true" {
		o.Insecure = true
	}
	if o.Endpoint == "" {
		o.Endpoint = "s3.amazonaws.com"
	}
	if e, err := url.Parse(o.Endpoint); err == nil && (e.Scheme == "http" || e.Scheme == "https") {
		o.Endpoint = e.Host
		o.Insecure = e.Scheme == "http"
	}
	lookup := minio.BucketLookupAuto
	if o.PathStyle {
		lookup = minio.BucketLookupPath
	}
	tr, err := minio.DefaultTransport(!o.Insecure)
	if err != nil {
		return nil, err
	}
	tr.ResponseHeaderTimeout = 30 * time.Second
	c, err := minio.New(o.Endpoint, &minio.Options{
		Creds:        credentials.NewStaticV4(o.AccessKey, o.SecretKey, ""),
		Secure:       !o.Insecure,
		Region:       o.Region,
		BucketLookup: lookup,
		Transport:    tr,
		MaxRetries:   1, // the caller retries, with its own back-off and deadline
	})
	if err != nil {
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "layer store %q: %v", u.String(), err)
	}
	prefix := strings.Trim(u.Path, "/")
	if prefix != "" {
		if err := checkKey(prefix); err != nil {
			return nil, errdefs.New(errdefs.ErrInvalidArgument, "layer store %q: bad prefix", u.String())
		}
		prefix += "/"
	}
	return &S3{url: "s3://" + bucket + "/" + prefix, bucket: bucket, prefix: prefix, c: c}, nil
}

func (s *S3) URL() string                 { return s.url }
func (s *S3) LocalPath(key string) string { return "" }

func (s *S3) key(key string) (string, error) {
	if err := checkKey(key); err != nil {
		return "", err
	}
	return s.prefix + key, nil
}

func (s *S3) Put(ctx context.Context, key string, r io.Reader, size int64) error {
	k, err := s.key(key)
	if err != nil {
		return err
	}
	if _, err := s.c.PutObject(ctx, s.bucket, k, r, size, minio.PutObjectOptions{ContentType: "application/octet-stream", DisableMultipart: size <= 5<<30}); err != nil {
		return fmt.Errorf("put %s: %w", s.url+key, s3err(err))
	}
	return nil
}

func (s *S3) Get(ctx context.Context, key string) (io.ReadCloser, int64, error) {
	k, err := s.key(key)
	if err != nil {
		return nil, 0, err
	}
	o, err := s.c.GetObject(ctx, s.bucket, k, minio.GetObjectOptions{})
	if err != nil {
		return nil, 0, fmt.Errorf("get %s: %w", s.url+key, s3err(err))
	}
	st, err := o.Stat()
	if err != nil {
		o.Close()
		return nil, 0, fmt.Errorf("get %s: %w", s.url+key, s3err(err))
	}
	return o, st.Size, nil
}

func (s *S3) ReadAt(ctx context.Context, key string, p []byte, off int64) (int, error) {
	k, err := s.key(key)
	if err != nil {
		return 0, err
	}
	var opts minio.GetObjectOptions
	if err := opts.SetRange(off, off+int64(len(p))-1); err != nil {
		return 0, err
	}
	// Core's GetObject is one request: no lazy re-opens behind our back.
	body, _, _, err := minio.Core{Client: s.c}.GetObject(ctx, s.bucket, k, opts)
	if err != nil {
		return 0, fmt.Errorf("read %s at %d: %w", s.url+key, off, s3err(err))
	}
	defer body.Close()
	n, err := io.ReadFull(body, p)
	if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
		err = nil
	}
	if err != nil {
		return n, fmt.Errorf("read %s at %d: %w", s.url+key, off, err)
	}
	return n, nil
}

func (s *S3) Stat(ctx context.Context, key string) (int64, error) {
	k, err := s.key(key)
	if err != nil {
		return 0, err
	}
	st, err := s.c.StatObject(ctx, s.bucket, k, minio.StatObjectOptions{})
	if err != nil {
		return 0, fmt.Errorf("stat %s: %w", s.url+key, s3err(err))
	}
	return st.Size, nil
}

// EnsureBucket creates the bucket if it does not exist (tests, first use).
func (s *S3) EnsureBucket(ctx context.Context) error {
	ok, err := s.c.BucketExists(ctx, s.bucket)
	if err != nil {
		return s3err(err)
	}
	if ok {
		return nil
	}
	return s3err(s.c.MakeBucket(ctx, s.bucket, minio.MakeBucketOptions{}))
}

func s3err(err error) error {
	if err == nil {
		return nil
	}
	if r := minio.ToErrorResponse(err); r.Code != "" || r.StatusCode != 0 {
		switch {
		case r.StatusCode == http.StatusNotFound || r.Code == "NoSuchKey" || r.Code == "NoSuchBucket":
			return fmt.Errorf("%v: %w", err, ErrNotFound)
		case r.StatusCode == http.StatusForbidden || r.StatusCode == http.StatusUnauthorized:
			return errdefs.Mark(errdefs.ErrPermissionDenied, err)
		}
	}
	return errdefs.Mark(errdefs.ErrUnavailable, err)
}

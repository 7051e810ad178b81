// Package shoal is the Go client of Shoal's API. The shoal CLI is built on
// it. Messages are the generated types of api/shoal/v1; this package adds
// authentication, configuration from the environment, streaming exec with
// stdin, and the streamed file transfers.
package shoal

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/api/shoal/v1/shoalv1connect"
)

// DefaultURL is where `shoal serve` listens by default.
const DefaultURL = "http://127.0.0.1:7480"

// DefaultKeyFile is read for the API key when none is given.
const DefaultKeyFile = "/var/lib/shoal/admin.key"

// Options configure a Client. Empty fields come from SHOAL_URL and
// SHOAL_API_KEY, then from DefaultURL and DefaultKeyFile.
type Options struct {
	URL        string
	APIKey     string
	HTTPClient *http.Client
	// TLS, for an https:// URL when HTTPClient is nil: CAFile is the CA
	// (PEM) that signed the server's certificate (default $SHOAL_CA, else
	// the system's roots); CertFile and KeyFile a client certificate to
	// present (default $SHOAL_CERT and $SHOAL_CERT_KEY).
	CAFile, CertFile, KeyFile string
}

// Client talks to one Shoal API endpoint. It is safe for concurrent use.
type Client struct {
	url       string
	key       string
	hc        *http.Client
	Sandboxes shoalv1connect.SandboxServiceClient
	Layers    shoalv1connect.LayerServiceClient
	Commands  shoalv1connect.CommandServiceClient
	// Admin: keys, tenants' quotas, the audit log (admin keys), and
	// WhoAmI (any key); see admin.go.
	Admin shoalv1connect.AdminServiceClient
}

// New returns a client.
func New(o Options) (*Client, error) {
	if o.URL == "" {
		o.URL = os.Getenv("SHOAL_URL")
	}
	if o.URL == "" {
		o.URL = DefaultURL
	}
	u, err := url.Parse(o.URL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("shoal URL %q must look like http://HOST:PORT", o.URL)
	}
	if o.APIKey == "" {
		o.APIKey = os.Getenv("SHOAL_API_KEY")
	}
	if o.APIKey == "" {
		if b, err := os.ReadFile(DefaultKeyFile); err == nil {
			o.APIKey = strings.TrimSpace(string(b))
		}
	}
	if o.HTTPClient == nil {
		tlsCfg, err := clientTLS(o)
		if err != nil {
			return nil, err
		}
		tr := &http.Transport{
			TLSClientConfig:     tlsCfg,
			ForceAttemptHTTP2:   true,
			Proxy:               http.ProxyFromEnvironment,
			DialContext:         (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConns:        1024,
			MaxIdleConnsPerHost: 1024,
			IdleConnTimeout:     90 * time.Second,
			// Uploads ask first (Expect: 100-continue): a refusal does
			// not cost sending the body.
			ExpectContinueTimeout: 5 * time.Second,
		}
		o.HTTPClient = &http.Client{Transport: tr}
	}
	c := &Client{url: strings.TrimRight(o.URL, "/"), key: o.APIKey}
	c.hc = &http.Client{Transport: &authTransport{key: o.APIKey, next: transportOf(o.HTTPClient)}, Timeout: o.HTTPClient.Timeout}
	// No gzip: Shoal's API is on the same host or in the same data center,
	// where compressing command output costs more CPU than it saves
	// (measured: deflate was half of serve's CPU while streaming output).
	noGzip := connect.WithAcceptCompression("gzip", nil, nil)
	c.Sandboxes = shoalv1connect.NewSandboxServiceClient(c.hc, c.url, noGzip)
	c.Layers = shoalv1connect.NewLayerServiceClient(c.hc, c.url, noGzip)
	c.Commands = shoalv1connect.NewCommandServiceClient(c.hc, c.url, noGzip)
	c.Admin = shoalv1connect.NewAdminServiceClient(c.hc, c.url, noGzip)
	return c, nil
}

// clientTLS is the TLS configuration of o (and the environment), nil for
// the default one.
func clientTLS(o Options) (*tls.Config, error) {
	env := func(v *string, name string) {
		if *v == "" {
			*v = os.Getenv(name)
		}
	}
	env(&o.CAFile, "SHOAL_CA")
	env(&o.CertFile, "SHOAL_CERT")
	env(&o.KeyFile, "SHOAL_CERT_KEY")
	if o.CAFile == "" && o.CertFile == "" && o.KeyFile == "" {
		return nil, nil
	}
	cfg, err := ClientTLS(o.CAFile, o.CertFile, o.KeyFile)
	if err != nil {
		return nil, fmt.Errorf("TLS ($SHOAL_CA, $SHOAL_CERT, $SHOAL_CERT_KEY): %w", err)
	}
	return cfg, nil
}

// ClientTLS is the TLS configuration of a client that trusts caFile's
// certificates (PEM; none: the system's roots) and, with certFile and
// keyFile, presents that certificate. Shoal's control replicas use it to
// call nodes too.
func ClientTLS(caFile, certFile, keyFile string) (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile != "" {
		b, err := os.ReadFile(caFile)
		if err != nil {
			return nil, fmt.Errorf("CA certificates: %w", err)
		}
		cfg.RootCAs = x509.NewCertPool()
		if !cfg.RootCAs.AppendCertsFromPEM(b) {
			return nil, fmt.Errorf("CA certificates %s: no PEM certificate in it", caFile)
		}
	}
	if (certFile == "") != (keyFile == "") {
		return nil, errors.New("a client certificate needs both its certificate file and its key file")
	}
	if certFile != "" {
		cert, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("TLS client certificate %s and key %s: %w", certFile, keyFile, err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}

func transportOf(hc *http.Client) http.RoundTripper {
	if hc.Transport != nil {
		return hc.Transport
	}
	return http.DefaultTransport
}

type authTransport struct {
	key  string
	next http.RoundTripper
}

// RoundTrip sends the key as X-API-Key, which the server reads first, so
// that a request to a sandbox's port (HTTPClient) keeps an Authorization
// header of its own for the app.
func (t *authTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if t.key != "" {
		r = r.Clone(r.Context())
		r.Header.Set("X-API-Key", t.key)
	}
	return t.next.RoundTrip(r)
}

// Create creates a sandbox and returns once it is ready for commands.
func (c *Client) Create(ctx context.Context, req *pb.CreateSandboxRequest) (*pb.Sandbox, error) {
	res, err := c.Sandboxes.CreateSandbox(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return res.Msg, nil
}

// Get returns one sandbox.
func (c *Client) Get(ctx context.Context, id string) (*pb.Sandbox, error) {
	res, err := c.Sandboxes.GetSandbox(ctx, connect.NewRequest(&pb.GetSandboxRequest{Id: id}))
	if err != nil {
		return nil, err
	}
	return res.Msg, nil
}

// List returns every sandbox.
func (c *Client) List(ctx context.Context) ([]*pb.Sandbox, error) {
	res, err := c.Sandboxes.ListSandboxes(ctx, connect.NewRequest(&pb.ListSandboxesRequest{}))
	if err != nil {
		return nil, err
	}
	return res.Msg.Sandboxes, nil
}

// Delete destroys a sandbox.
func (c *Client) Delete(ctx context.Context, id string) error {
	_, err := c.Sandboxes.DeleteSandbox(ctx, connect.NewRequest(&pb.DeleteSandboxRequest{Id: id}))
	return err
}

// SetTimeout sets a sandbox's idle timeout and restarts its clock.
func (c *Client) SetTimeout(ctx context.Context, id string, d time.Duration) (*pb.Sandbox, error) {
	res, err := c.Sandboxes.SetTimeout(ctx, connect.NewRequest(&pb.SetTimeoutRequest{Id: id, TimeoutSeconds: int64(d / time.Second)}))
	if err != nil {
		return nil, err
	}
	return res.Msg, nil
}

// Pause pauses a sandbox: its processes stop where they are and its memory
// is reclaimed; paused is false when it was paused already. The next
// request that needs the sandbox resumes it, or Resume does.
func (c *Client) Pause(ctx context.Context, id string) (sb *pb.Sandbox, paused bool, err error) {
	res, err := c.Sandboxes.PauseSandbox(ctx, connect.NewRequest(&pb.PauseSandboxRequest{Id: id}))
	if err != nil {
		return nil, false, err
	}
	return res.Msg.Sandbox, res.Msg.Paused, nil
}

// PauseFSOnly pauses a sandbox without its processes (E2B's keepMemory:
// false): they end (their commands and shells are closed) and only its
// files are kept; a resume has its files and none of its processes.
func (c *Client) PauseFSOnly(ctx context.Context, id string) (sb *pb.Sandbox, paused bool, err error) {
	res, err := c.Sandboxes.PauseSandbox(ctx, connect.NewRequest(&pb.PauseSandboxRequest{Id: id, FsOnly: true}))
	if err != nil {
		return nil, false, err
	}
	return res.Msg.Sandbox, res.Msg.Paused, nil
}

// Resume resumes a paused sandbox; resumed is false when it was not paused.
func (c *Client) Resume(ctx context.Context, id string) (sb *pb.Sandbox, resumed bool, err error) {
	res, err := c.Sandboxes.ResumeSandbox(ctx, connect.NewRequest(&pb.ResumeSandboxRequest{Id: id}))
	if err != nil {
		return nil, false, err
	}
	return res.Msg.Sandbox, res.Msg.Resumed, nil
}

// Reset brings a sandbox back to its start, in place: every process but
// its agent ends, its writable layer is replaced by an empty one, its
// commands and shells are closed with the reason "reset" (their streams end
// with FailedPrecondition, reason header "sandbox_reset"), and it keeps its
// ID, limits and network. took is how long the node's reset took.
func (c *Client) Reset(ctx context.Context, id string) (sb *pb.Sandbox, took time.Duration, err error) {
	res, err := c.Sandboxes.ResetSandbox(ctx, connect.NewRequest(&pb.ResetSandboxRequest{Id: id}))
	if err != nil {
		return nil, 0, err
	}
	return res.Msg.Sandbox, time.Duration(res.Msg.ResetSeconds * float64(time.Second)), nil
}

func (c *Client) fileURL(id, path string, q url.Values) string {
	if q == nil {
		q = url.Values{}
	}
	q.Set("path", path)
	return c.url + "/v1/sandboxes/" + url.PathEscape(id) + "/files?" + q.Encode()
}

// ReadFile streams a sandbox file into w.
func (c *Client) ReadFile(ctx context.Context, id, path string, w io.Writer) (int64, error) {
	return c.ReadFileAs(ctx, id, path, "", w)
}

// ReadFileAs is ReadFile as a sandbox user: the user's permissions are
// checked ("" = root).
func (c *Client) ReadFileAs(ctx context.Context, id, path, user string, w io.Writer) (int64, error) {
	var q url.Values
	if user != "" {
		q = url.Values{"user": {user}}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.fileURL(id, path, q), nil)
	if err != nil {
		return 0, err
	}
	res, err := c.hc.Do(req)
	if err != nil {
		return 0, err
	}
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK {
		return 0, httpError(res)
	}
	return io.Copy(w, res.Body)
}

// WriteFile streams r into a sandbox file (atomically replaced) with mode.
func (c *Client) WriteFile(ctx context.Context, id, path string, mode fs.FileMode, r io.Reader) (int64, error) {
	return c.WriteFileAs(ctx, id, path, "", mode, r)
}

// WriteFileAs is WriteFile as a sandbox user: the user's permissions are
// checked, and the file (and any directory made for it) belongs to the
// user ("" = root).
func (c *Client) WriteFileAs(ctx context.Context, id, path, user string, mode fs.FileMode, r io.Reader) (int64, error) {
	q := url.Values{"mode": {fmt.Sprintf("%04o", mode.Perm())}}
	if user != "" {
		q.Set("user", user)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPut, c.fileURL(id, path, q), r)
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/octet-stream")
	res, err := c.hc.Do(req)
	if err != nil {
		return 0, err
	}
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK {
		return 0, httpError(res)
	}
	var out struct {
		Bytes int64 `json:"bytes"`
	}
	if err := json.NewDecoder(res.Body).Decode(&out); err != nil {
		return 0, fmt.Errorf("decode write reply: %w", err)
	}
	return out.Bytes, nil
}

// httpError turns a JSON error reply of the file endpoints into a
// *connect.Error, so callers check one error type.
func httpError(res *http.Response) error {
	var body struct{ Code, Message string }
	b, _ := io.ReadAll(io.LimitReader(res.Body, 64<<10))
	if json.Unmarshal(b, &body) != nil || body.Message == "" {
		return connect.NewError(connect.CodeUnknown, fmt.Errorf("HTTP %s: %s", res.Status, bytes.TrimSpace(b)))
	}
	var code connect.Code
	if code.UnmarshalText([]byte(body.Code)) != nil {
		code = connect.CodeUnknown
	}
	return connect.NewError(code, errors.New(body.Message))
}

// BuildLayer builds a layer from a path on the server (inside one of its
// --build-root directories); progress (may be nil) receives progress lines.
// BuildLayerFrom uploads a local path instead.
func (c *Client) BuildLayer(ctx context.Context, req *pb.BuildLayerRequest, progress func(string)) (*pb.Layer, error) {
	stream, err := c.Layers.BuildLayer(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	defer stream.Close()
	for stream.Receive() {
		switch ev := stream.Msg().Event.(type) {
		case *pb.BuildLayerResponse_Progress:
			if progress != nil {
				progress(ev.Progress)
			}
		case *pb.BuildLayerResponse_Layer:
			drain(stream)
			return ev.Layer, nil
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	return nil, errors.New("build stream ended without a layer")
}

// URL is the server's base URL the client talks to.
func (c *Client) URL() string { return c.url }

// APIKey is the API key the client sends (from Options, SHOAL_API_KEY or
// the admin key file).
func (c *Client) APIKey() string { return c.key }

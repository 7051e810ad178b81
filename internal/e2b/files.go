package e2b

// envd's HTTP endpoints (spec/envd/envd.yaml of github.com/e2b-dev/E2B):
// GET /health, GET /envs, and file download (GET /files) and upload
// (POST /files, multipart/form-data or application/octet-stream, optionally
// gzip-encoded), streamed through the guest agent; plus the routing of the
// Connect RPCs.

import (
	"bufio"
	"compress/gzip"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"path"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/shoal-sandbox/shoal/api/e2b/filesystem/filesystemconnect"
	"github.com/shoal-sandbox/shoal/api/e2b/process/processconnect"
	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/limits"
	"github.com/shoal-sandbox/shoal/internal/node"
)

func (s *Server) envdRoutes() http.Handler {
	mux := http.NewServeMux()
	opts := []connect.HandlerOption{connect.WithReadMaxBytes(limits.MessageBytes), connect.WithCompressMinBytes(limits.CompressMinBytes)}
	mux.Handle(processconnect.NewProcessHandler(&processService{s: s}, opts...))
	mux.Handle(filesystemconnect.NewFilesystemHandler(&filesystemService{s: s}, opts...))
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		// A paused sandbox is not running to E2B's SDK (isRunning() is
		// false): its health does not resume it.
		if rec, err := s.node.Get(sandboxID(r.Context())); err == nil && rec.State == node.StatePaused {
			writeError(w, http.StatusBadGateway, fmt.Sprintf("sandbox %s is paused", rec.ID))
			return
		}
		if _, err := s.node.Agent(sandboxID(r.Context())); err != nil {
			writeError(w, http.StatusBadGateway, err.Error())
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	mux.HandleFunc("GET /envs", func(w http.ResponseWriter, r *http.Request) {
		rec, err := s.node.Get(sandboxID(r.Context()))
		if err != nil {
			writeErr(w, err)
			return
		}
		env := rec.Env
		if env == nil {
			env = map[string]string{}
		}
		writeJSON(w, http.StatusOK, env)
	})
	mux.HandleFunc("GET /files", s.downloadFile)
	mux.HandleFunc("POST /files", s.uploadFile)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotImplemented, fmt.Sprintf("the envd call %s %s is not supported by Shoal's E2B endpoint yet", r.Method, r.URL.Path))
	})
	return mux
}

// validSignature checks the signature of a pre-signed /files URL (the
// SDK's uploadUrl and downloadUrl): "v1_" + base64(sha256(
// "path:operation:username:token[:expiration]")).
func (s *Server) validSignature(r *http.Request, id string) error {
	q := r.URL.Query()
	op := "read"
	if r.Method == http.MethodPost {
		op = "write"
	}
	raw := q.Get("path") + ":" + op + ":" + q.Get("username") + ":" + s.envdToken(id)
	if exp := q.Get("signature_expiration"); exp != "" {
		n, err := strconv.ParseInt(exp, 10, 64)
		if err != nil {
			return errors.New("bad signature_expiration")
		}
		if time.Now().Unix() > n {
			return errors.New("the signature has expired")
		}
		raw += ":" + exp
	}
	sum := sha256.Sum256([]byte(raw))
	want := "v1_" + strings.TrimRight(base64.StdEncoding.EncodeToString(sum[:]), "=")
	if subtle.ConstantTimeCompare([]byte(q.Get("signature")), []byte(want)) != 1 {
		return errors.New("invalid signature")
	}
	return nil
}

// fileTarget resolves the path query parameter of a /files request.
func (s *Server) fileTarget(r *http.Request, p string) (string, *agent.Client, error) {
	id := sandboxID(r.Context())
	ag, err := s.node.Agent(id)
	if err != nil {
		return "", nil, err
	}
	uag, _, home, err := s.actAs(r.Context(), id, ag)
	if err != nil {
		return "", nil, err
	}
	abs, err := resolvePath(p, home)
	return abs, uag, err
}

func (s *Server) downloadFile(w http.ResponseWriter, r *http.Request) {
	p, ag, err := s.fileTarget(r, r.URL.Query().Get("path"))
	if err != nil {
		writeErr(w, err)
		return
	}
	rc, fi, err := ag.ReadFile(r.Context(), p)
	if err != nil {
		if codeOf(err) == connect.CodeNotFound {
			writeError(w, http.StatusNotFound, fmt.Sprintf("path '%s' does not exist", p))
			return
		}
		if ae := (*agent.Error)(nil); errors.As(err, &ae) && ae.Code == agent.CodeIsDir {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("path '%s' is a directory", p))
			return
		}
		writeErr(w, err)
		return
	}
	defer rc.Close()
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Disposition", mime.FormatMediaType("inline", map[string]string{"filename": path.Base(p)}))
	var out io.Writer = w
	if wantsGzip(r.Header.Get("Accept-Encoding")) {
		w.Header().Set("Content-Encoding", "gzip")
		bw := bufio.NewWriterSize(w, 256<<10) // fewer, larger chunks
		gz, _ := gzip.NewWriterLevel(bw, gzip.BestSpeed)
		defer bw.Flush()
		defer gz.Close()
		out = gz
	} else if fi.Size > 0 {
		// Not for size 0: files of /proc and /sys read more than they stat.
		w.Header().Set("Content-Length", strconv.FormatInt(fi.Size, 10))
		out = &limitWriter{w: w, n: fi.Size}
	}
	buf := make([]byte, 256<<10)
	if _, err := io.CopyBuffer(out, rc, buf); err != nil && !errors.Is(err, errLimit) {
		// After the first byte, only cutting the response short can say so.
		s.log.Warn("e2b: download", "sandbox_id", sandboxID(r.Context()), "path", p, "err", err)
		panic(http.ErrAbortHandler)
	}
}

var errLimit = errors.New("file grew while it was read")

// A gzip request body may expand to gzipFloor bytes, and past that to
// gzipRatio times what has been read of it compressed: a gzip bomb (deflate
// reaches ~1000:1 on zeros) is refused early, before it fills the
// sandbox's disk, with a message that says so; legitimate data rarely
// compresses past 256:1 (one that does is uploaded without gzip).
// Variables for the tests.
var (
	gzipFloor int64 = 64 << 20
	gzipRatio int64 = 256
)

// gunzip decompresses a request body within the bounds above.
type gunzip struct {
	gz       *gzip.Reader
	in       *countingReader
	out, max int64
}

type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

func newGunzip(r io.Reader) (*gunzip, error) {
	in := &countingReader{r: r}
	gz, err := gzip.NewReader(in)
	if err != nil {
		return nil, err
	}
	return &gunzip{gz: gz, in: in}, nil
}

func (g *gunzip) Read(p []byte) (int, error) {
	n, err := g.gz.Read(p)
	g.out += int64(n)
	if g.out > gzipFloor && g.out > gzipRatio*g.in.n {
		return n, errdefs.Mark(errdefs.ErrResourceExhausted, fmt.Errorf(
			"the gzip request body expands to more than %d times its compressed size (%s from %s so far): refused as a gzip bomb; "+
				"upload it without Content-Encoding: gzip: %w", gzipRatio, limits.Size(g.out), limits.Size(g.in.n), limits.ErrTooLarge))
	}
	return n, err
}

func (g *gunzip) Close() error { return g.gz.Close() }

// limitWriter writes at most n bytes (the Content-Length already sent).
type limitWriter struct {
	w io.Writer
	n int64
}

func (l *limitWriter) Write(p []byte) (int, error) {
	if int64(len(p)) > l.n {
		n, err := l.w.Write(p[:l.n])
		l.n -= int64(n)
		if err == nil {
			err = errLimit
		}
		return n, err
	}
	n, err := l.w.Write(p)
	l.n -= int64(n)
	return n, err
}

// wantsGzip reports whether a download should be gzip-compressed: only
// when the client asks for gzip alone, as the SDK's gzip option does.
// HTTP clients offer "gzip, deflate" by default; for them Shoal sends the
// bytes as they are, which identity always allows: compressing on the fly
// costs the host more CPU than it saves on a local network.
func wantsGzip(h string) bool {
	enc, params, _ := strings.Cut(strings.TrimSpace(h), ";")
	if !strings.EqualFold(strings.TrimSpace(enc), "gzip") {
		return false
	}
	for _, p := range strings.Split(params, ";") {
		if k, v, ok := strings.Cut(strings.TrimSpace(p), "="); ok && strings.TrimSpace(k) == "q" {
			if q, err := strconv.ParseFloat(strings.TrimSpace(v), 64); err == nil && q == 0 {
				return false
			}
		}
	}
	return true
}

// uploadEntry is envd's EntryInfo of the /files upload answer.
type uploadEntry struct {
	Path     string            `json:"path"`
	Name     string            `json:"name"`
	Type     string            `json:"type"`
	Metadata map[string]string `json:"metadata,omitempty"`
}

// metadataXattr is where envd keeps a file's metadata: user.e2b.KEY (the
// agent adds "user.").
const metadataXattr = "e2b."

// uploadMetadata reads an upload's X-Metadata-KEY: VALUE headers (the SDK's
// files.write(..., { metadata })). HTTP header names are case-insensitive,
// so keys are kept in lower case. The agent bounds their number and size.
func uploadMetadata(h http.Header) (map[string]string, error) {
	var meta map[string]string
	for k, vs := range h {
		key, ok := strings.CutPrefix(http.CanonicalHeaderKey(k), "X-Metadata-")
		if !ok {
			continue
		}
		if key == "" || len(vs) != 1 {
			return nil, fmt.Errorf("metadata header %q: want one X-Metadata-KEY: VALUE", k)
		}
		if meta == nil {
			meta = map[string]string{}
		}
		meta[strings.ToLower(key)] = vs[0]
	}
	return meta, nil
}

// xattrsOf is metadata as the agent's extended attributes, and back.
func xattrsOf(meta map[string]string) map[string]string {
	if len(meta) == 0 {
		return nil
	}
	x := make(map[string]string, len(meta))
	for k, v := range meta {
		x[metadataXattr+k] = v
	}
	return x
}

func metadataOf(xattrs map[string]string) map[string]string {
	var meta map[string]string
	for k, v := range xattrs {
		if key, ok := strings.CutPrefix(k, metadataXattr); ok && key != "" {
			if meta == nil {
				meta = map[string]string{}
			}
			meta[key] = v
		}
	}
	return meta
}

// maxUploadFiles bounds the files of one multipart upload.
const maxUploadFiles = 1000

func (s *Server) uploadFile(w http.ResponseWriter, r *http.Request) {
	meta, err := uploadMetadata(r.Header)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	var body io.Reader = r.Body
	switch enc := strings.ToLower(strings.TrimSpace(r.Header.Get("Content-Encoding"))); enc {
	case "", "identity":
	case "gzip":
		gz, err := newGunzip(r.Body)
		if err != nil {
			writeError(w, http.StatusBadRequest, "error decompressing request body: "+err.Error())
			return
		}
		defer gz.Close()
		body = gz
	default:
		writeError(w, http.StatusBadRequest, fmt.Sprintf("Content-Encoding %q: only gzip is supported", enc))
		return
	}
	// Streamed as it comes, but not endless (after decompression: a gzip
	// bomb stops here too).
	body = limits.Reader(body, limits.FileBytes, "upload")
	qpath := r.URL.Query().Get("path")
	mediaType, params, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	var out []uploadEntry
	switch {
	case mediaType == "application/octet-stream":
		if qpath == "" {
			writeError(w, http.StatusBadRequest, "path query parameter is required for raw body upload")
			return
		}
		e, status, err := s.writeOne(r, qpath, body, meta)
		if err != nil {
			writeError(w, status, err.Error())
			return
		}
		out = append(out, e)
	case strings.HasPrefix(mediaType, "multipart/"):
		if params["boundary"] == "" {
			writeError(w, http.StatusBadRequest, "multipart upload without a boundary")
			return
		}
		mr := multipart.NewReader(body, params["boundary"])
		seen := map[string]bool{}
		for {
			part, err := mr.NextPart()
			if err == io.EOF {
				break
			}
			if err != nil {
				writeError(w, http.StatusBadRequest, "error reading form: "+err.Error())
				return
			}
			if part.FormName() != "file" {
				part.Close()
				continue
			}
			target := qpath
			if target == "" {
				// The part's file name, with its directories (which
				// mime/multipart's FileName strips).
				_, dp, _ := mime.ParseMediaType(part.Header.Get("Content-Disposition"))
				target = dp["filename"]
			}
			if target == "" {
				part.Close()
				writeError(w, http.StatusBadRequest, "a file part has no file name and the request no path")
				return
			}
			if len(seen) >= maxUploadFiles {
				part.Close()
				writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("more than %d files in one upload request: split it", maxUploadFiles))
				return
			}
			if seen[target] {
				part.Close()
				writeError(w, http.StatusBadRequest, fmt.Sprintf("you cannot upload multiple files to the same path '%s' in one upload request", target))
				return
			}
			seen[target] = true
			e, status, err := s.writeOne(r, target, part, meta)
			part.Close()
			if err != nil {
				writeError(w, status, err.Error())
				return
			}
			out = append(out, e)
		}
	default:
		writeError(w, http.StatusBadRequest, fmt.Sprintf("unsupported content type: %s, expected multipart/form-data or application/octet-stream", r.Header.Get("Content-Type")))
		return
	}
	if out == nil {
		out = []uploadEntry{}
	}
	writeJSON(w, http.StatusOK, out)
}

// writeOne writes one uploaded file (atomically, creating its parents).
func (s *Server) writeOne(r *http.Request, target string, src io.Reader, meta map[string]string) (uploadEntry, int, error) {
	p, ag, err := s.fileTarget(r, target)
	if err != nil {
		return uploadEntry{}, httpStatusOf(err), err
	}
	if fi, err := ag.Stat(r.Context(), p); err == nil && fi.IsDir {
		return uploadEntry{}, http.StatusBadRequest, fmt.Errorf("path is a directory: %s", p)
	}
	if _, err := ag.WriteFileXattrs(r.Context(), p, 0o644, src, xattrsOf(meta)); err != nil {
		return uploadEntry{}, httpStatusOf(err), err
	}
	return uploadEntry{Path: p, Name: path.Base(p), Type: "file", Metadata: meta}, http.StatusOK, nil
}

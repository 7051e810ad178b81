package shoal

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
)

// LayerProgress receives the progress of a layer build or commit: a line at
// each stage (status nil), or a status update for a progress bar (line "").
type LayerProgress func(line string, status *pb.BuildProgress)

// BuildLayerProgress builds a layer from a path on the server (which must
// be inside a directory the server was given with --build-root), reporting
// lines and status updates to progress (which may be nil). To build from
// this machine's files, use BuildLayerFrom.
func (c *Client) BuildLayerProgress(ctx context.Context, req *pb.BuildLayerRequest, progress LayerProgress) (*pb.Layer, error) {
	stream, err := c.Layers.BuildLayer(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return receiveLayer(stream, progress)
}

// CommitLayer turns a sandbox's writable layer into a new workspace or
// toolkit layer, reporting progress like BuildLayerProgress.
func (c *Client) CommitLayer(ctx context.Context, req *pb.CommitLayerRequest, progress LayerProgress) (*pb.Layer, error) {
	stream, err := c.Layers.CommitLayer(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return receiveLayer(stream, progress)
}

// PushLayer copies a layer of the server to the server's layer store
// (shoal serve --layer-store), reporting lines and byte counts ("upload",
// then "chunks") to progress (which may be nil), as BuildLayerProgress does.
func (c *Client) PushLayer(ctx context.Context, req *pb.PushLayerRequest, progress LayerProgress) (*pb.PushLayerResponse, error) {
	stream, err := c.Layers.PushLayerProgress(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	defer stream.Close()
	for stream.Receive() {
		switch ev := stream.Msg().Event.(type) {
		case *pb.PushLayerEvent_Progress:
			if progress != nil {
				progress(ev.Progress, nil)
			}
		case *pb.PushLayerEvent_Status:
			if progress != nil {
				progress("", ev.Status)
			}
		case *pb.PushLayerEvent_Result:
			drain(stream)
			return ev.Result, nil
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	return nil, errors.New("push stream ended without a result")
}

func receiveLayer(stream *connect.ServerStreamForClient[pb.BuildLayerResponse], progress LayerProgress) (*pb.Layer, error) {
	defer stream.Close()
	for stream.Receive() {
		switch ev := stream.Msg().Event.(type) {
		case *pb.BuildLayerResponse_Progress:
			if progress != nil {
				progress(ev.Progress, nil)
			}
		case *pb.BuildLayerResponse_Status:
			if progress != nil {
				progress("", ev.Status)
			}
		case *pb.BuildLayerResponse_Layer:
			drain(stream)
			return ev.Layer, nil
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	return nil, errors.New("layer stream ended without a layer")
}

// BuildLayerFrom builds a layer from a local path, uploading it: a
// directory is sent as a tar made on the fly (WriteTar: owners, modes,
// links and xattrs kept, so the layer has the digest a build from the same
// directory on the server has), a file (a tarball, an OCI layout tar, a
// docker-archive) as it is. req.Source is ignored (the path is sent as the
// upload's description); progress gets an "upload" stage, then the build's.
func (c *Client) BuildLayerFrom(ctx context.Context, req *pb.BuildLayerRequest, path string, progress LayerProgress) (*pb.Layer, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	r := proto.Clone(req).(*pb.BuildLayerRequest)
	r.Source = path
	if abs, err := filepath.Abs(path); err == nil {
		r.Source = abs
	}
	if fi.IsDir() {
		pr, pw := io.Pipe()
		defer pr.Close() // stops the tar writer if the request ends first
		go func() { pw.CloseWithError(WriteTar(pw, path)) }()
		return c.BuildLayerUpload(ctx, r, pr, -1, progress)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is neither a directory nor a file", path)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return c.BuildLayerUpload(ctx, r, f, fi.Size(), progress)
}

// BuildLayerUpload builds a layer from body: a tar stream (plain, gzip or
// zstd), an OCI image layout as a tar, or a docker-archive, told apart by
// content. size is body's length, or -1 if unknown (sent chunked).
// req.Source, if set, describes the upload in the layer's record. Progress
// is reported as for BuildLayerProgress, after an "upload" stage.
func (c *Client) BuildLayerUpload(ctx context.Context, req *pb.BuildLayerRequest, body io.Reader, size int64, progress LayerProgress) (*pb.Layer, error) {
	q := url.Values{"kind": {kindParam(req.Kind)}, "ref": {req.Ref}}
	for k, v := range map[string]string{"compression": req.Compression, "image": req.Image, "source": req.Source} {
		if v != "" {
			q.Set(k, v)
		}
	}
	if progress != nil {
		what := "uploading"
		if req.Source != "" {
			what += " " + req.Source
		}
		progress(what, nil)
		body = &uploadCounter{r: body, total: max(size, 0), progress: progress}
	}
	res, err := c.postTar(ctx, "/v1/layers/build?"+q.Encode(), body, size)
	if err != nil {
		return nil, err
	}
	defer res.Body.Close()
	sc := bufio.NewScanner(res.Body)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if len(bytes.TrimSpace(line)) == 0 {
			continue
		}
		var end struct {
			Error *struct{ Code, Message string } `json:"error"`
		}
		if json.Unmarshal(line, &end) == nil && end.Error != nil {
			var code connect.Code
			if code.UnmarshalText([]byte(end.Error.Code)) != nil {
				code = connect.CodeUnknown
			}
			return nil, connect.NewError(code, errors.New(end.Error.Message))
		}
		ev := &pb.BuildLayerResponse{}
		if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(line, ev); err != nil {
			return nil, fmt.Errorf("build reply: %w", err)
		}
		switch e := ev.Event.(type) {
		case *pb.BuildLayerResponse_Progress:
			if progress != nil {
				progress(e.Progress, nil)
			}
		case *pb.BuildLayerResponse_Status:
			if progress != nil {
				progress("", e.Status)
			}
		case *pb.BuildLayerResponse_Layer:
			return e.Layer, nil
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return nil, errors.New("layer build reply ended without a layer")
}

func kindParam(k pb.LayerKind) string {
	switch k {
	case pb.LayerKind_LAYER_KIND_BASE:
		return "base"
	case pb.LayerKind_LAYER_KIND_WORKSPACE:
		return "workspace"
	case pb.LayerKind_LAYER_KIND_TOOLKIT:
		return "toolkit"
	}
	return ""
}

// uploadCounter reports the bytes read through it as the "upload" stage,
// at most every 100 ms.
type uploadCounter struct {
	r        io.Reader
	n, total int64
	last     time.Time
	progress LayerProgress
}

func (u *uploadCounter) Read(p []byte) (int, error) {
	n, err := u.r.Read(p)
	u.n += int64(n)
	if now := time.Now(); now.Sub(u.last) >= 100*time.Millisecond || err == io.EOF {
		u.last = now
		u.progress("", &pb.BuildProgress{Stage: "upload", Done: u.n, Total: u.total, Unit: "bytes"})
	}
	return n, err
}

// ExportLayer streams the layer ref names (its EROFS image and metadata, in
// the export format) into w and returns the bytes written.
func (c *Client) ExportLayer(ctx context.Context, ref string, w io.Writer) (int64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.url+"/v1/layers/export?"+url.Values{"ref": {ref}}.Encode(), nil)
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

// ImportLayer sends a layer in the export format (from ExportLayer) to the
// server, which verifies its digest before storing it. tag, if not empty,
// replaces the tag recorded in the export ("name:version").
func (c *Client) ImportLayer(ctx context.Context, r io.Reader, tag string) (*pb.Layer, error) {
	u := c.url + "/v1/layers/import"
	if tag != "" {
		u += "?" + url.Values{"tag": {tag}}.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, r)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/x-tar")
	res, err := c.hc.Do(req)
	if err != nil {
		return nil, err
	}
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK {
		return nil, httpError(res)
	}
	b, err := io.ReadAll(io.LimitReader(res.Body, 1<<20))
	if err != nil {
		return nil, err
	}
	l := &pb.Layer{}
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(b, l); err != nil {
		return nil, err
	}
	return l, nil
}

// postTar POSTs a tar body of size bytes (-1: unknown, sent chunked) to
// path (with its query) and returns the answer when it is 200, its body
// for the caller to read and close. The server's refusals (a bad request,
// too big, no key) come before the body is sent (Expect: 100-continue).
func (c *Client) postTar(ctx context.Context, path string, body io.Reader, size int64) (*http.Response, error) {
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, c.url+path, io.NopCloser(body))
	if err != nil {
		return nil, err
	}
	hreq.ContentLength = size
	if size == 0 {
		hreq.Body = http.NoBody
	}
	hreq.Header.Set("Content-Type", "application/x-tar")
	hreq.Header.Set("Expect", "100-continue")
	res, err := c.hc.Do(hreq)
	if err != nil {
		return nil, err
	}
	if res.StatusCode != http.StatusOK {
		defer res.Body.Close()
		return nil, httpError(res)
	}
	return res, nil
}

package shoal

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/url"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
)

// LayerProgress receives the progress of a layer build or commit: a line at
// each stage (status nil), or a status update for a progress bar (line "").
type LayerProgress func(line string, status *pb.BuildProgress)

// BuildLayerProgress builds a layer from a path on the server, reporting
// lines and status updates to progress (which may be nil).
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
			return ev.Layer, nil
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	return nil, errors.New("layer stream ended without a layer")
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

package shoal

import (
	"context"
	"errors"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/api/shoal/v1/shoalv1connect"
)

// FnCallClient runs judged one-shot calls (FnCallService): source code in
// a language, compiled once and run on test cases under limits, from the
// server's warm pools.
type FnCallClient struct {
	svc shoalv1connect.FnCallServiceClient
}

// FnCall returns the client of FnCallService.
//
//	res, err := c.FnCall().Run(ctx, &pb.RunRequest{Language: "python", Source: "print(1)"})
//	// res.Verdict == pb.Verdict_VERDICT_OK, res.Tests[0].Stdout == "1\n"
func (c *Client) FnCall() *FnCallClient {
	return &FnCallClient{svc: shoalv1connect.NewFnCallServiceClient(c.hc, c.url, connect.WithAcceptCompression("gzip", nil, nil))}
}

// Run judges one call. A malformed call is an invalid_argument error; a
// program that fails is not an error (see the verdicts).
func (f *FnCallClient) Run(ctx context.Context, req *pb.RunRequest) (*pb.RunResult, error) {
	res, err := f.svc.Run(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return res.Msg, nil
}

// RunBatch judges many calls; fn receives each result as soon as it is done
// (in completion order; RunBatchResult.Index is the call's position in
// calls). concurrency 0 means the server's capacity. A call that fails
// gets an SE result; an error from fn stops the batch and is returned.
func (f *FnCallClient) RunBatch(ctx context.Context, calls []*pb.RunRequest, concurrency int, fn func(*pb.RunBatchResult) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := f.svc.RunBatch(ctx, connect.NewRequest(&pb.RunBatchRequest{Calls: calls, Concurrency: int32(concurrency)}))
	if err != nil {
		return err
	}
	defer stream.Close()
	n := 0
	for stream.Receive() {
		n++
		if err := fn(stream.Msg()); err != nil {
			return err
		}
	}
	if err := stream.Err(); err != nil {
		return err
	}
	if n != len(calls) {
		return errors.New("batch stream ended before every result arrived")
	}
	return nil
}

// Languages lists the languages the server runs.
func (f *FnCallClient) Languages(ctx context.Context) ([]*pb.Language, error) {
	res, err := f.svc.ListLanguages(ctx, connect.NewRequest(&pb.ListLanguagesRequest{}))
	if err != nil {
		return nil, err
	}
	return res.Msg.Languages, nil
}

package control

import (
	"context"

	"github.com/shoal-sandbox/shoal/internal/limits"
	"github.com/shoal-sandbox/shoal/internal/tenant"
)

// SetStreams sets the caps on concurrent streams (limits.Streams) that
// command streams, watches and port connections count against; nil (the
// default) bounds none. Set before serving.
func (s *Server) SetStreams(st *limits.Streams) { s.streams = st }

// keyOf names the API key of a request for limits.Streams ("": none).
func keyOf(ctx context.Context) string {
	p := tenant.FromContext(ctx)
	if p == nil {
		return ""
	}
	return p.Tenant + "/" + p.Key
}

// holdStream counts a stream of sandboxID for the request's key, or
// refuses it (resource_exhausted); the caller releases it when the stream
// ends.
func (s *Server) holdStream(ctx context.Context, sandboxID, what string) (release func(), err error) {
	release, err = s.streams.Acquire(sandboxID, keyOf(ctx), what)
	if err != nil {
		return nil, toConnect(err)
	}
	return release, nil
}

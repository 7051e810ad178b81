package e2b

import (
	"context"

	"github.com/shoal-sandbox/shoal/internal/limits"
	"github.com/shoal-sandbox/shoal/internal/tenant"
)

// SetStreams sets the caps on concurrent streams (limits.Streams, shared
// with Shoal's API) that process streams, watches and port connections
// count against; nil bounds none. Set before serving.
func (s *Server) SetStreams(st *limits.Streams) { s.streams = st }

// holdStream counts a stream of sandbox id for the request's API key, if
// it has one (a public port's requests have none), or refuses it:
// resource_exhausted, 429 on the REST faces and the port proxy.
func (s *Server) holdStream(ctx context.Context, id, what string) (release func(), err error) {
	key := ""
	if p := tenant.FromContext(ctx); p != nil {
		key = p.Tenant + "/" + p.Key
	}
	release, err = s.streams.Acquire(id, key, what)
	if err != nil {
		return nil, toConnect(err)
	}
	return release, nil
}

package shoal

import (
	"errors"
	"testing"

	"connectrpc.com/connect"
)

// TestStreamBroke: Exec attaches again only after a stream that broke,
// never after one the server ended with an answer (a killed sandbox's
// command can no longer be attached to: attaching again would replace the
// answer with "no sandbox").
func TestStreamBroke(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		{errors.New("command stream ended without an exit status"), true},
		{connect.NewError(connect.CodeUnavailable, errors.New("eof")), true},
		{connect.NewError(connect.CodeInternal, errors.New("stream reset")), true},
		{connect.NewError(connect.CodeNotFound, errors.New("sandbox x was killed")), false},
		{&SandboxKilledError{Err: connect.NewError(connect.CodeNotFound, errors.New("killed"))}, false},
		{connect.NewError(connect.CodeAborted, errors.New("lost")), false},
	} {
		if got := streamBroke(c.err); got != c.want {
			t.Errorf("streamBroke(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}

package control

import (
	"errors"
	"testing"

	"connectrpc.com/connect"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// A sandbox killed under an operation maps to NotFound (the sandbox is
// gone) with a reason that tells it from any other NotFound.
func TestToConnectSandboxKilled(t *testing.T) {
	err := toConnect(errdefs.New(errdefs.ErrSandboxKilled, "sandbox abc was killed (deleted) while command x ran: the command did not exit"))
	var ce *connect.Error
	if !errors.As(err, &ce) || ce.Code() != connect.CodeNotFound || ce.Meta().Get(ReasonHeader) != ReasonSandboxKilled {
		t.Fatalf("toConnect(killed) = %v (meta %v), want not_found with %s: %s", err, ce.Meta(), ReasonHeader, ReasonSandboxKilled)
	}
	if ce.Message() != "sandbox abc was killed (deleted) while command x ran: the command did not exit" {
		t.Errorf("message %q", ce.Message())
	}
	if ce := toConnect(errdefs.New(errdefs.ErrNotFound, "no sandbox abc")).(*connect.Error); ce.Meta().Get(ReasonHeader) != "" {
		t.Errorf("a plain NotFound has reason %q", ce.Meta().Get(ReasonHeader))
	}
}

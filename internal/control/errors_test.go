package control

import (
	"errors"
	"fmt"
	"testing"

	"connectrpc.com/connect"

	"github.com/shoal-sandbox/shoal/internal/agent"
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

// An executable that is missing or cannot be executed is named by a reason
// (what `shoal exec` turns into exit codes 127 and 126); a missing working
// directory or sandbox is not.
func TestToConnectExecReasons(t *testing.T) {
	wrap := func(ae *agent.Error) error { return fmt.Errorf("start [\"x\"] in sandbox abc: %w", ae) }
	for _, c := range []struct {
		err    error
		code   connect.Code
		reason string
	}{
		{wrap(&agent.Error{Op: "exec", Path: "nosuch", Code: agent.CodeNotExist, Msg: "executable file not found in $PATH"}), connect.CodeNotFound, ReasonCommandNotFound},
		{wrap(&agent.Error{Op: "exec", Path: "/tmp", Code: agent.CodePermission, Msg: "exec /tmp: permission denied"}), connect.CodePermissionDenied, ReasonCommandNotExecutable},
		{wrap(&agent.Error{Op: "exec", Path: "/x", Code: agent.CodeIO, Msg: "exec /x: exec format error"}), connect.CodeInvalidArgument, ReasonCommandNotExecutable},
		{wrap(&agent.Error{Op: "exec", Path: "ls", Code: agent.CodeNotExist, Msg: "cwd /nope: no such file or directory"}), connect.CodeNotFound, ""},
		{wrap(&agent.Error{Op: "exec", Path: "ls", Code: agent.CodeIO, Msg: "too many open files"}), connect.CodeInternal, ""},
		{&agent.Error{Op: "read", Path: "/x", Code: agent.CodeNotExist, Msg: "no such file"}, connect.CodeNotFound, ""},
		{errdefs.New(errdefs.ErrNotFound, "no sandbox abc"), connect.CodeNotFound, ""},
	} {
		ce := toConnect(c.err).(*connect.Error)
		if ce.Code() != c.code || ce.Meta().Get(ReasonHeader) != c.reason {
			t.Errorf("toConnect(%v) = %v reason %q, want %v reason %q", c.err, ce.Code(), ce.Meta().Get(ReasonHeader), c.code, c.reason)
		}
	}
}

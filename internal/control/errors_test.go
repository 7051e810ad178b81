package control

import (
	"context"
	"errors"
	"fmt"
	"net/http/httptest"
	"syscall"
	"testing"

	"connectrpc.com/connect"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/e2b"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/limits"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
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
		{wrap(&agent.Error{Op: "exec", Path: "ls", Code: agent.CodeInvalid, Msg: "user nosuch: no such user in the sandbox's /etc/passwd"}), connect.CodeInvalidArgument, ""},
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

// Every kind of error maps to its code through errdefs.Code: the errdefs
// kinds, the layer store's errors (which carry kinds), the fs sentinels the
// agent's errors unwrap to, a full disk, and context errors.
func TestToConnectKinds(t *testing.T) {
	for _, c := range []struct {
		err  error
		code connect.Code
	}{
		{errdefs.New(errdefs.ErrInvalidArgument, "x"), connect.CodeInvalidArgument},
		{fmt.Errorf("resolve: %w", layer.ErrInvalidRef), connect.CodeInvalidArgument},
		{fmt.Errorf("resolve: %w", layer.ErrNotFound), connect.CodeNotFound},
		{fmt.Errorf("rm: %w", layer.ErrInUse), connect.CodeFailedPrecondition},
		{&agent.Error{Op: "read", Code: agent.CodeNotExist, Msg: "x"}, connect.CodeNotFound},
		{&agent.Error{Op: "mkdir", Code: agent.CodeExist, Msg: "x"}, connect.CodeAlreadyExists},
		{&agent.Error{Op: "write", Code: agent.CodePermission, Msg: "x"}, connect.CodePermissionDenied},
		{&agent.Error{Op: "write", Code: agent.CodeIsDir, Msg: "x"}, connect.CodeInvalidArgument},
		{&agent.Error{Op: "write", Code: agent.CodeNoSpace, Msg: "x"}, connect.CodeResourceExhausted},
		{fmt.Errorf("persist: %w", syscall.ENOSPC), connect.CodeResourceExhausted},
		{errdefs.New(errdefs.ErrPermissionDenied, "x"), connect.CodePermissionDenied},
		{errdefs.New(errdefs.ErrUnavailable, "node full"), connect.CodeUnavailable},
		{fmt.Errorf("x: %w", context.DeadlineExceeded), connect.CodeDeadlineExceeded},
		{context.Canceled, connect.CodeCanceled},
		{errors.New("something else"), connect.CodeInternal},
	} {
		if got := toConnect(c.err).(*connect.Error).Code(); got != c.code {
			t.Errorf("toConnect(%v) = %v, want %v", c.err, got, c.code)
		}
	}
	// Output read from where the log budget pruned it: out of range, with
	// the reason.
	ce := toConnect(fmt.Errorf("events: %w", errdefs.New(errdefs.ErrLogPruned, "x: re-attach from offset 7"))).(*connect.Error)
	if ce.Code() != connect.CodeOutOfRange || ce.Meta().Get(ReasonHeader) != ReasonLogPruned {
		t.Errorf("log pruned: %v %q, want out_of_range with reason %s", ce.Code(), ce.Meta().Get(ReasonHeader), ReasonLogPruned)
	}
}

// Every refusal a backend makes reaches both API faces with the status
// errdefs' table gives its kind (a backend's ErrUnsupported was a 500).
func TestBackendRefusalsOnBothFaces(t *testing.T) {
	for _, c := range []struct {
		err        error
		shoal, e2b int
	}{
		// microvm.Create: more layers than a VM takes; no disk limits.
		{fmt.Errorf("microvm backend: 40 layers: a VM takes 1 to 30: %w", sandbox.ErrUnsupported), 501, 501},
		{fmt.Errorf("microvm backend: no disk limits on this node (none): %w", sandbox.ErrUnsupported), 501, 501},
		// container.Create / microvm: egress asked of a node without it.
		{fmt.Errorf("container backend: network egress is disabled on this node (serve --egress-subnet): %w%.0w", sandbox.ErrUnsupported, errdefs.ErrFailedPrecondition), 400, 409},
		// a sandbox whose runtime state is gone.
		{fmt.Errorf("recover x: %w", sandbox.ErrNotFound), 404, 404},
		// the guest agent: a full disk, an operation it does not know.
		{&agent.Error{Op: "write", Code: agent.CodeNoSpace, Msg: "no space left on device"}, 429, 507},
		{&agent.Error{Op: "rename", Code: agent.CodeUnsupported, Msg: "unknown op"}, 501, 501},
		{limits.TooLarge("upload", 1<<20), 413, 413},
	} {
		rec := httptest.NewRecorder()
		writeConnectError(rec, c.err)
		if rec.Code != c.shoal {
			t.Errorf("Shoal's face: %v: status %d, want %d", c.err, rec.Code, c.shoal)
		}
		rec = httptest.NewRecorder()
		e2b.WriteErr(rec, c.err)
		if rec.Code != c.e2b {
			t.Errorf("E2B face: %v: status %d, want %d", c.err, rec.Code, c.e2b)
		}
	}
}

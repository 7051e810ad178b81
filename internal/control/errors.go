package control

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"connectrpc.com/connect"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// ReasonHeader is the error metadata (a Connect trailer, gRPC trailer or
// HTTP header) that names an error more precisely than its code:
// ReasonSandboxKilled on a NotFound error means the sandbox was deleted
// (killed by a client or by its timeout) while the operation ran; for a
// command stream, that the command did not exit but was killed with it.
//
// ReasonCommandNotFound (NotFound) and ReasonCommandNotExecutable
// (PermissionDenied, InvalidArgument) name a command that could not start
// because its executable does not exist, or exists but cannot be executed
// (a directory, no x bit, not a binary): what shells and docker exec report
// as exit codes 127 and 126, and what `shoal exec` exits with.
const (
	ReasonHeader               = "Shoal-Error-Reason"
	ReasonSandboxKilled        = "sandbox_killed"
	ReasonCommandNotFound      = "command_not_found"
	ReasonCommandNotExecutable = "command_not_executable"
	// ReasonLogPruned (OutOfRange): a command's output was read from an
	// offset its sandbox's log budget pruned; the message names the first
	// offset kept.
	ReasonLogPruned = "log_pruned"
	// ReasonSandboxReset (FailedPrecondition): the command or shell was
	// closed by a reset of its sandbox (the sandbox lives on).
	ReasonSandboxReset = "sandbox_reset"
)

// toConnect maps an internal error to a connect error with the right code.
// The message is the error's own text, which says what was being done.
func toConnect(err error) error {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce
	}
	if errors.Is(err, errdefs.ErrSandboxKilled) {
		// The sandbox is gone, as every later call about it will say
		// (NotFound); the reason tells it from any other NotFound.
		ce := connect.NewError(connect.CodeNotFound, err)
		ce.Meta().Set(ReasonHeader, ReasonSandboxKilled)
		return ce
	}
	if errors.Is(err, errdefs.ErrSandboxReset) {
		ce := connect.NewError(connect.CodeFailedPrecondition, err)
		ce.Meta().Set(ReasonHeader, ReasonSandboxReset)
		return ce
	}
	if errors.Is(err, errdefs.ErrLogPruned) {
		ce := connect.NewError(connect.CodeOutOfRange, err)
		ce.Meta().Set(ReasonHeader, ReasonLogPruned)
		return ce
	}
	// A directory that is not empty is a state to change, not a conflict
	// of names: the agent's not_empty also unwraps to fs.ErrExist (so
	// callers testing for "exists" keep working), but it is not one.
	var ae *agent.Error
	if errors.As(err, &ae) && ae.Op == "exec" {
		if ce := execError(err, ae); ce != nil {
			return ce
		}
	}
	if errors.As(err, &ae) && ae.Code == agent.CodeNotEmpty {
		if ae.Op == "remove" {
			return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("%w: pass recursive to remove a directory with everything in it", err))
		}
		return connect.NewError(connect.CodeFailedPrecondition, err)
	}
	return connect.NewError(connectCode(err), err)
}

// connectCode is the Connect code of err's kind (errdefs.Code, the one
// classification of errors).
func connectCode(err error) connect.Code {
	var c connect.Code
	if c.UnmarshalText([]byte(errdefs.Code(err))) != nil {
		return connect.CodeInternal
	}
	return c
}

// execError names the agent's refusal to start a command's executable, or
// returns nil for another failure of an exec.
func execError(err error, ae *agent.Error) *connect.Error {
	if strings.HasPrefix(ae.Msg, "cwd ") || strings.HasPrefix(ae.Msg, "user ") {
		return nil // the working directory or the user, not the executable (agent/exec.go, users.go)
	}
	var code connect.Code
	var reason string
	switch ae.Code {
	case agent.CodeNotExist:
		code, reason = connect.CodeNotFound, ReasonCommandNotFound
	case agent.CodePermission:
		code, reason = connect.CodePermissionDenied, ReasonCommandNotExecutable
	case agent.CodeIsDir, agent.CodeInvalid:
		code, reason = connect.CodeInvalidArgument, ReasonCommandNotExecutable
	case agent.CodeIO:
		if !strings.Contains(ae.Msg, "exec format error") {
			return nil
		}
		code, reason = connect.CodeInvalidArgument, ReasonCommandNotExecutable
	default:
		return nil
	}
	ce := connect.NewError(code, err)
	ce.Meta().Set(ReasonHeader, reason)
	return ce
}

// writeConnectError writes err as a Connect-style JSON error body for the
// plain HTTP endpoints, with the status errdefs' table gives its code on
// Shoal's face.
func writeConnectError(w http.ResponseWriter, err error) {
	var ce *connect.Error
	if !errors.As(err, &ce) {
		ce = toConnect(err).(*connect.Error)
	}
	writeHTTPError(w, errdefs.StatusFor(errdefs.FaceShoal, ce.Code().String(), err), ce.Code().String(), ce.Message())
}

func writeHTTPError(w http.ResponseWriter, status int, code, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(map[string]string{"code": code, "message": msg})
}

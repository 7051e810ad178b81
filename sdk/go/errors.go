package shoal

import (
	"errors"
	"strings"

	"connectrpc.com/connect"
)

// ErrSandboxKilled matches (errors.Is) the error of a command stream (Exec,
// Attach) whose sandbox was deleted, by a client or by its timeout, while
// the command ran: the command did not exit, it was killed with its
// sandbox. The error is also a *connect.Error with code NotFound (the
// sandbox is gone) naming the sandbox.
var ErrSandboxKilled = errors.New("sandbox killed")

// The error metadata with which the server names a killed sandbox
// (internal/control.ReasonHeader).
const (
	reasonHeader        = "Shoal-Error-Reason"
	reasonSandboxKilled = "sandbox_killed"
)

// SandboxKilledError is the error of a command whose sandbox was killed
// under it. errors.Is(err, ErrSandboxKilled) holds, and errors.As finds the
// server's *connect.Error.
type SandboxKilledError struct {
	Err *connect.Error
}

func (e *SandboxKilledError) Error() string   { return e.Err.Error() }
func (e *SandboxKilledError) Unwrap() []error { return []error{e.Err, ErrSandboxKilled} }

// streamErr names the errors of a command stream that have a name.
func streamErr(err error) error {
	var ce *connect.Error
	if err == nil || !errors.As(err, &ce) || ce.Code() != connect.CodeNotFound {
		return err
	}
	if ce.Meta().Get(reasonHeader) == reasonSandboxKilled ||
		strings.Contains(ce.Message(), " was killed (deleted) while command ") {
		return &SandboxKilledError{Err: ce}
	}
	return err
}

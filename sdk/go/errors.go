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

// ErrCommandReset matches (errors.Is) the error of a command stream
// (Exec, Attach) whose command was closed by a reset of its sandbox
// (Client.Reset): its process was killed, the sandbox lives on. The error
// is also a *connect.Error with code FailedPrecondition.
var ErrCommandReset = errors.New("command closed by a sandbox reset")

// ErrCommandNotFound and ErrCommandNotExecutable match (errors.Is) the
// error of Exec or Start whose command could not start: its executable does
// not exist (not in PATH, or no such file), or exists but cannot be
// executed (a directory, no execute permission, not a binary). Shells and
// `docker exec` report these as exit codes 127 and 126; so does `shoal
// exec`. The error is also the server's *connect.Error.
var (
	ErrCommandNotFound      = errors.New("command not found")
	ErrCommandNotExecutable = errors.New("command not executable")
)

// The error metadata with which the server names an error more precisely
// than its code (internal/control.ReasonHeader).
const (
	reasonHeader               = "Shoal-Error-Reason"
	reasonSandboxKilled        = "sandbox_killed"
	reasonSandboxReset         = "sandbox_reset"
	reasonCommandNotFound      = "command_not_found"
	reasonCommandNotExecutable = "command_not_executable"
)

// reasonError is a server error with a name: errors.Is matches the name,
// errors.As the *connect.Error.
type reasonError struct {
	Err  *connect.Error
	name error
}

func (e *reasonError) Error() string   { return e.Err.Error() }
func (e *reasonError) Unwrap() []error { return []error{e.Err, e.name} }

// startErr names the errors of starting a command that have a name.
func startErr(err error) error {
	var ce *connect.Error
	if err == nil || !errors.As(err, &ce) {
		return streamErr(err)
	}
	switch ce.Meta().Get(reasonHeader) {
	case reasonCommandNotFound:
		return &reasonError{Err: ce, name: ErrCommandNotFound}
	case reasonCommandNotExecutable:
		return &reasonError{Err: ce, name: ErrCommandNotExecutable}
	}
	return streamErr(err)
}

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
	if err == nil || !errors.As(err, &ce) {
		return err
	}
	if ce.Code() == connect.CodeFailedPrecondition && ce.Meta().Get(reasonHeader) == reasonSandboxReset {
		return &reasonError{Err: ce, name: ErrCommandReset}
	}
	if ce.Code() != connect.CodeNotFound {
		return err
	}
	if ce.Meta().Get(reasonHeader) == reasonSandboxKilled ||
		strings.Contains(ce.Message(), " was killed (deleted) while command ") {
		return &SandboxKilledError{Err: ce}
	}
	return err
}

// Package errdefs holds the kinds of error that cross package boundaries in
// Shoal (as containerd's errdefs does): packages mark an error with a kind,
// callers test it with errors.Is, and only the API edge maps kinds to status
// codes. A marked error's message is the human text alone ("no sandbox x on
// this node"), never prefixed with the kind.
package errdefs

import (
	"errors"
	"fmt"
)

// Kinds of error.
var (
	ErrInvalidArgument    = errors.New("invalid argument")
	ErrNotFound           = errors.New("not found")
	ErrAlreadyExists      = errors.New("already exists")
	ErrFailedPrecondition = errors.New("failed precondition")
	ErrPermissionDenied   = errors.New("permission denied")
	ErrResourceExhausted  = errors.New("resource exhausted")
	ErrUnavailable        = errors.New("unavailable")
	// ErrSandboxKilled: the operation's sandbox was deleted (by a client,
	// or by its timeout) while the operation ran, e.g. the command a
	// stream follows: it did not exit, it was killed with its sandbox. The
	// message names the sandbox.
	ErrSandboxKilled = errors.New("sandbox killed")
)

type kindError struct {
	kind  error
	cause error
}

func (e *kindError) Error() string        { return e.cause.Error() }
func (e *kindError) Is(target error) bool { return target == e.kind }
func (e *kindError) Unwrap() error        { return e.cause }

// Mark returns err marked as being of kind (nil stays nil). errors.Is(result,
// kind) is true, and so is errors.Is for anything err already wraps.
func Mark(kind, err error) error {
	if err == nil {
		return nil
	}
	return &kindError{kind: kind, cause: err}
}

// New formats an error of the given kind; %w works as in fmt.Errorf.
func New(kind error, format string, args ...any) error {
	return Mark(kind, fmt.Errorf(format, args...))
}

// Package errdefs holds the kinds of error that cross package boundaries in
// Shoal (as containerd's errdefs does): packages mark an error with a kind,
// callers test it with errors.Is, and only the API edge maps kinds to status
// codes. A marked error's message is the human text alone ("no sandbox x on
// this node"), never prefixed with the kind.
package errdefs

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"syscall"
)

// Kinds of error.
var (
	ErrInvalidArgument    = errors.New("invalid argument")
	ErrNotFound           = errors.New("not found")
	ErrAlreadyExists      = errors.New("already exists")
	ErrFailedPrecondition = errors.New("failed precondition")
	ErrResourceExhausted  = errors.New("resource exhausted")
	ErrUnavailable        = errors.New("unavailable")
	// ErrPermissionDenied: the caller may not do this: its key lacks the
	// scope the operation needs, or a server path is outside the build
	// roots (the message says which).
	ErrPermissionDenied = errors.New("permission denied")
	// ErrSandboxKilled: the operation's sandbox was deleted (by a client,
	// or by its timeout) while the operation ran, e.g. the command a
	// stream follows: it did not exit, it was killed with its sandbox. The
	// message names the sandbox.
	ErrSandboxKilled = errors.New("sandbox killed")
	// ErrLogPruned: a command's output was read from an offset whose bytes
	// were pruned to keep its sandbox within its log budget (its oldest
	// output goes first). The message names the first offset kept.
	ErrLogPruned = errors.New("log pruned")
	// ErrUnimplemented: Shoal, or this backend, does not do this (a
	// backend's sandbox.ErrUnsupported); the message names the
	// alternative where there is one.
	ErrUnimplemented = errors.New("unimplemented")
)

// Refinements: errors of a kind that some API face answers with a status
// of their own (see the table in wire.go). Test them with errors.Is; each
// is also of its kind.
var (
	// ErrTooLarge: a request body over its bound (resource exhausted;
	// 413 on the HTTP faces).
	ErrTooLarge = Mark(ErrResourceExhausted, errors.New("request body too large"))
	// ErrNoSpace: a sandbox's disk is full (resource exhausted; 507 on
	// the E2B face, as envd answers).
	ErrNoSpace = Mark(ErrResourceExhausted, errors.New("no space left on the sandbox's disk"))
	// ErrSandboxReset: the operation's command or shell was closed by a
	// reset of its sandbox (failed precondition: it is gone, its sandbox
	// is not); the message names the sandbox and the command.
	ErrSandboxReset = Mark(ErrFailedPrecondition, errors.New("sandbox reset"))
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

// Code names err's kind in the words of the wire codes ("ok" for nil,
// "internal" for an error of no kind): the one classification of errors
// that every API face maps to its status (internal/control, internal/e2b)
// and that logs and metrics label with. The fs sentinels (which the guest
// agent's errors unwrap to) and a full disk count as kinds; the first
// match in this order wins.
func Code(err error) string {
	switch {
	case err == nil:
		return "ok"
	case errors.Is(err, ErrInvalidArgument), errors.Is(err, fs.ErrInvalid):
		return "invalid_argument"
	case errors.Is(err, ErrLogPruned):
		return "out_of_range"
	case errors.Is(err, ErrNotFound), errors.Is(err, ErrSandboxKilled), errors.Is(err, fs.ErrNotExist):
		return "not_found"
	case errors.Is(err, ErrAlreadyExists), errors.Is(err, fs.ErrExist):
		return "already_exists"
	case errors.Is(err, ErrPermissionDenied), errors.Is(err, fs.ErrPermission):
		return "permission_denied"
	case errors.Is(err, ErrFailedPrecondition):
		return "failed_precondition"
	case errors.Is(err, ErrResourceExhausted), errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		return "resource_exhausted"
	case errors.Is(err, ErrUnavailable):
		return "unavailable"
	case errors.Is(err, ErrUnimplemented):
		return "unimplemented"
	case errors.Is(err, context.Canceled):
		return "canceled"
	case errors.Is(err, context.DeadlineExceeded):
		return "deadline_exceeded"
	}
	return "internal"
}

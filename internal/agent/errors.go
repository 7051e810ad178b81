package agent

import (
	"errors"
	"io/fs"
	"os"
	"syscall"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// ErrorCode classifies an error reported by the agent. Codes are stable
// strings on the wire.
type ErrorCode string

const (
	CodeNotExist    ErrorCode = "not_exist"   // unwraps to fs.ErrNotExist
	CodeExist       ErrorCode = "exist"       // unwraps to fs.ErrExist
	CodeNotEmpty    ErrorCode = "not_empty"   // directory not empty; unwraps to fs.ErrExist
	CodePermission  ErrorCode = "permission"  // unwraps to fs.ErrPermission
	CodeInvalid     ErrorCode = "invalid"     // bad request; unwraps to fs.ErrInvalid
	CodeNotDir      ErrorCode = "not_dir"     // a path element is not a directory; unwraps to fs.ErrInvalid
	CodeIsDir       ErrorCode = "is_dir"      // a directory where a file is needed; unwraps to fs.ErrInvalid
	CodeNoSpace     ErrorCode = "no_space"    // ENOSPC / EDQUOT; unwraps to errdefs.ErrNoSpace
	CodeIO          ErrorCode = "io"          // any other OS error
	CodeUnsupported ErrorCode = "unsupported" // op unknown to this agent version; unwraps to errdefs.ErrUnimplemented
	CodeProtocol    ErrorCode = "protocol"    // malformed frame or message
	// CodeVersion: the agent speaks another protocol version (client side
	// only); unwraps to errdefs.ErrFailedPrecondition.
	CodeVersion ErrorCode = "version"
)

// Error is an error reported by the agent. Op and Path are filled in by the
// client from its request (Path is Args[0] for exec); Code and Msg come from
// the agent. Use errors.Is with the fs sentinels (fs.ErrNotExist,
// fs.ErrExist, fs.ErrPermission, fs.ErrInvalid) rather than comparing codes.
type Error struct {
	Op   string
	Path string
	Code ErrorCode
	Msg  string
}

func (e *Error) Error() string {
	s := "agent " + e.Op
	if e.Path != "" {
		s += " " + e.Path
	}
	return s + ": " + e.Msg
}

// Unwrap returns the fs sentinel matching Code, or nil.
func (e *Error) Unwrap() error {
	switch e.Code {
	case CodeNotExist:
		return fs.ErrNotExist
	case CodeExist, CodeNotEmpty:
		return fs.ErrExist
	case CodePermission:
		return fs.ErrPermission
	case CodeInvalid, CodeNotDir, CodeIsDir:
		return fs.ErrInvalid
	case CodeVersion:
		return errdefs.ErrFailedPrecondition
	case CodeNoSpace:
		return errdefs.ErrNoSpace
	case CodeUnsupported:
		return errdefs.ErrUnimplemented
	case CodeTooMany:
		return errdefs.ErrResourceExhausted
	}
	return nil
}

// codeOf classifies an OS error.
func codeOf(err error) ErrorCode {
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		switch {
		case errors.Is(err, fs.ErrNotExist):
			return CodeNotExist
		case errors.Is(err, fs.ErrExist):
			return CodeExist
		case errors.Is(err, fs.ErrPermission):
			return CodePermission
		case errors.Is(err, fs.ErrInvalid):
			return CodeInvalid
		}
		return CodeIO
	}
	switch errno {
	case syscall.ENOENT:
		return CodeNotExist
	case syscall.EEXIST:
		return CodeExist
	case syscall.ENOTEMPTY:
		return CodeNotEmpty
	case syscall.EACCES, syscall.EPERM, syscall.EROFS:
		return CodePermission
	case syscall.ENOTDIR:
		return CodeNotDir
	case syscall.EISDIR:
		return CodeIsDir
	case syscall.EINVAL, syscall.ENAMETOOLONG, syscall.ELOOP, syscall.ENOEXEC:
		return CodeInvalid
	case syscall.ENOSPC, syscall.EDQUOT:
		return CodeNoSpace
	}
	return CodeIO
}

// wireErr turns an OS error about reqPath into the message sent to the
// client. The client prefixes its own op and path, so a PathError about the
// requested path itself is reduced to its reason; one about another path
// (a parent directory, the temp file) keeps that path.
func wireErr(err error, reqPath string) wireError {
	msg := err.Error()
	var pe *os.PathError
	var le *os.LinkError
	switch {
	case errors.As(err, &pe):
		if pe.Path == reqPath {
			msg = pe.Err.Error()
		} else {
			msg = pe.Op + " " + pe.Path + ": " + pe.Err.Error()
		}
	case errors.As(err, &le):
		msg = le.Op + " " + le.Old + " " + le.New + ": " + le.Err.Error()
	}
	return wireError{Code: codeOf(err), Msg: msg}
}

package e2b

import (
	"errors"
	"net/http"

	"connectrpc.com/connect"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/limits"
)

// codeOf maps an internal error to the Connect code envd would answer.
func codeOf(err error) connect.Code {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Code()
	}
	var ae *agent.Error
	if errors.As(err, &ae) {
		switch ae.Code {
		case agent.CodeNoSpace:
			return connect.CodeResourceExhausted
		case agent.CodeUnsupported:
			return connect.CodeUnimplemented
		}
	}
	if errors.Is(err, errdefs.ErrSandboxKilled) {
		// What E2B's edge answers once a sandbox is gone (502: unavailable).
		return connect.CodeUnavailable
	}
	// Every other kind as Shoal's own API maps it (errdefs.Code).
	var c connect.Code
	if c.UnmarshalText([]byte(errdefs.Code(err))) != nil {
		return connect.CodeInternal
	}
	return c
}

// toConnect turns an internal error into a Connect error for the envd RPCs.
func toConnect(err error) error {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce
	}
	return connect.NewError(codeOf(err), err)
}

// httpStatusOf is the HTTP status for an internal error on the REST faces
// (the control plane and envd's /files).
func httpStatusOf(err error) int {
	if errors.Is(err, limits.ErrTooLarge) {
		return http.StatusRequestEntityTooLarge
	}
	switch codeOf(err) {
	case connect.CodeInvalidArgument:
		return http.StatusBadRequest
	case connect.CodeNotFound:
		return http.StatusNotFound
	case connect.CodeAlreadyExists, connect.CodeFailedPrecondition:
		return http.StatusConflict
	case connect.CodePermissionDenied:
		return http.StatusForbidden
	case connect.CodeResourceExhausted:
		var ae *agent.Error
		if errors.As(err, &ae) && ae.Code == agent.CodeNoSpace {
			return http.StatusInsufficientStorage // what envd answers (the SDK's NotEnoughSpaceError)
		}
		return http.StatusTooManyRequests
	case connect.CodeUnavailable:
		return http.StatusServiceUnavailable
	case connect.CodeUnimplemented:
		return http.StatusNotImplemented
	case connect.CodeOutOfRange:
		// A command's output read from where its log was pruned
		// (errdefs.ErrLogPruned).
		return http.StatusRequestedRangeNotSatisfiable
	case connect.CodeCanceled:
		return 499
	case connect.CodeDeadlineExceeded:
		return http.StatusGatewayTimeout
	}
	return http.StatusInternalServerError
}

// WriteErr answers err with E2B's error body and the HTTP status its kind
// maps to (the E2B face's one mapping).
func WriteErr(w http.ResponseWriter, err error) { writeErr(w, err) }

func writeErr(w http.ResponseWriter, err error) {
	writeError(w, httpStatusOf(err), err.Error())
}

// unsupported is the answer to an E2B feature Shoal does not have yet.
func unsupported(what string) error {
	return connect.NewError(connect.CodeUnimplemented, errors.New(what+" is not supported by Shoal's E2B endpoint yet"))
}

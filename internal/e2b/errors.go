package e2b

import (
	"errors"
	"net/http"

	"connectrpc.com/connect"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// codeOf maps an internal error to the Connect code envd would answer.
func codeOf(err error) connect.Code {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Code()
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
// (the control plane and envd's /files): errdefs' table, E2B's column.
func httpStatusOf(err error) int {
	return errdefs.StatusFor(errdefs.FaceE2B, codeOf(err).String(), err)
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

package errdefs

import "errors"

// Face is an API face of Shoal: each maps an error's kind to an HTTP
// status through the one table below.
type Face int

const (
	// FaceShoal is Shoal's own API: Connect RPCs and the plain HTTP
	// routes beside them (file transfer, proxies, the dashboard).
	FaceShoal Face = iota
	// FaceE2B is the E2B-compatible endpoint: E2B's REST API and envd's
	// /files and Connect RPCs.
	FaceE2B
)

// Status is how one kind of error (its Code) crosses each face. The
// Connect code is the kind's Code itself on both faces; HTTP is the status
// of the plain HTTP answers, the Connect protocol's mapping (connectrpc's
// "Error codes" table) on Shoal's face.
type Status struct {
	Code  string
	Shoal int
	E2B   int
	// Why the E2B face answers another status than Shoal's, when it does.
	Why string
}

// Statuses is the one table from kinds to statuses, for every face.
var Statuses = []Status{
	{Code: "invalid_argument", Shoal: 400, E2B: 400},
	{Code: "not_found", Shoal: 404, E2B: 404},
	{Code: "already_exists", Shoal: 409, E2B: 409},
	{Code: "permission_denied", Shoal: 403, E2B: 403},
	{Code: "failed_precondition", Shoal: 400, E2B: 409,
		Why: "E2B's API answers a request the sandbox's state forbids (pause of a paused sandbox, a refused template) with 409 Conflict"},
	{Code: "resource_exhausted", Shoal: 429, E2B: 429},
	{Code: "unavailable", Shoal: 503, E2B: 503},
	{Code: "unimplemented", Shoal: 501, E2B: 501},
	{Code: "out_of_range", Shoal: 400, E2B: 416,
		Why: "a command's output read from where its log budget pruned it: a range that cannot be satisfied, as envd's REST answers one"},
	{Code: "unauthenticated", Shoal: 401, E2B: 401},
	{Code: "canceled", Shoal: 499, E2B: 499},
	{Code: "deadline_exceeded", Shoal: 504, E2B: 504},
	{Code: "internal", Shoal: 500, E2B: 500},
}

// Refined statuses, checked before the kind's row.
var refined = []struct {
	err        error
	shoal, e2b int // 0: the kind's
}{
	{ErrTooLarge, 413, 413},
	{ErrNoSpace, 0, 507}, // envd's answer; the E2B SDK's NotEnoughSpaceError
}

// HTTPStatus is the HTTP status err is answered with on face: its
// refinement's, else its kind's (Code) row of Statuses.
func HTTPStatus(face Face, err error) int { return StatusFor(face, Code(err), err) }

// StatusFor is the HTTP status of an error of wire code code (an API
// face's own classification of err, which may differ from Code(err)):
// err's refinement's status, else the code's row of Statuses.
func StatusFor(face Face, code string, err error) int {
	for _, r := range refined {
		if errors.Is(err, r.err) {
			if s := pick(face, r.shoal, r.e2b); s != 0 {
				return s
			}
		}
	}
	return StatusOf(face, code)
}

// StatusOf is the HTTP status of a wire code on face (500 for a code not
// in the table).
func StatusOf(face Face, code string) int {
	for _, s := range Statuses {
		if s.Code == code {
			return pick(face, s.Shoal, s.E2B)
		}
	}
	return 500
}

func pick(face Face, shoal, e2b int) int {
	if face == FaceE2B {
		return e2b
	}
	return shoal
}

// CodeOfStatus is the wire code an HTTP status stands for on face (for
// metrics of answers given outside the error path): the first row of
// Statuses, or refinement, with that status; "ok" below 400, "internal"
// for another 5xx, "unknown" for another 4xx.
func CodeOfStatus(face Face, status int) string {
	if status < 400 {
		return "ok"
	}
	for _, s := range Statuses {
		if pick(face, s.Shoal, s.E2B) == status {
			return s.Code
		}
	}
	for _, r := range refined {
		if pick(face, r.shoal, r.e2b) == status {
			return Code(r.err)
		}
	}
	if status >= 500 {
		return "internal"
	}
	return "unknown"
}

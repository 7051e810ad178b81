package errdefs

import (
	"context"
	"fmt"
	"io/fs"
	"testing"
)

func TestStatuses(t *testing.T) {
	seen := map[string]bool{}
	for _, s := range Statuses {
		if seen[s.Code] {
			t.Errorf("code %s twice in the table", s.Code)
		}
		seen[s.Code] = true
		if s.Shoal == 0 || s.E2B == 0 {
			t.Errorf("%s: a status missing: %+v", s.Code, s)
		}
		if (s.Shoal != s.E2B) != (s.Why != "") {
			t.Errorf("%s: the E2B face differs from Shoal's exactly when Why says why: %+v", s.Code, s)
		}
	}
	for _, err := range []error{nil, ErrInvalidArgument, ErrNotFound, ErrAlreadyExists, ErrPermissionDenied,
		ErrFailedPrecondition, ErrResourceExhausted, ErrUnavailable, ErrUnimplemented, ErrSandboxKilled, ErrLogPruned,
		context.Canceled, context.DeadlineExceeded, fmt.Errorf("plain")} {
		if c := Code(err); c != "ok" && !seen[c] {
			t.Errorf("Code(%v) = %s: not in the table", err, c)
		}
	}
	for _, c := range []struct {
		err        error
		shoal, e2b int
		code       string
	}{
		{New(ErrNotFound, "no sandbox x"), 404, 404, "not_found"},
		{New(ErrFailedPrecondition, "sandbox x is paused"), 400, 409, "failed_precondition"},
		{New(ErrUnimplemented, "fork of a fncall sandbox: use the container backend"), 501, 501, "unimplemented"},
		{fmt.Errorf("upload: %w", ErrTooLarge), 413, 413, "resource_exhausted"},
		{fmt.Errorf("write /x: %w", ErrNoSpace), 429, 507, "resource_exhausted"},
		{New(ErrResourceExhausted, "64 streams"), 429, 429, "resource_exhausted"},
		{fs.ErrNotExist, 404, 404, "not_found"},
		{New(ErrLogPruned, "re-attach from offset 7"), 400, 416, "out_of_range"},
		{fmt.Errorf("boom"), 500, 500, "internal"},
	} {
		if got := Code(c.err); got != c.code {
			t.Errorf("Code(%v) = %s, want %s", c.err, got, c.code)
		}
		if got := HTTPStatus(FaceShoal, c.err); got != c.shoal {
			t.Errorf("Shoal's status of %v = %d, want %d", c.err, got, c.shoal)
		}
		if got := HTTPStatus(FaceE2B, c.err); got != c.e2b {
			t.Errorf("E2B's status of %v = %d, want %d", c.err, got, c.e2b)
		}
	}
}

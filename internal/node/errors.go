package node

import "fmt"

// kindError is an error of a kind (one of the sentinels above) whose message
// is only the human text: "no sandbox x on this node", not "not found: …".
type kindError struct {
	kind  error
	cause error // fmt.Errorf of the message, keeps any %w-wrapped error
}

func (e *kindError) Error() string        { return e.cause.Error() }
func (e *kindError) Is(target error) bool { return target == e.kind }
func (e *kindError) Unwrap() error        { return e.cause }

// errorf formats an error of the given kind.
func errorf(kind error, format string, args ...any) error {
	return &kindError{kind: kind, cause: fmt.Errorf(format, args...)}
}

// Package limits holds the bounds Shoal puts on every request, whatever API
// face it came through (Shoal's own API, the E2B face, the CLI, the SDKs),
// and the checks that enforce them. The node and session managers call the
// checks; the faces only convert their wire values with Seconds and Millis,
// which never overflow, so that a bound is enforced in one place.
//
// A value out of bounds is an errdefs.ErrInvalidArgument whose message names
// the field, the value and the bound; a body or a collection too large to
// take is errdefs.ErrResourceExhausted.
package limits

import (
	"fmt"
	"io"
	"math"
	"sort"
	"strings"
	"time"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// Bounds of a request. They are constants: generous for any real workload,
// small enough that no single request can make the server allocate much.
const (
	// MessageBytes bounds one decoded API message (a Connect/gRPC request
	// body or frame, an E2B REST body is smaller: JSONBodyBytes). Streamed
	// file bodies are not messages: they are bounded by FileBytes.
	MessageBytes = 16 << 20
	// CompressMinBytes: an API answer smaller than this is sent as it is
	// even to a client that accepts gzip (httpx, curl --compressed and
	// browsers do; connect compresses every answer by default). A gzip
	// writer's compressor is several hundred KiB of zeroed memory whenever
	// its pool lost it: ~8% of serve's CPU under a burst of creates. The
	// answers are mostly small, the clients near.
	CompressMinBytes = 64 << 10
	// JSONBodyBytes bounds a plain JSON request body (E2B's REST API).
	JSONBodyBytes = 1 << 20
	// FileBytes bounds one file streamed through the files API or E2B's
	// upload (after decompression): the sandbox's disk is the real limit,
	// this keeps a single request from being endless.
	FileBytes = 64 << 30

	// IDBytes bounds an identifier (sandbox, command, trajectory, shell,
	// client key, template, tag).
	IDBytes = 256
	// RefBytes bounds a layer reference (name:version, name@sha256:...).
	RefBytes = 512
	// Layers bounds the layers of one sandbox (base + workspaces +
	// toolkits); overlayfs itself stops at 500.
	Layers = 128
	// MapEntries bounds metadata and environment maps; KeyBytes and
	// ValueBytes bound each entry, MapBytes all of them together.
	MapEntries = 1024
	KeyBytes   = 1024
	ValueBytes = 128 << 10 // the kernel's MAX_ARG_STRLEN
	MapBytes   = 1 << 20
	// Args bounds a command's argv (count) and ArgBytes each argument;
	// together with its environment a command stays within ArgvBytes, the
	// kernel's own limit on execve being about as much.
	Args      = 16384
	ArgBytes  = 128 << 10
	ArgvBytes = 2 << 20
	// PathBytes bounds a path in a sandbox (the kernel's PATH_MAX).
	PathBytes = 4096
	// UserBytes bounds a sandbox user's name in a request.
	UserBytes = 256
	// StdinBytes bounds the stdin given with a start or one SendStdin.
	StdinBytes = 8 << 20
	// CommandBytes bounds a shell session's command line.
	CommandBytes = 1 << 20
	// PtyCells bounds a pseudo-terminal's rows and columns.
	PtyCells = 1000
	// CommandTimeout bounds a command's, shell run's or wait's timeout.
	CommandTimeout = 7 * 24 * time.Hour
	// ListPage is the largest page of a listing (sandboxes, commands,
	// layers, directory entries): a longer listing is paged or refused.
	ListPage = 10000
)

// Seconds converts a request's seconds into a Duration without overflow:
// values beyond what a Duration holds saturate at its maximum (or minimum),
// which every bound then refuses, instead of wrapping around to something
// small (18446744075 s would wrap to 1.3 s).
func Seconds(n int64) time.Duration { return scale(n, int64(time.Second)) }

// Millis converts milliseconds as Seconds does seconds.
func Millis(n int64) time.Duration { return scale(n, int64(time.Millisecond)) }

func scale(n, unit int64) time.Duration {
	switch {
	case n > math.MaxInt64/unit:
		return math.MaxInt64
	case n < math.MinInt64/unit:
		return math.MinInt64
	}
	return time.Duration(n * unit)
}

// FormatDuration prints d for an error message, naming a value that
// Seconds or Millis saturated as the overflow it was rather than as a
// number nobody sent.
func FormatDuration(d time.Duration) string {
	if d == math.MaxInt64 || d == math.MinInt64 {
		return "beyond what a duration holds (an overflow)"
	}
	return d.String()
}

// Invalid returns an ErrInvalidArgument.
func Invalid(format string, args ...any) error {
	return errdefs.New(errdefs.ErrInvalidArgument, format, args...)
}

// Duration checks min <= d <= max (d == 0 passes when zeroOK).
func Duration(field string, d, min, max time.Duration) error {
	if d < min || d > max {
		return Invalid("%s must be between %s and %s, got %s", field, min, max, FormatDuration(d))
	}
	return nil
}

// String checks that s has at most max bytes and no NUL.
func String(field, s string, max int) error {
	if len(s) > max {
		return Invalid("%s is %d bytes, more than the maximum of %d", field, len(s), max)
	}
	if strings.IndexByte(s, 0) >= 0 {
		return Invalid("%s contains a NUL byte", field)
	}
	return nil
}

// User checks the name of a sandbox user.
func User(field, u string) error { return String(field, u, UserBytes) }

// Path checks a path in a sandbox.
func Path(field, p string) error { return String(field, p, PathBytes) }

// Map checks a metadata or environment map: at most MapEntries entries,
// keys of at most KeyBytes, values of at most ValueBytes, MapBytes in all.
// env also refuses names a process environment cannot hold.
func Map(field string, m map[string]string, env bool) error {
	if len(m) > MapEntries {
		return Invalid("%s has %d entries, more than the maximum of %d", field, len(m), MapEntries)
	}
	total := 0
	for k, v := range m {
		if env && (k == "" || strings.ContainsAny(k, "=\x00")) {
			return Invalid("%s: bad environment variable name %q", field, k)
		}
		if len(k) > KeyBytes {
			return Invalid("%s: a key is %d bytes, more than the maximum of %d", field, len(k), KeyBytes)
		}
		if len(v) > ValueBytes {
			return Invalid("%s[%q] is %d bytes, more than the maximum of %d", field, k, len(v), ValueBytes)
		}
		if env && strings.IndexByte(v, 0) >= 0 {
			return Invalid("%s[%q] contains a NUL byte", field, k)
		}
		total += len(k) + len(v)
	}
	if total > MapBytes {
		return Invalid("%s holds %d bytes, more than the maximum of %d", field, total, MapBytes)
	}
	return nil
}

// EnvList checks an environment map (as Map does) and returns it as sorted
// KEY=VALUE entries.
func EnvList(field string, m map[string]string) ([]string, error) {
	if err := Map(field, m, true); err != nil {
		return nil, err
	}
	env := make([]string, 0, len(m))
	for k, v := range m {
		env = append(env, k+"="+v)
	}
	sort.Strings(env)
	return env, nil
}

// Argv checks a command's arguments and environment (KEY=VALUE entries).
func Argv(args, env []string) error {
	if len(args) > Args {
		return Invalid("%d arguments, more than the maximum of %d", len(args), Args)
	}
	if len(env) > MapEntries {
		return Invalid("%d environment variables, more than the maximum of %d", len(env), MapEntries)
	}
	total := 0
	for i, a := range args {
		if len(a) > ArgBytes {
			return Invalid("argument %d is %d bytes, more than the maximum of %d", i, len(a), ArgBytes)
		}
		if strings.IndexByte(a, 0) >= 0 {
			return Invalid("argument %d contains a NUL byte", i)
		}
		total += len(a) + 1
	}
	for _, e := range env {
		if len(e) > ArgBytes {
			return Invalid("an environment variable is %d bytes, more than the maximum of %d", len(e), ArgBytes)
		}
		if strings.IndexByte(e, 0) >= 0 {
			return Invalid("an environment variable contains a NUL byte")
		}
		total += len(e) + 1
	}
	if total > ArgvBytes {
		return Invalid("arguments and environment hold %d bytes, more than the maximum of %d", total, ArgvBytes)
	}
	return nil
}

// Pty checks a pseudo-terminal size as the wire carries it (before it is
// narrowed to 16 bits).
func Pty(rows, cols uint32) error {
	if rows == 0 || cols == 0 || rows > PtyCells || cols > PtyCells {
		return Invalid("pty size %dx%d: rows and cols must be 1-%d", rows, cols, PtyCells)
	}
	return nil
}

// Bytes checks the length of a byte payload (stdin).
func Bytes(field string, n, max int) error {
	if n > max {
		return errdefs.New(errdefs.ErrResourceExhausted, "%s is %d bytes, more than the maximum of %d: send it in smaller pieces", field, n, max)
	}
	return nil
}

// ErrTooLarge marks a body over its bound (an errdefs.ErrResourceExhausted
// too); plain HTTP routes answer it with 413 (errdefs' table).
var ErrTooLarge = errdefs.ErrTooLarge

// TooLarge is the error of a body over its bound.
func TooLarge(what string, max int64) error {
	return fmt.Errorf("%s is larger than the maximum of %s: %w", what, Size(max), ErrTooLarge)
}

// Reader returns r bounded to max bytes: reading past them fails with
// TooLarge(what, max), so a stream can be consumed as it comes (never held
// in memory) and still not be endless.
func Reader(r io.Reader, max int64, what string) io.Reader {
	return &limitedReader{r: r, left: max, max: max, what: what}
}

type limitedReader struct {
	r         io.Reader
	left, max int64
	what      string
}

func (l *limitedReader) Read(p []byte) (int, error) {
	if l.left <= 0 {
		// One byte more tells a body of exactly max bytes from a longer one.
		var b [1]byte
		n, err := l.r.Read(b[:])
		if n > 0 {
			return 0, TooLarge(l.what, l.max)
		}
		return 0, err
	}
	if int64(len(p)) > l.left {
		p = p[:l.left]
	}
	n, err := l.r.Read(p)
	l.left -= int64(n)
	return n, err
}

// Size prints a byte count in binary units.
func Size(n int64) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return fmt.Sprintf("%d GiB", n>>30)
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d bytes", n)
}

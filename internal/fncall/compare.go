package fncall

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"strconv"
	"unicode/utf8"
)

// Compare is how a test's output is checked against its expected output.
type Compare int

const (
	CompareDefault    Compare = iota // the call's mode, else CompareWhitespace
	CompareExact                     // byte for byte
	CompareWhitespace                // the same whitespace-separated tokens
	CompareFloat                     // tokens; numbers equal within the tolerance
	CompareLines                     // lines equal up to trailing whitespace; trailing blank lines ignored
)

func (c Compare) String() string {
	switch c {
	case CompareExact:
		return "exact"
	case CompareWhitespace:
		return "whitespace"
	case CompareFloat:
		return "float"
	case CompareLines:
		return "lines"
	}
	return "default"
}

// DefaultFloatTolerance is used by CompareFloat when the call gives none.
const DefaultFloatTolerance = 1e-6

// compare reports whether got matches want, and if not, where they first
// differ.
func compare(mode Compare, tol float64, got, want []byte) (bool, string) {
	switch mode {
	case CompareExact:
		if bytes.Equal(got, want) {
			return true, ""
		}
		i := 0
		for i < len(got) && i < len(want) && got[i] == want[i] {
			i++
		}
		line := bytes.Count(got[:i], []byte("\n")) + 1
		return false, fmt.Sprintf("byte %d (line %d): expected %s, got %s", i+1, line, excerpt(want, i), excerpt(got, i))
	case CompareLines:
		g, w := trimLines(got), trimLines(want)
		for i := 0; i < len(g) || i < len(w); i++ {
			switch {
			case i >= len(g):
				return false, fmt.Sprintf("line %d: expected %s, got end of output", i+1, quote(w[i]))
			case i >= len(w):
				return false, fmt.Sprintf("line %d: expected end of output, got %s", i+1, quote(g[i]))
			case !bytes.Equal(g[i], w[i]):
				return false, fmt.Sprintf("line %d: expected %s, got %s", i+1, quote(w[i]), quote(g[i]))
			}
		}
		return true, ""
	}
	// Whitespace and float: token by token.
	g, w := bytes.Fields(got), bytes.Fields(want)
	if tol <= 0 {
		tol = DefaultFloatTolerance
	}
	for i := 0; i < len(g) || i < len(w); i++ {
		switch {
		case i >= len(g):
			return false, fmt.Sprintf("token %d: expected %s, got end of output", i+1, quote(w[i]))
		case i >= len(w):
			return false, fmt.Sprintf("token %d: expected end of output, got %s", i+1, quote(g[i]))
		case bytes.Equal(g[i], w[i]):
		case mode == CompareFloat && floatsEqual(g[i], w[i], tol):
		default:
			return false, fmt.Sprintf("token %d: expected %s, got %s", i+1, quote(w[i]), quote(g[i]))
		}
	}
	return true, ""
}

// floatsEqual: both tokens are numbers within tol of each other, absolutely
// or relative to the expected one.
func floatsEqual(got, want []byte, tol float64) bool {
	a, ok1 := parseFloat(got)
	b, ok2 := parseFloat(want)
	if !ok1 || !ok2 || math.IsNaN(a) || math.IsNaN(b) {
		return false
	}
	if math.IsInf(a, 0) || math.IsInf(b, 0) {
		return a == b
	}
	d := math.Abs(a - b)
	return d <= tol || d <= tol*math.Abs(b)
}

// parseFloat parses a number; out of range is ±Inf (or 0), not an error.
func parseFloat(b []byte) (float64, bool) {
	v, err := strconv.ParseFloat(string(b), 64)
	if err != nil && !errors.Is(err, strconv.ErrRange) {
		return 0, false
	}
	return v, true
}

// trimLines splits into lines without trailing whitespace and drops
// trailing empty lines.
func trimLines(b []byte) [][]byte {
	lines := bytes.Split(b, []byte("\n"))
	for i := range lines {
		lines[i] = bytes.TrimRight(lines[i], " \t\r\f\v")
	}
	for len(lines) > 0 && len(lines[len(lines)-1]) == 0 {
		lines = lines[:len(lines)-1]
	}
	return lines
}

// excerpt shows up to 20 bytes of b from i.
func excerpt(b []byte, i int) string {
	if i >= len(b) {
		return "end of output"
	}
	return quote(b[i:min(len(b), i+20)])
}

func quote(b []byte) string {
	const max = 40
	cut := len(b) > max
	if cut {
		b = b[:max]
		for len(b) > 0 && !utf8.Valid(b) {
			b = b[:len(b)-1]
		}
	}
	s := strconv.Quote(string(b))
	if cut {
		s += "..."
	}
	return s
}

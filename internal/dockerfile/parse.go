// Package dockerfile parses Dockerfiles into instructions and expands
// their variables, for the builder in internal/node (dockerbuild.go),
// which runs them in sandboxes. The grammar is the reference parser's
// (moby/buildkit frontend/dockerfile/parser): a "# escape=" directive,
// comment lines (also inside continuations), line continuations with the
// escape character, instructions case-insensitive, JSON and shell forms,
// leading --flags. BuildKit heredocs (<<EOF) are refused, naming the line.
package dockerfile

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
	"unicode"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// Bounds of what Parse accepts.
const (
	MaxBytes        = 1 << 20 // the Dockerfile's size
	MaxInstructions = 256
	maxLineBytes    = 64 << 10 // one logical line
)

// Instruction is one instruction of a Dockerfile.
type Instruction struct {
	Line     int      // where it starts (1-based)
	Cmd      string   // upper case: "RUN", "COPY", ...
	Flags    []string // leading "--name=value" (or "--name") flags, as written
	Args     []string // JSON form: its strings; shell form: one string (the rest of the line)
	JSON     bool     // written in JSON form
	Original string   // the logical line, continuations joined
}

// Error is a parse error naming its line.
func lineErr(line int, format string, args ...any) error {
	return errdefs.New(errdefs.ErrInvalidArgument, "Dockerfile line %d: "+format, append([]any{line}, args...)...)
}

// known lists the instructions Parse recognises (the builder decides what
// it does with each).
var known = map[string]bool{
	"FROM": true, "RUN": true, "COPY": true, "ADD": true, "ENV": true, "ARG": true,
	"WORKDIR": true, "USER": true, "SHELL": true, "ENTRYPOINT": true, "CMD": true,
	"LABEL": true, "EXPOSE": true, "VOLUME": true, "ONBUILD": true, "HEALTHCHECK": true,
	"STOPSIGNAL": true, "MAINTAINER": true,
}

// flagged lists the instructions that take leading --flags.
var flagged = map[string]bool{"FROM": true, "RUN": true, "COPY": true, "ADD": true, "HEALTHCHECK": true}

var heredoc = regexp.MustCompile(`<<-?\s*["']?[A-Za-z_]`)

// File is a parsed Dockerfile.
type File struct {
	Escape       byte // '\\' or '`' (the escape directive)
	Instructions []Instruction
}

// Parse reads a Dockerfile. An unknown instruction, a heredoc, a malformed
// flag or JSON array, or a file over the bounds is an error marked
// errdefs.ErrInvalidArgument naming the line.
func Parse(src []byte) (*File, error) {
	if len(src) > MaxBytes {
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "Dockerfile: %d bytes, at most %d", len(src), MaxBytes)
	}
	text := strings.ReplaceAll(string(src), "\r\n", "\n")
	text = strings.TrimPrefix(text, "\ufeff")
	lines := strings.Split(text, "\n")
	escape := byte('\\')
	// Parser directives: comment lines at the very top ("# escape=`").
directives:
	for i, l := range lines {
		l = strings.TrimSpace(l)
		if !strings.HasPrefix(l, "#") {
			break
		}
		k, v, ok := strings.Cut(strings.TrimSpace(l[1:]), "=")
		if !ok {
			break
		}
		switch strings.ToLower(strings.TrimSpace(k)) {
		case "escape":
			v = strings.TrimSpace(v)
			if v != "\\" && v != "`" {
				return nil, lineErr(i+1, "escape directive %.16q: want \\ or `", v)
			}
			escape = v[0]
		case "syntax", "check":
			// the frontend to use, linter checks: not ours to honour
		default:
			break directives // a comment: directives end
		}
	}
	var out []Instruction
	for n := 0; n < len(lines); n++ {
		l := strings.TrimLeftFunc(lines[n], unicode.IsSpace)
		if l == "" || l[0] == '#' {
			continue
		}
		start := n
		var b strings.Builder
		for {
			cont := false
			t := strings.TrimRightFunc(l, unicode.IsSpace)
			if strings.HasSuffix(t, string(escape)) {
				t, cont = t[:len(t)-1], true
			}
			b.WriteString(t)
			if b.Len() > maxLineBytes {
				return nil, lineErr(start+1, "an instruction of more than %d bytes", maxLineBytes)
			}
			if !cont {
				break
			}
			// The next line that is neither empty nor a comment continues it.
			for n++; n < len(lines); n++ {
				l = strings.TrimLeftFunc(lines[n], unicode.IsSpace)
				if l != "" && l[0] != '#' {
					break
				}
			}
			if n >= len(lines) {
				break
			}
		}
		ins, err := parseLine(start+1, b.String(), escape)
		if err != nil {
			return nil, err
		}
		out = append(out, ins)
		if len(out) > MaxInstructions {
			return nil, lineErr(start+1, "more than %d instructions", MaxInstructions)
		}
	}
	if len(out) == 0 {
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "Dockerfile: no instructions")
	}
	return &File{Escape: escape, Instructions: out}, nil
}

func parseLine(line int, s string, escape byte) (Instruction, error) {
	s = strings.TrimSpace(s)
	word, rest, _ := strings.Cut(s, " ")
	if i := strings.IndexFunc(s, unicode.IsSpace); i >= 0 {
		word, rest = s[:i], strings.TrimSpace(s[i:])
	}
	cmd := strings.ToUpper(word)
	if !known[cmd] {
		return Instruction{}, lineErr(line, "unknown instruction %.32q", word)
	}
	ins := Instruction{Line: line, Cmd: cmd, Original: s}
	if flagged[cmd] {
		for strings.HasPrefix(rest, "--") {
			f := rest
			if i := strings.IndexFunc(rest, unicode.IsSpace); i >= 0 {
				f, rest = rest[:i], strings.TrimSpace(rest[i:])
			} else {
				rest = ""
			}
			if len(f) == 2 {
				return Instruction{}, lineErr(line, "%s: an empty flag", cmd)
			}
			ins.Flags = append(ins.Flags, f)
		}
	}
	if (cmd == "RUN" || cmd == "COPY" || cmd == "ADD") && heredoc.MatchString(rest) && !strings.HasPrefix(rest, "[") {
		return Instruction{}, lineErr(line, "%s with a heredoc (<<): heredocs are not supported; write the file in the build context and COPY it", cmd)
	}
	if strings.HasPrefix(rest, "[") {
		var a []string
		if err := json.Unmarshal([]byte(rest), &a); err == nil {
			ins.Args, ins.JSON = a, true
			return ins, nil
		} else if cmd == "RUN" || cmd == "CMD" || cmd == "ENTRYPOINT" || cmd == "SHELL" || cmd == "COPY" || cmd == "ADD" || cmd == "VOLUME" {
			// The reference parser falls back to the shell form; SHELL
			// has none, and a broken JSON array is almost always a typo.
			if cmd == "SHELL" {
				return Instruction{}, lineErr(line, "SHELL takes a JSON array of strings: %v", err)
			}
		}
	}
	if cmd == "SHELL" {
		return Instruction{}, lineErr(line, "SHELL takes a JSON array of strings")
	}
	if rest != "" {
		ins.Args = []string{rest}
	}
	return ins, nil
}

// Flag returns the value of flag --name (and whether it was given); a
// flag without "=" has the value "true".
func (ins Instruction) Flag(name string) (string, bool) {
	for _, f := range ins.Flags {
		k, v, ok := strings.Cut(f[2:], "=")
		if k == name {
			if !ok {
				v = "true"
			}
			return v, true
		}
	}
	return "", false
}

// CheckFlags refuses flags other than allowed, naming the line.
func (ins Instruction) CheckFlags(allowed ...string) error {
	for _, f := range ins.Flags {
		k, _, _ := strings.Cut(f[2:], "=")
		ok := false
		for _, a := range allowed {
			ok = ok || a == k
		}
		if !ok {
			what := ""
			if ins.Cmd == "RUN" && (k == "mount" || k == "network" || k == "security") {
				what = " (BuildKit's RUN --" + k + " is not supported)"
			}
			return lineErr(ins.Line, "%s --%.32s is not supported%s", ins.Cmd, k, what)
		}
	}
	return nil
}

// Words splits a shell-form argument into words as ENV, ARG and LABEL
// read them: whitespace outside quotes separates words; quotes are
// removed; the escape character escapes the next character (outside
// single quotes).
func Words(s string, escape byte) ([]string, error) {
	var out []string
	var b strings.Builder
	in := false
	var quote byte
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case quote == '\'':
			if c == '\'' {
				quote = 0
			} else {
				b.WriteByte(c)
			}
		case c == escape && i+1 < len(s):
			i++
			b.WriteByte(s[i])
			in = true
		case quote == '"':
			if c == '"' {
				quote = 0
			} else {
				b.WriteByte(c)
			}
		case c == '"' || c == '\'':
			quote, in = c, true
		case c == ' ' || c == '\t' || c == '\n':
			if in {
				out = append(out, b.String())
				b.Reset()
				in = false
			}
		default:
			b.WriteByte(c)
			in = true
		}
	}
	if quote != 0 {
		return nil, fmt.Errorf("unterminated %c quote", quote)
	}
	if in {
		out = append(out, b.String())
	}
	return out, nil
}

// Expand replaces $NAME, ${NAME}, ${NAME:-default} and ${NAME:+alt} with
// the values lookup gives (unset: empty); an escaped "$" stays "$".
func Expand(s string, escape byte, lookup func(string) (string, bool)) (string, error) {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c == escape && i+1 < len(s) && s[i+1] == '$' {
			b.WriteByte('$')
			i++
			continue
		}
		if c != '$' || i+1 >= len(s) {
			b.WriteByte(c)
			continue
		}
		if s[i+1] == '{' {
			end := strings.IndexByte(s[i:], '}')
			if end < 0 {
				return "", fmt.Errorf("missing } in %.64q", s)
			}
			expr := s[i+2 : i+end]
			i += end
			name, word, op := expr, "", ""
			if j := strings.Index(expr, ":"); j >= 0 {
				name = expr[:j]
				if j+1 >= len(expr) || (expr[j+1] != '-' && expr[j+1] != '+') {
					return "", fmt.Errorf("unsupported modifier in ${%.32s}: want :- or :+", expr)
				}
				op, word = expr[j:j+2], expr[j+2:]
			}
			if !validName(name) {
				return "", fmt.Errorf("bad variable name in ${%.32s}", expr)
			}
			v, set := lookup(name)
			switch op {
			case ":-":
				if !set || v == "" {
					v = word
				}
			case ":+":
				if set && v != "" {
					v = word
				} else {
					v = ""
				}
			}
			b.WriteString(v)
			continue
		}
		j := i + 1
		for j < len(s) && (s[j] == '_' || isAlnum(s[j])) {
			j++
		}
		if j == i+1 {
			b.WriteByte(c)
			continue
		}
		v, _ := lookup(s[i+1 : j])
		b.WriteString(v)
		i = j - 1
	}
	return b.String(), nil
}

func isAlnum(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

func validName(n string) bool {
	if n == "" || len(n) > 256 || n[0] >= '0' && n[0] <= '9' {
		return false
	}
	for i := 0; i < len(n); i++ {
		if n[i] != '_' && !isAlnum(n[i]) {
			return false
		}
	}
	return true
}

// ValidName says whether n may name a variable (ENV, ARG).
func ValidName(n string) bool { return validName(n) }

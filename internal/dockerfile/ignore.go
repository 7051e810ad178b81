package dockerfile

import (
	"crypto/sha256"
	"encoding/hex"
	"path"
	"strings"
)

// Ignore is a parsed .dockerignore: patterns in path.Match syntax plus
// "**" (any number of directories), matched against slash-separated
// paths relative to the context's root; a pattern starting with "!"
// re-includes what earlier patterns excluded; the last match wins. A
// pattern excludes a directory's whole contents too.
type Ignore struct {
	rules []ignoreRule
}

type ignoreRule struct {
	parts   []string
	exclude bool
}

// ParseIgnore reads a .dockerignore.
func ParseIgnore(src []byte) (*Ignore, error) {
	ig := &Ignore{}
	for _, l := range strings.Split(string(src), "\n") {
		l = strings.TrimSpace(l)
		if l == "" || l[0] == '#' {
			continue
		}
		ex := true
		if l[0] == '!' {
			ex, l = false, strings.TrimSpace(l[1:])
		}
		l = path.Clean("/" + l)[1:]
		if l == "" {
			continue
		}
		parts := strings.Split(l, "/")
		for _, p := range parts {
			if p == "**" {
				continue
			}
			if _, err := path.Match(p, ""); err != nil {
				return nil, lineErr(0, ".dockerignore pattern %.64q: %v", l, err)
			}
		}
		ig.rules = append(ig.rules, ignoreRule{parts: parts, exclude: ex})
	}
	return ig, nil
}

// HasExceptions says whether a "!" pattern re-includes anything.
func (ig *Ignore) HasExceptions() bool {
	for _, r := range ig.rules {
		if !r.exclude {
			return true
		}
	}
	return false
}

// Excluded says whether rel (slash-separated, relative to the context's
// root) is left out of the context.
func (ig *Ignore) Excluded(rel string) bool {
	if ig == nil {
		return false
	}
	parts := strings.Split(path.Clean("/" + rel)[1:], "/")
	out := false
	for _, r := range ig.rules {
		// A rule matches the path or any of its parents.
		for n := 1; n <= len(parts); n++ {
			if matchParts(r.parts, parts[:n]) {
				out = r.exclude
				break
			}
		}
	}
	return out
}

func matchParts(pat, name []string) bool {
	if len(pat) == 0 {
		return len(name) == 0
	}
	if pat[0] == "**" {
		for i := 0; i <= len(name); i++ {
			if matchParts(pat[1:], name[i:]) {
				return true
			}
		}
		return false
	}
	if len(name) == 0 {
		return false
	}
	ok, _ := path.Match(pat[0], name[0])
	return ok && matchParts(pat[1:], name[1:])
}

// StepKey is the cache key of a build step: a hash of its parent's key
// (or, for a FROM, of the digests of the layers it names), the step's
// text with its variables expanded, and the digests of the context files
// it reads (COPY, ADD), in order.
func StepKey(parent, step string, inputs ...string) string {
	h := sha256.New()
	for _, s := range append([]string{parent, step}, inputs...) {
		// Length-prefixed: no two lists of strings hash alike.
		h.Write([]byte{byte(len(s) >> 24), byte(len(s) >> 16), byte(len(s) >> 8), byte(len(s))})
		h.Write([]byte(s))
	}
	return hex.EncodeToString(h.Sum(nil))
}

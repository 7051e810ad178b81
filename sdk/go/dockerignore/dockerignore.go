// Package dockerignore reads a build context's .dockerignore and says
// which of its files are left out, as docker does. The CLI and the Go SDK
// use it to leave them out of the upload; the server's Dockerfile builder
// (internal/dockerfile, internal/node) to leave them out of the context.
// It is public so that the client build links nothing of the server.
package dockerignore

import (
	"fmt"
	"path"
	"strings"
)

// Matcher is a parsed .dockerignore: patterns in path.Match syntax plus
// "**" (any number of directories), matched against slash-separated
// paths relative to the context's root; a pattern starting with "!"
// re-includes what earlier patterns excluded; the last match wins. A
// pattern excludes a directory's whole contents too.
type Matcher struct {
	rules []ignoreRule
}

type ignoreRule struct {
	parts   []string
	exclude bool
}

// Parse reads a .dockerignore.
func Parse(src []byte) (*Matcher, error) {
	ig := &Matcher{}
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
				return nil, fmt.Errorf(".dockerignore pattern %.64q: %v", l, err)
			}
		}
		ig.rules = append(ig.rules, ignoreRule{parts: parts, exclude: ex})
	}
	return ig, nil
}

// HasExceptions says whether a "!" pattern re-includes anything.
func (ig *Matcher) HasExceptions() bool {
	for _, r := range ig.rules {
		if !r.exclude {
			return true
		}
	}
	return false
}

// Excluded says whether rel (slash-separated, relative to the context's
// root) is left out of the context.
func (ig *Matcher) Excluded(rel string) bool {
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

package dockerfile

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

func TestParse(t *testing.T) {
	src := "# syntax=docker/dockerfile:1\n" +
		"# escape=\\\n" +
		"FROM base:1 AS build\n" +
		"\n" +
		"# a comment\n" +
		"run echo a \\\n" +
		"  # a comment inside\n" +
		"  && echo b\n" +
		"COPY --from=build --chown=1:2 [\"a b\", \"/c\"]\n" +
		"CMD [\"sh\", \"-c\", \"x\"]\n" +
		"ENV A=1 B=\"two words\"\n"
	f, err := Parse([]byte(src))
	if err != nil {
		t.Fatal(err)
	}
	want := []Instruction{
		{Line: 3, Cmd: "FROM", Args: []string{"base:1 AS build"}},
		{Line: 6, Cmd: "RUN", Args: []string{"echo a && echo b"}},
		{Line: 9, Cmd: "COPY", Flags: []string{"--from=build", "--chown=1:2"}, Args: []string{"a b", "/c"}, JSON: true},
		{Line: 10, Cmd: "CMD", Args: []string{"sh", "-c", "x"}, JSON: true},
		{Line: 11, Cmd: "ENV", Args: []string{`A=1 B="two words"`}},
	}
	if len(f.Instructions) != len(want) {
		t.Fatalf("%d instructions, want %d: %+v", len(f.Instructions), len(want), f.Instructions)
	}
	for i, w := range want {
		g := f.Instructions[i]
		if g.Line != w.Line || g.Cmd != w.Cmd || !slices.Equal(g.Flags, w.Flags) || !slices.Equal(g.Args, w.Args) || g.JSON != w.JSON {
			t.Errorf("instruction %d = %+v, want %+v", i, g, w)
		}
	}
	if v, ok := f.Instructions[2].Flag("from"); !ok || v != "build" {
		t.Errorf("--from = %q %v", v, ok)
	}
	if err := f.Instructions[2].CheckFlags("from"); err == nil || !strings.Contains(err.Error(), "line 9") {
		t.Errorf("CheckFlags(from) = %v, want --chown refused naming line 9", err)
	}
}

func TestParseEscapeDirective(t *testing.T) {
	f, err := Parse([]byte("# escape=`\nFROM b\nRUN dir c:\\ `\n  && echo x\n"))
	if err != nil {
		t.Fatal(err)
	}
	if f.Escape != '`' || f.Instructions[1].Args[0] != `dir c:\ && echo x` {
		t.Errorf("escape %q, RUN %q", f.Escape, f.Instructions[1].Args)
	}
}

func TestParseErrors(t *testing.T) {
	for _, tc := range []struct{ src, want string }{
		{"FROM b\nFROBNICATE x\n", "line 2: unknown instruction"},
		{"FROM b\nRUN <<EOF\necho\nEOF\n", "line 2: RUN with a heredoc"},
		{"FROM b\nCOPY <<-\"X\" /a\n", "line 2: COPY with a heredoc"},
		{"FROM b\nSHELL /bin/bash -c\n", "line 2: SHELL takes a JSON array"},
		{"# escape=x\nFROM b\n", "line 1: escape directive"},
		{"\n\n# only a comment\n", "no instructions"},
		{"FROM b\nRUN -- x\n", "line 2: RUN: an empty flag"},
		{"FROM b\nRUN --network=none x\n", ""},
		{strings.Repeat("RUN x\n", MaxInstructions+1), "more than 256 instructions"},
	} {
		_, err := Parse([]byte(tc.src))
		if tc.want == "" {
			if err != nil {
				t.Errorf("%q: %v", tc.src, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tc.want) || !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%.40q: err = %v, want invalid argument with %q", tc.src, err, tc.want)
		}
	}
	// BuildKit's RUN --mount, refused by the builder through CheckFlags.
	f, err := Parse([]byte("FROM b\nRUN --mount=type=cache,target=/x make\n"))
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Instructions[1].CheckFlags(); err == nil || !strings.Contains(err.Error(), "line 2: RUN --mount is not supported (BuildKit") {
		t.Errorf("RUN --mount: %v", err)
	}
}

func TestWordsExpand(t *testing.T) {
	w, err := Words(`A=1 B="two words" C='$x' D=a\ b`, '\\')
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(w, []string{"A=1", "B=two words", "C=$x", "D=a b"}) {
		t.Errorf("Words = %q", w)
	}
	if _, err := Words(`A="x`, '\\'); err == nil {
		t.Error("unterminated quote accepted")
	}
	env := map[string]string{"HOME": "/root", "E": ""}
	look := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	for in, want := range map[string]string{
		"$HOME/x":           "/root/x",
		"${HOME}x":          "/rootx",
		"${NOPE:-def}":      "def",
		"${E:-def}":         "def",
		"${HOME:+alt}":      "alt",
		"${NOPE:+alt}":      "",
		`\$HOME`:            "$HOME",
		"a$":                "a$",
		"pre${HOME}post$E.": "pre/rootpost.",
	} {
		got, err := Expand(in, '\\', look)
		if err != nil || got != want {
			t.Errorf("Expand(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, bad := range []string{"${HOME", "${HOME:?x}", "${1x}"} {
		if _, err := Expand(bad, '\\', look); err == nil {
			t.Errorf("Expand(%q) accepted", bad)
		}
	}
}

func TestStepKey(t *testing.T) {
	base := StepKey("p", "RUN x", "a=1")
	seen := map[string]string{base: "base"}
	for name, k := range map[string]string{
		"parent": StepKey("q", "RUN x", "a=1"),
		"step":   StepKey("p", "RUN y", "a=1"),
		"input":  StepKey("p", "RUN x", "a=2"),
		"more":   StepKey("p", "RUN x", "a=1", ""),
		"split":  StepKey("pR", "UN x", "a=1"),
		"none":   StepKey("p", "RUN x"),
	} {
		if prev, ok := seen[k]; ok {
			t.Errorf("key of %s = key of %s", name, prev)
		}
		seen[k] = name
	}
	if StepKey("p", "RUN x", "a=1") != base {
		t.Error("not deterministic")
	}
}

func FuzzDockerfile(f *testing.F) {
	for _, s := range []string{
		"FROM b\nRUN a \\\n b\n", "# escape=`\nFROM b\nRUN a `\n", "FROM b\nCOPY [\"a\", \"b\"]\n",
		"FROM b\nENV A=\"x y\" B=${A:-z}\n", "FROM b\nRUN <<EOF\n", "\ufeffFROM b\r\nCMD [\"x\"\r\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, src []byte) {
		fi, err := Parse(src)
		if err != nil {
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("error not invalid_argument: %v", err)
			}
			return
		}
		for _, in := range fi.Instructions {
			if !known[in.Cmd] || in.Line < 1 {
				t.Fatalf("instruction %+v", in)
			}
			for _, a := range in.Args {
				if w, err := Words(a, fi.Escape); err == nil {
					_ = w
				}
				Expand(a, fi.Escape, func(string) (string, bool) { return "v", true })
			}
		}
	})
}

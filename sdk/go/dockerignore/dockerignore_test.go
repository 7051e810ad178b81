package dockerignore

import "testing"

func TestIgnore(t *testing.T) {
	ig, err := Parse([]byte("# c\n*.log\nbuild/\n**/secret*\n!keep.log\n/docs/*.md\n"))
	if err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]bool{
		"a.log": true, "keep.log": false, "sub/a.log": false, "build": true, "build/x/y": true,
		"secret": true, "a/b/secret.txt": true, "docs/r.md": true, "docs/x/r.md": false, "main.go": false,
	} {
		if got := ig.Excluded(p); got != want {
			t.Errorf("Excluded(%q) = %v, want %v", p, got, want)
		}
	}
	if _, err := Parse([]byte("[\n")); err == nil {
		t.Error("bad pattern accepted")
	}
}

// TestStepKey: the key changes with each of its parts, and parts do not
// run into each other.

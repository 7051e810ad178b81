package agent

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

func TestListTreeDepth(t *testing.T) {
	c := startAgent(t)
	dir := tempDir(t)
	for _, d := range []string{"a/b/c", "a-b", "e"} {
		os.MkdirAll(filepath.Join(dir, d), 0o755)
	}
	for _, f := range []string{"top", "a/one", "a/b/two", "a/b/c/three", "a-b/x"} {
		mustWrite(t, filepath.Join(dir, f), f)
	}
	os.Symlink(filepath.Join(dir, "a"), filepath.Join(dir, "link")) // not followed
	ctx := context.Background()
	list := func(depth int) string {
		t.Helper()
		ents, err := c.ListTree(ctx, dir+"/", depth)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, e := range ents {
			rel := strings.TrimPrefix(e.Path, dir+"/")
			if e.Name != filepath.Base(e.Path) {
				t.Errorf("entry %s has name %q", e.Path, e.Name)
			}
			if e.IsDir {
				rel += "/"
			}
			if e.Symlink != "" {
				rel += "@"
			}
			out = append(out, rel)
		}
		return strings.Join(out, " ")
	}
	for depth, want := range map[int]string{
		0: "a/ a-b/ e/ link@ top",
		1: "a/ a-b/ e/ link@ top",
		2: "a/ a/b/ a/one a-b/ a-b/x e/ link@ top",
		3: "a/ a/b/ a/b/c/ a/b/two a/one a-b/ a-b/x e/ link@ top",
		9: "a/ a/b/ a/b/c/ a/b/c/three a/b/two a/one a-b/ a-b/x e/ link@ top",
	} {
		if got := list(depth); got != want {
			t.Errorf("depth %d:\n got %s\nwant %s", depth, got, want)
		}
	}
	if _, err := c.ListTree(ctx, filepath.Join(dir, "top"), 2); !errors.Is(err, fs.ErrInvalid) {
		t.Errorf("list of a file: %v", err)
	}
	if _, err := c.ListTree(ctx, filepath.Join(dir, "none"), 2); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("list of a missing dir: %v", err)
	}
	if _, err := c.ListTree(ctx, dir, -1); !errors.Is(err, fs.ErrInvalid) {
		t.Errorf("negative depth: %v", err)
	}
}

func TestListTreeBounded(t *testing.T) {
	c := startAgent(t)
	dir := tempDir(t)
	sub := filepath.Join(dir, "sub")
	os.Mkdir(sub, 0o755)
	for i := range MaxListEntries {
		if err := os.WriteFile(filepath.Join(sub, strconv.Itoa(i)), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	ctx := context.Background()
	// sub and its entries: one too many.
	_, err := c.ListTree(ctx, dir, 2)
	var ae *Error
	if !errors.As(err, &ae) || ae.Code != CodeTooMany || !strings.Contains(err.Error(), "10000") {
		t.Fatalf("got %v, want a %s error naming the limit", err, CodeTooMany)
	}
	ents, err := c.ListTree(ctx, sub, 2)
	if err != nil || len(ents) != MaxListEntries {
		t.Fatalf("exactly the limit: %d entries, %v", len(ents), err)
	}
	// A plain list (depth 1) is not bounded.
	if ents, err := c.ListDir(ctx, sub); err != nil || len(ents) != MaxListEntries {
		t.Fatalf("depth 1: %d entries, %v", len(ents), err)
	}
}

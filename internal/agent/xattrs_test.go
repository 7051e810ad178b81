package agent

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestWriteFileXattrs(t *testing.T) {
	c := startAgent(t)
	dir, err := os.MkdirTemp("", "xattrs")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p := filepath.Join(dir, "a.txt")
	meta := map[string]string{"e2b.author": "model-7", "e2b.step": "3"}
	if _, err := c.WriteFileXattrs(ctx, p, 0, strings.NewReader("x"), meta); err != nil {
		if errors.Is(err, fs.ErrPermission) || strings.Contains(err.Error(), "not supported") {
			t.Skipf("no user xattrs on %s: %v", dir, err)
		}
		t.Fatal(err)
	}
	fi, err := c.WithXattrs().Stat(ctx, p)
	if err != nil || fi.Xattrs["e2b.author"] != "model-7" || fi.Xattrs["e2b.step"] != "3" || len(fi.Xattrs) != 2 {
		t.Fatalf("stat: %v %v", fi.Xattrs, err)
	}
	if fi, _ := c.Stat(ctx, p); fi.Xattrs != nil {
		t.Fatalf("xattrs without asking: %v", fi.Xattrs)
	}
	ents, err := c.WithXattrs().ListDir(ctx, dir)
	if err != nil || len(ents) != 1 || ents[0].Xattrs["e2b.step"] != "3" {
		t.Fatalf("list: %+v %v", ents, err)
	}
	tree, err := c.WithXattrs().ListTree(ctx, dir, 2)
	if err != nil || len(tree) != 1 || tree[0].Xattrs["e2b.author"] != "model-7" {
		t.Fatalf("tree: %+v %v", tree, err)
	}
	// Bounded: too many, too large.
	many := map[string]string{}
	for i := 0; i < 65; i++ {
		many[strings.Repeat("k", i+1)] = "v"
	}
	if _, err := c.WriteFileXattrs(ctx, p, 0, strings.NewReader("y"), many); !errors.Is(err, fs.ErrInvalid) {
		t.Fatalf("65 attributes: %v", err)
	}
	if _, err := c.WriteFileXattrs(ctx, p, 0, strings.NewReader("y"), map[string]string{"big": strings.Repeat("v", 4097)}); !errors.Is(err, fs.ErrInvalid) {
		t.Fatalf("a 4097-byte value: %v", err)
	}
	if b, _ := os.ReadFile(p); string(b) != "x" {
		t.Fatalf("a refused write changed the file: %q", b)
	}
}

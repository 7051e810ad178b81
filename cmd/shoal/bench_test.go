//go:build !client

package main

import (
	"io"
	"os"
	"testing"
)

// A benchmark's progress, stderr not a terminal: a line per stage, then
// one per quarter.
func TestBenchProgressLines(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	b := benchProgress(w)
	for _, stage := range []string{"create", "delete"} {
		for i := 0; i <= 8; i++ {
			b.update(stage, i, 8)
		}
	}
	b.clear()
	w.Close()
	out, _ := io.ReadAll(r)
	want := "create: 8 steps\n  create 25% (2 / 8 steps)\n  create 50% (4 / 8 steps)\n  create 75% (6 / 8 steps)\n" +
		"delete: 8 steps\n  delete 25% (2 / 8 steps)\n  delete 50% (4 / 8 steps)\n  delete 75% (6 / 8 steps)\n"
	if string(out) != want {
		t.Fatalf("got:\n%s\nwant:\n%s", out, want)
	}
}

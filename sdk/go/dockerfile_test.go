package shoal

import (
	"archive/tar"
	"bytes"
	"io"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// TestDockerignoreUpload: the upload of a build context leaves out what
// .dockerignore says, but never the Dockerfile or the .dockerignore, and
// keeps directories a "!" pattern could take files back from.
func TestDockerignoreUpload(t *testing.T) {
	dir := t.TempDir()
	for p, c := range map[string]string{
		".dockerignore":      "*.log\nbuild\nsub/Dockerfile.dev\n!build/keep\nsecret*\n",
		"a.txt":              "a",
		"x.log":              "log",
		"build/out":          "out",
		"build/keep":         "keep",
		"sub/Dockerfile.dev": "FROM b",
		"secret.key":         "k",
	} {
		os.MkdirAll(filepath.Join(dir, filepath.Dir(p)), 0o755)
		if err := os.WriteFile(filepath.Join(dir, p), []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	skip, err := ignoreFilter(dir, "sub/Dockerfile.dev")
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := writeTar(&buf, dir, skip); err != nil {
		t.Fatal(err)
	}
	var names []string
	tr := tar.NewReader(&buf)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, h.Name)
	}
	want := []string{"./", ".dockerignore", "a.txt", "build/", "build/keep", "sub/", "sub/Dockerfile.dev"}
	if !slices.Equal(names, want) {
		t.Errorf("uploaded %q, want %q", names, want)
	}
}

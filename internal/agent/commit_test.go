package agent

import (
	"archive/tar"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// An agent without a writable layer of its own (a container's) refuses an
// export as unsupported; one with it (a VM's) streams it as a tar, the
// root first, hard links as links, to the end.
func TestExportUpper(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := startAgent(t).ExportUpper(ctx, 0)
	var ae *Error
	if !errors.As(err, &ae) || ae.Code != CodeUnsupported {
		t.Fatalf("export without an upper: %v, want unsupported", err)
	}

	upper := t.TempDir()
	os.MkdirAll(filepath.Join(upper, "a/b"), 0o750)
	os.WriteFile(filepath.Join(upper, "a/b/f"), []byte("data"), 0o600)
	os.Link(filepath.Join(upper, "a/b/f"), filepath.Join(upper, "a/g"))
	os.Symlink("/nowhere", filepath.Join(upper, "a/l"))
	up, err := os.Open(upper)
	if err != nil {
		t.Fatal(err)
	}
	defer up.Close()
	srv := NewServer(Config{Upper: up})
	sock := shortSocket(t)
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go srv.Serve(l)
	rc, err := NewClient(sock).ExportUpper(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	tr := tar.NewReader(rc)
	got := map[string]*tar.Header{}
	var order []string
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got[h.Name] = h
		order = append(order, h.Name)
	}
	if _, err := io.Copy(io.Discard, rc); err != nil {
		t.Fatalf("after the archive: %v", err)
	}
	if len(order) != 6 || order[0] != "." {
		t.Fatalf("entries %v: want the root first, then 5", order)
	}
	f, g := got["a/b/f"], got["a/g"]
	if f == nil || g == nil || (f.Typeflag == tar.TypeLink) == (g.Typeflag == tar.TypeLink) {
		t.Fatalf("hard links: %+v %+v: want one file and one link to it", f, g)
	}
	if l := got["a/l"]; l == nil || l.Typeflag != tar.TypeSymlink || l.Linkname != "/nowhere" {
		t.Errorf("symlink: %+v", l)
	}
	if d := got["a/b"]; d == nil || d.Typeflag != tar.TypeDir || d.Mode != 0o750 {
		t.Errorf("dir: %+v", d)
	}
}

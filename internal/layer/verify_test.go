package layer

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// mkfsOutside makes an EROFS image of tree with mkfs.erofs directly, as a
// tenant would outside Shoal, with extra mkfs options.
func mkfsOutside(t testing.TB, tree string, opts ...string) []byte {
	t.Helper()
	img := filepath.Join(t.TempDir(), "outside.erofs")
	out, err := exec.Command("mkfs.erofs", append(append([]string{"--quiet"}, opts...), img, tree)...).CombinedOutput()
	if err != nil {
		t.Fatalf("mkfs.erofs: %v: %s", err, out)
	}
	b, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// exportOf wraps an image in the export format, with its true digest and
// size.
func exportOf(t testing.TB, img []byte, name string) []byte {
	t.Helper()
	h := sha256.Sum256(img)
	l := Layer{Name: name, Version: "1", Kind: KindWorkspace, Digest: "sha256:" + hex.EncodeToString(h[:]), Size: int64(len(img)), Compression: "none",
		Files: 1, ContentBytes: 1} // the importer's word, replaced by the walk's
	var buf bytes.Buffer
	if err := WriteExport(context.Background(), &buf, l, bytes.NewReader(img)); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// TestImportRefusesUntrustedImages imports images made outside Shoal: one
// holding a character device (mem, 1:1), a block device, a fifo, a socket
// or a set-user-ID file is refused with the reason and leaves nothing
// behind (no image, no tag, no scratch file); one holding regular files,
// directories, symlinks, hard links and overlayfs whiteouts is accepted,
// with its counts from the walk; a set-ID file is accepted for the admin.
func TestImportRefusesUntrustedImages(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	good := writeTree(t, filepath.Join(e.root, "good"), map[string]string{"etc/hosts": "127.0.0.1 x\n", "a/b/c": strings.Repeat("y", 10000)})
	if err := os.Symlink("/etc/hosts", filepath.Join(good, "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(filepath.Join(good, "a/b/c"), filepath.Join(good, "hard")); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mknod(filepath.Join(good, "a/deleted"), unix.S_IFCHR|0o000, 0); err != nil { // a whiteout
		t.Fatal(err)
	}
	for i := 0; i < 300; i++ { // directories of more than one block
		if err := os.WriteFile(filepath.Join(good, "a", strings.Repeat("n", 40)+string(rune('a'+i%26))+strings.Repeat("x", i%7)+string(rune('0'+i/26))), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	empty := func() {
		t.Helper()
		tmp, _ := os.ReadDir(filepath.Join(e.dir, "tmp"))
		blobs, _ := os.ReadDir(filepath.Join(e.dir, "blobs", "sha256"))
		ls, _ := e.store.List()
		if len(tmp) != 0 || len(blobs) != 0 || len(ls) != 0 {
			t.Fatalf("left behind: tmp %v, blobs %v, tags %v", tmp, blobs, ls)
		}
	}
	bad := []struct {
		name  string
		make  func(dir string) error
		want  string
		setid bool
	}{
		{"mem", func(d string) error {
			return unix.Mknod(filepath.Join(d, "mem"), unix.S_IFCHR|0o600, int(unix.Mkdev(1, 1)))
		}, "mem is a character device 1:1", false},
		{"kmsg", func(d string) error {
			os.MkdirAll(filepath.Join(d, "dev"), 0o755)
			return unix.Mknod(filepath.Join(d, "dev/kmsg"), unix.S_IFCHR|0o644, int(unix.Mkdev(1, 11)))
		}, "/dev/kmsg is a character device 1:11", false},
		{"disk", func(d string) error {
			return unix.Mknod(filepath.Join(d, "sda"), unix.S_IFBLK|0o600, int(unix.Mkdev(8, 0)))
		}, "sda is a block device", false},
		{"fifo", func(d string) error { return unix.Mkfifo(filepath.Join(d, "pipe"), 0o644) }, "pipe is a fifo", false},
		{"setuid", func(d string) error {
			p := filepath.Join(d, "su")
			if err := os.WriteFile(p, []byte("#!/bin/sh\n"), 0o755); err != nil {
				return err
			}
			return os.Chmod(p, 0o4755|os.ModeSetuid)
		}, "su is set-user-ID or set-group-ID", true},
	}
	for _, tt := range bad {
		t.Run(tt.name, func(t *testing.T) {
			tree := writeTree(t, filepath.Join(t.TempDir(), "tree"), map[string]string{"ok": "fine\n"})
			if err := tt.make(tree); err != nil {
				t.Fatal(err)
			}
			img := mkfsOutside(t, tree)
			_, err := e.store.Import(ctx, bytes.NewReader(exportOf(t, img, tt.name)), ImportOptions{Tenant: "a"})
			if !errors.Is(err, ErrBadImage) || !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("import: %v; want refused: %q", err, tt.want)
			}
			empty()
			if tt.setid { // the admin may
				l, err := e.store.Import(ctx, bytes.NewReader(exportOf(t, img, tt.name)), ImportOptions{AllowSetID: true})
				if err != nil {
					t.Fatalf("the admin's import of a set-ID file: %v", err)
				}
				if _, err := e.store.Remove(l.Ref(), nil); err != nil {
					t.Fatal(err)
				}
				if _, err := e.store.Remove(l.Digest, nil); err != nil && !errors.Is(err, ErrNotFound) {
					t.Fatal(err)
				}
				empty()
			}
		})
	}

	// A good image, made outside Shoal (compressed too), is accepted and
	// mounts; its counts are the walk's.
	for _, opts := range [][]string{nil, {"-zlz4hc"}} {
		img := mkfsOutside(t, good, opts...)
		l, err := e.store.Import(ctx, bytes.NewReader(exportOf(t, img, "good")), ImportOptions{Tenant: "a"})
		if err != nil {
			t.Fatalf("import a good image (%v): %v", opts, err)
		}
		if l.Tenant != "a" || l.Files != 308 || l.ContentBytes != int64(len("127.0.0.1 x\n")+2*10000) {
			t.Fatalf("imported %+v: want tenant a, 308 entries, the walk's bytes", l)
		}
		mnt, err := e.store.Acquire(l.Digest)
		if err != nil {
			t.Fatal(err)
		}
		if got := readFile(t, filepath.Join(mnt, "etc/hosts")); got != "127.0.0.1 x\n" {
			t.Fatalf("mounted import reads %q", got)
		}
		if err := e.store.Release(l.Digest); err != nil {
			t.Fatal(err)
		}
	}

	// An image whose metadata the walk accepts but whose compressed data
	// is corrupt: refused by fsck.erofs.
	big := writeTree(t, filepath.Join(e.root, "big"), map[string]string{"data": strings.Repeat("compressible data ", 20000)})
	img := mkfsOutside(t, big, "-zlz4hc")
	if _, err := checkErofs(ctx, bytes.NewReader(img), int64(len(img)), false); err != nil {
		t.Fatal(err)
	}
	for i := 4096 + 64; i < len(img); i++ { // the data, after the first block (superblock, inodes)
		img[i] ^= 0x5a
	}
	if _, err := e.store.Import(ctx, bytes.NewReader(exportOf(t, img, "corrupt")), ImportOptions{Tenant: "a"}); !errors.Is(err, ErrBadImage) || !strings.Contains(err.Error(), "fsck.erofs") {
		t.Fatalf("import a corrupt image: %v; want refused by fsck.erofs", err)
	}
	if tmp, _ := os.ReadDir(filepath.Join(e.dir, "tmp")); len(tmp) != 0 {
		t.Fatalf("a refused import left %v", tmp)
	}
}

// TestCheckErofsMalformed: truncated, mangled and cyclic images are
// refused by the walk without a panic, whatever bytes they hold.
func TestCheckErofsMalformed(t *testing.T) {
	needRoot(t)
	tree := writeTree(t, filepath.Join(t.TempDir(), "tree"), map[string]string{"d/e/f": "x", "g": "y"})
	img := mkfsOutside(t, tree)
	if _, err := checkErofs(context.Background(), bytes.NewReader(img), int64(len(img)), false); err != nil {
		t.Fatalf("a good image: %v", err)
	}
	for _, n := range []int{0, 1024, 1100, len(img) / 2, len(img) - 1} {
		if _, err := checkErofs(context.Background(), bytes.NewReader(img[:n]), int64(n), false); !errors.Is(err, ErrBadImage) {
			t.Fatalf("truncated at %d: %v", n, err)
		}
	}
	mangled := bytes.Clone(img)
	mangled[1024+80] = 0x80 // an incompatible feature the walk does not know
	if _, err := checkErofs(context.Background(), bytes.NewReader(mangled), int64(len(img)), false); !errors.Is(err, ErrBadImage) {
		t.Fatalf("unknown feature: %v", err)
	}
}

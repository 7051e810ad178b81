package layer

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// TestCommitStreamSameLayer commits one sandbox-like overlay's upper twice:
// read on the host (a container's commit) and as the commit stream a VM's
// agent sends of it (agent.WriteUpper, read back by the stream extractor).
// Both must give the same image, digest for digest: whiteouts, opaque
// directories, hard links, symlinks, owners, modes and xattrs alike.
func TestCommitStreamSameLayer(t *testing.T) {
	e := newEnv(t)
	base := e.build(t, "base", "1", writeTree(t, t.TempDir(), map[string]string{
		"etc/keep": "keep", "etc/gone": "gone", "etc/edit": "old",
		"opaque/old1": "x", "opaque/sub/old2": "x", "tree/a/b/c": "deep",
	}))
	root, upper := sandboxRoot(t, e, "sb1", base)
	must(t, os.Remove(filepath.Join(root, "etc/gone")))
	must(t, os.WriteFile(filepath.Join(root, "etc/edit"), []byte("new"), 0o600))
	must(t, os.RemoveAll(filepath.Join(root, "opaque")))
	must(t, os.MkdirAll(filepath.Join(root, "opaque/sub"), 0o750))
	must(t, os.WriteFile(filepath.Join(root, "opaque/sub/fresh"), []byte("fresh"), 0o644))
	must(t, os.RemoveAll(filepath.Join(root, "tree/a")))
	must(t, os.MkdirAll(filepath.Join(root, "repo/deep/er"), 0o755))
	must(t, os.WriteFile(filepath.Join(root, "repo/main.py"), bytes.Repeat([]byte("print(1)\n"), 20000), 0o4755))
	must(t, os.Link(filepath.Join(root, "repo/main.py"), filepath.Join(root, "repo/deep/er/main2.py")))
	must(t, os.Symlink("/etc/passwd", filepath.Join(root, "repo/link")))
	must(t, unix.Setxattr(filepath.Join(root, "repo/main.py"), "user.shoal", []byte("yes"), 0))
	must(t, os.Chown(filepath.Join(root, "repo/deep"), 1000, 1001))
	must(t, os.MkdirAll(filepath.Join(root, ".shoal"), 0o755))
	must(t, os.WriteFile(filepath.Join(root, ".shoal/agent"), nil, 0o755))

	host, err := e.store.Commit(context.Background(), CommitOptions{
		Kind: KindWorkspace, Name: "ws", Version: "host", Upper: upper, Exclude: []string{"/.shoal"},
	})
	must(t, err)
	var depth int
	guest, err := e.store.Commit(context.Background(), CommitOptions{
		Kind: KindWorkspace, Name: "ws", Version: "guest", Exclude: []string{"/.shoal"},
		Export: func(ctx context.Context, maxDepth int) (io.ReadCloser, error) {
			depth = maxDepth
			return agentStream(t, upper, maxDepth), nil
		},
	})
	must(t, err)
	if depth != DefaultCommitMaxDepth {
		t.Errorf("export asked for depth %d, want %d", depth, DefaultCommitMaxDepth)
	}
	if host.Digest != guest.Digest {
		img1, _ := e.store.Acquire(host.Digest)
		img2, _ := e.store.Acquire(guest.Digest)
		t.Fatalf("a streamed commit differs from a host one: %s vs %s\nhost:  %v\nguest: %v", host.Digest, guest.Digest, treeOf(t, img1), treeOf(t, img2))
	}
	img, err := e.store.Acquire(guest.Digest)
	must(t, err)
	defer e.store.Release(guest.Digest)
	tree := treeOf(t, img)
	if tree["etc/gone"] != "c:0:0" || tree["tree/a"] != "c:0:0" {
		t.Errorf("whiteouts lost: %v", tree)
	}
	if v, err := getXattr(filepath.Join(img, "opaque"), ovlOpaque); err != nil || string(v) != "y" {
		t.Errorf("opaque dir: %q, %v", v, err)
	}
}

// agentStream is the guest agent's commit stream of upper.
func agentStream(t *testing.T, upper string, maxDepth int) io.ReadCloser {
	f, err := os.Open(upper)
	if err != nil {
		t.Fatal(err)
	}
	pr, pw := io.Pipe()
	go func() {
		defer f.Close()
		pw.CloseWithError(agent.WriteUpper(pw, f, maxDepth))
	}()
	return pr
}

// streamEntry is one entry of a crafted commit stream.
type streamEntry struct {
	hdr  tar.Header
	body string
}

func sDir(name string) streamEntry {
	return streamEntry{hdr: tar.Header{Typeflag: tar.TypeDir, Name: name, Mode: 0o755}}
}
func sFile(name, body string) streamEntry {
	return streamEntry{hdr: tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, Size: int64(len(body))}, body: body}
}
func sLink(typ byte, name, target string) streamEntry {
	return streamEntry{hdr: tar.Header{Typeflag: typ, Name: name, Linkname: target, Mode: 0o777}}
}

// craft writes entries as a pax tar; raw headers (a size that lies, say)
// are written as they are.
func craft(t *testing.T, entries ...streamEntry) []byte {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, e := range entries {
		h := e.hdr
		h.Format = tar.FormatPAX
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatalf("craft %s: %v", h.Name, err)
		}
		if e.body != "" {
			if _, err := io.WriteString(tw, e.body); err != nil && !errors.Is(err, tar.ErrWriteTooLong) {
				t.Fatal(err)
			}
		}
	}
	tw.Flush()
	if err := tw.Close(); err != nil && !strings.Contains(err.Error(), "missed writing") {
		t.Fatal(err)
	}
	return b.Bytes()
}

func extractCrafted(t *testing.T, stream []byte, lim commitLimits) (string, error) {
	t.Helper()
	tree := filepath.Join(t.TempDir(), "root")
	must(t, os.Mkdir(tree, 0o755))
	if lim.bytes == 0 {
		lim = commitLimits{bytes: 1 << 20, entries: 100, depth: 8}
	}
	return tree, extractCommitStream(context.Background(), bytes.NewReader(stream), tree, map[string]bool{".shoal": true}, lim, 4000, nil)
}

// TestCommitStreamExtract: what a well-formed stream holds lands in the
// tree as a host commit would copy it.
func TestCommitStreamExtract(t *testing.T) {
	needRoot(t)
	opaque := sDir("o")
	opaque.hdr.PAXRecords = map[string]string{"SCHILY.xattr." + ovlOpaque: "y", "SCHILY.xattr.trusted.overlay.origin": "junk"}
	f := sFile("d/f", "hello")
	f.hdr.Uid, f.hdr.Gid, f.hdr.Mode = 1000, 1001, 0o2750
	f.hdr.PAXRecords = map[string]string{"SCHILY.xattr.user.k": "v\x00binary"}
	wh := streamEntry{hdr: tar.Header{Typeflag: tar.TypeChar, Name: "d/gone", Mode: 0o600, Uid: 5, Gid: 5}}
	tree, err := extractCrafted(t, craft(t, sDir("."), sDir("d"), f, sLink(tar.TypeSymlink, "d/s", "/etc/shadow"),
		sLink(tar.TypeLink, "d/h", "d/f"), wh, opaque, sDir(".shoal"), sFile(".shoal/x", "skip")), commitLimits{})
	must(t, err)
	got := treeOf(t, tree)
	want := map[string]string{"d": "d", "d/f": "f:hello", "d/s": "l:/etc/shadow", "d/h": "f:hello", "d/gone": "c:0:0", "o": "d"}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %q, want %q (tree %v)", k, got[k], v, got)
		}
	}
	if len(got) != len(want) {
		t.Errorf("tree %v, want %v", got, want)
	}
	var st unix.Stat_t
	must(t, unix.Lstat(filepath.Join(tree, "d/f"), &st))
	if st.Uid != 1000 || st.Gid != 1001 || st.Mode&0o7777 != 0o2750 || st.Nlink != 2 {
		t.Errorf("d/f: uid %d gid %d mode %#o nlink %d", st.Uid, st.Gid, st.Mode&0o7777, st.Nlink)
	}
	must(t, unix.Lstat(filepath.Join(tree, "d/gone"), &st))
	if st.Uid != 0 || st.Gid != 0 {
		t.Errorf("whiteout owned by %d:%d, want 0:0", st.Uid, st.Gid)
	}
	if v, err := getXattr(filepath.Join(tree, "d/f"), "user.k"); err != nil || string(v) != "v\x00binary" {
		t.Errorf("d/f user.k = %q, %v", v, err)
	}
	if v, err := getXattr(filepath.Join(tree, "o"), ovlOpaque); err != nil || string(v) != "y" {
		t.Errorf("o opaque = %q, %v", v, err)
	}
	if _, err := getXattr(filepath.Join(tree, "o"), "trusted.overlay.origin"); err == nil {
		t.Errorf("o kept trusted.overlay.origin")
	}
}

// TestCommitStreamRefusesHostile: streams that try to write outside the
// tree, through a symlink, a device, or past the bounds are refused, and
// nothing outside the tree changes.
func TestCommitStreamRefusesHostile(t *testing.T) {
	needRoot(t)
	outside := t.TempDir() // what an escape would reach
	victim := filepath.Join(outside, "victim")
	must(t, os.WriteFile(victim, []byte("host"), 0o644))
	rel, err := filepath.Rel("/", outside)
	must(t, err)
	redirect := sDir("r")
	redirect.hdr.PAXRecords = map[string]string{"SCHILY.xattr." + ovlRedirect: "/x"}
	huge := streamEntry{hdr: tar.Header{Typeflag: tar.TypeReg, Name: "big", Mode: 0o644, Size: 1 << 40}}
	short := streamEntry{hdr: tar.Header{Typeflag: tar.TypeReg, Name: "short", Mode: 0o644, Size: 100}, body: "ten bytes!"}
	dirData := streamEntry{hdr: tar.Header{Typeflag: tar.TypeDir, Name: "d", Mode: 0o755, Size: 10}, body: "0123456789"}
	excludedHuge := streamEntry{hdr: tar.Header{Typeflag: tar.TypeReg, Name: ".shoal/big", Mode: 0o644, Size: 1 << 40}}
	dev := streamEntry{hdr: tar.Header{Typeflag: tar.TypeChar, Name: "mem", Devmajor: 1, Devminor: 1}}
	var deep []streamEntry
	p := ""
	for i := 0; i < 10; i++ {
		p = filepath.Join(p, "d")
		deep = append(deep, sDir(p))
	}
	var many []streamEntry
	for i := 0; i < 200; i++ {
		many = append(many, sFile("f"+strings.Repeat("x", i), "x"))
	}
	for _, tc := range []struct {
		name    string
		entries []streamEntry
		kind    error
	}{
		{"dotdot", []streamEntry{sDir("."), sFile("../../../../../../../../"+rel+"/victim", "pwned")}, errdefs.ErrInvalidArgument},
		{"dotdot inside", []streamEntry{sDir("."), sDir("a"), sFile("a/../../victim", "pwned")}, errdefs.ErrInvalidArgument},
		{"absolute", []streamEntry{sDir("."), sFile(victim, "pwned")}, errdefs.ErrInvalidArgument},
		{"symlink then file through it", []streamEntry{sDir("."), sLink(tar.TypeSymlink, "l", outside), sFile("l/victim", "pwned")}, errdefs.ErrInvalidArgument},
		{"symlink then file over it", []streamEntry{sDir("."), sLink(tar.TypeSymlink, "l", victim), sFile("l", "pwned")}, errdefs.ErrInvalidArgument},
		{"symlink then dir through it", []streamEntry{sDir("."), sLink(tar.TypeSymlink, "l", outside), sDir("l/new")}, errdefs.ErrInvalidArgument},
		{"hard link out", []streamEntry{sDir("."), sLink(tar.TypeLink, "h", "../"+rel+"/victim")}, errdefs.ErrInvalidArgument},
		{"hard link through a symlink", []streamEntry{sDir("."), sLink(tar.TypeSymlink, "l", outside), sLink(tar.TypeLink, "h", "l/victim")}, errdefs.ErrInvalidArgument},
		{"hard link to a symlink", []streamEntry{sDir("."), sLink(tar.TypeSymlink, "l", victim), sLink(tar.TypeLink, "h", "l")}, errdefs.ErrInvalidArgument},
		{"hard link to a later file", []streamEntry{sDir("."), sLink(tar.TypeLink, "h", "f"), sFile("f", "x")}, errdefs.ErrInvalidArgument},
		{"parent not sent", []streamEntry{sDir("."), sFile("nodir/f", "x")}, errdefs.ErrInvalidArgument},
		{"twice", []streamEntry{sDir("."), sFile("f", "x"), sFile("f", "y")}, errdefs.ErrInvalidArgument},
		{"no root first", []streamEntry{sFile("f", "x")}, errdefs.ErrInvalidArgument},
		{"root again", []streamEntry{sDir("."), sDir(".")}, errdefs.ErrInvalidArgument},
		{"dot element", []streamEntry{sDir("."), sDir("a"), sFile("a/./f", "x")}, errdefs.ErrInvalidArgument},
		{"device", []streamEntry{sDir("."), dev}, errdefs.ErrFailedPrecondition},
		{"fifo", []streamEntry{sDir("."), {hdr: tar.Header{Typeflag: tar.TypeFifo, Name: "p"}}}, errdefs.ErrFailedPrecondition},
		{"redirect", []streamEntry{sDir("."), redirect}, errdefs.ErrFailedPrecondition},
		{"huge size", []streamEntry{sDir("."), huge}, errdefs.ErrResourceExhausted},
		{"too many", append([]streamEntry{sDir(".")}, many...), errdefs.ErrResourceExhausted},
		{"too deep", append([]streamEntry{sDir(".")}, deep...), errdefs.ErrFailedPrecondition},
		{"data in a directory", []streamEntry{sDir("."), dirData}, errdefs.ErrInvalidArgument},
		{"huge excluded file", []streamEntry{sDir("."), sDir(".shoal"), excludedHuge}, errdefs.ErrResourceExhausted},
		{"short file", []streamEntry{sDir("."), short}, errdefs.ErrInvalidArgument},
		{"empty", nil, errdefs.ErrInvalidArgument},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := extractCrafted(t, craft(t, tc.entries...), commitLimits{})
			if err == nil {
				t.Fatal("extracted")
			}
			if !errors.Is(err, tc.kind) {
				t.Errorf("error %v: want kind %v", err, tc.kind)
			}
			if b, _ := os.ReadFile(victim); string(b) != "host" {
				t.Fatalf("the host's file changed: %q", b)
			}
			if ents, _ := os.ReadDir(outside); len(ents) != 1 {
				t.Fatalf("something was made outside the tree: %v", ents)
			}
		})
	}
}

// TestCommitStreamStall: a producer that stops sending fails the commit
// (it does not hold it for ever).
func TestCommitStreamStall(t *testing.T) {
	e := newEnv(t)
	defer func(d time.Duration) { exportStall = d }(exportStall)
	exportStall = 200 * time.Millisecond
	start := time.Now()
	_, err := e.store.Commit(context.Background(), CommitOptions{Kind: KindWorkspace, Name: "ws", Version: "1",
		Export: func(ctx context.Context, maxDepth int) (io.ReadCloser, error) {
			pr, pw := io.Pipe()
			go func() {
				pw.Write(craft(t, sDir("."))[:512]) // a header, then nothing
			}()
			return pr, nil
		}})
	if !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("err %v: want unavailable", err)
	}
	if d := time.Since(start); d > 30*time.Second {
		t.Errorf("took %s", d)
	}
}

package e2e

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
)

// richTree makes, under dir, a tree with what an upload must carry
// faithfully: symlinks (one absolute, out of the tree), a hard link, a
// setuid file, other owners, empty directories with sticky and setgid
// bits, and a user.* xattr when the file system takes one.
func richTree(t *testing.T, dir string) (xattr bool) {
	t.Helper()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	for p, c := range map[string]string{"bin/tool": "#!/bin/sh\necho tool ran\n", "etc/conf": "a=1\n", "data/big": strings.Repeat("0123456789", 100000)} {
		must(os.MkdirAll(filepath.Join(dir, filepath.Dir(p)), 0o755))
		must(os.WriteFile(filepath.Join(dir, p), []byte(c), 0o644))
	}
	must(unix.Chmod(filepath.Join(dir, "bin/tool"), 0o4755))
	must(os.Link(filepath.Join(dir, "bin/tool"), filepath.Join(dir, "bin/tool-hardlink")))
	must(os.Symlink("/etc/passwd", filepath.Join(dir, "etc/passwd-link")))
	must(os.Symlink("../bin/tool", filepath.Join(dir, "etc/tool-link")))
	must(os.Mkdir(filepath.Join(dir, "empty"), 0o755))
	must(unix.Chmod(filepath.Join(dir, "empty"), 0o1733))
	must(os.Mkdir(filepath.Join(dir, "shared"), 0o755))
	must(unix.Chmod(filepath.Join(dir, "shared"), 0o2775))
	must(os.Lchown(filepath.Join(dir, "etc/conf"), 1234, 5678))
	must(os.Lchown(filepath.Join(dir, "etc/tool-link"), 99, 98))
	return unix.Setxattr(filepath.Join(dir, "etc/conf"), "user.shoal", []byte("v1"), 0) == nil
}

// TestLayerUploadSameAsServerPath: `layer build DIR` uploads DIR as a tar;
// the layer is the one the server builds from DIR read in place (inside
// its --build-root), and a sandbox sees the files as they were.
func TestLayerUploadSameAsServerPath(t *testing.T) {
	need(t)
	src, err := os.MkdirTemp(buildRoot, "rich")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(src)
	if !richTree(t, src) {
		t.Log("no user.* xattrs on this file system: compared without them")
	}
	up := buildLayer(t, "toolkit", "upload:1", src)
	there := buildLayer(t, "toolkit", "upload:server", src, "--server-path")
	if up != there {
		t.Fatalf("uploaded %s, built in place %s", up, there)
	}
	if l := inspectLayer(t, "upload:1"); !strings.HasPrefix(l.Source, "tar upload of "+src) {
		t.Errorf("source recorded as %q", l.Source)
	}
	id := createWith(t, "--base", baseRef, "--toolkit", "upload:1")
	got := sh(t, id, "stat -c '%n %a %u:%g %h' /bin/tool /etc/conf /empty /shared && readlink /etc/passwd-link && /etc/tool-link && wc -c < /data/big")
	want := "/bin/tool 4755 0:0 2\n/etc/conf 644 1234:5678 1\n/empty 1733 0:0 2\n/shared 2775 0:0 2\n/etc/passwd\ntool ran\n1000000\n"
	if got != want {
		t.Errorf("the sandbox sees:\n%s\nwant:\n%s", got, want)
	}

	// A fifo or a device node is refused either way, naming it.
	special, err := os.MkdirTemp(buildRoot, "special")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(special)
	os.WriteFile(filepath.Join(special, "ok"), []byte("1"), 0o644)
	if err := unix.Mkfifo(filepath.Join(special, "pipe"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, extra := range [][]string{nil, {"--server-path"}} {
		out, code := run(nil, append([]string{"layer", "build", "--kind", "toolkit", "special:1", special}, extra...)...)
		if code == 0 || !strings.Contains(out, "invalid_argument") || !strings.Contains(out, "pipe is a fifo") {
			t.Errorf("fifo %v: exit %d: %s", extra, code, out)
		}
	}
}

// TestLayerServerPathConfined: the admin key does not read the host. A
// server path is built only inside a --build-root; /etc, the data dir and
// symlinks out of the root are refused with a message saying what to do.
func TestLayerServerPathConfined(t *testing.T) {
	need(t)
	inside := tree(t, map[string]string{"ok": "1"})
	dir, err := os.MkdirTemp(buildRoot, "confined")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	os.WriteFile(filepath.Join(dir, "ok"), []byte("1"), 0o644)
	os.Symlink("/etc", filepath.Join(buildRoot, "etc-link"))
	defer os.Remove(filepath.Join(buildRoot, "etc-link"))
	os.Symlink(dataDir, filepath.Join(dir, "data-link"))

	for _, p := range []string{"/etc", dataDir, filepath.Join(dataDir, "admin.key"), inside, filepath.Join(buildRoot, "etc-link"), filepath.Join(dir, "data-link"), filepath.Join(dir, "../etc-link/ssl")} {
		out, code := run(nil, "layer", "build", "--kind", "toolkit", "--server-path", "host:1", p)
		if code == 0 {
			t.Errorf("%s was built: %s", p, out)
			continue
		}
		for _, w := range []string{"permission_denied", "--build-root", "upload"} {
			if !strings.Contains(out, w) {
				t.Errorf("%s: %q lacks %q", p, out, w)
			}
		}
	}
	if _, err := sdk(t).Layers.GetLayer(t.Context(), connectReq(&pb.GetLayerRequest{Ref: "host:1"})); err == nil {
		t.Error("a refused build made a layer")
	}
	// Inside the root, also through a symlink that stays in it.
	os.Symlink(dir, filepath.Join(buildRoot, "dir-link"))
	defer os.Remove(filepath.Join(buildRoot, "dir-link"))
	if buildLayer(t, "toolkit", "confined:1", filepath.Join(buildRoot, "dir-link"), "--server-path") != buildLayer(t, "toolkit", "confined:2", dir) {
		t.Error("the same directory, in place and uploaded, gave two images")
	}
}

// TestLayerUploadBounded: a serve with a small --build-upload-max refuses
// a bigger upload (a file, a directory, a raw request that sends it all
// before reading the answer) with 413 naming the flag, and removes what
// it spooled, also when the client goes away mid-upload.
func TestLayerUploadBounded(t *testing.T) {
	need(t)
	data, err := os.MkdirTemp("/tmp", "seu")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unmountUnder(data); os.RemoveAll(data) }) // after the serve stops (cleanups run last first)
	addr := startExtraServe(t, data, "--e2b-listen=", "--pool-size", "0", "--build-upload-max", "1M")
	url := "http://" + addr
	waitFor(t, 2*time.Minute, "the second serve", func() bool {
		res, err := http.Get(url + "/healthz")
		if err == nil {
			res.Body.Close()
		}
		return err == nil
	})
	key, _ := os.ReadFile(filepath.Join(data, "admin.key"))
	cli := func(args ...string) (string, int) {
		cmd := exec.Command(filepath.Join(binDir, "shoal"), args...)
		cmd.Env = append(os.Environ(), "SHOAL_URL="+url, "SHOAL_API_KEY="+strings.TrimSpace(string(key)))
		out, err := cmd.CombinedOutput()
		if err != nil {
			return string(out), 1
		}
		return string(out), 0
	}
	spool := filepath.Join(data, "layers", "tmp")
	spooled := func() []string {
		ents, _ := os.ReadDir(spool)
		var names []string
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), "upload-") {
				names = append(names, e.Name())
			}
		}
		return names
	}

	big := t.TempDir()
	os.WriteFile(filepath.Join(big, "a"), bytes.Repeat([]byte("x"), 3<<20), 0o644)
	bigTar := filepath.Join(t.TempDir(), "big.tar")
	if out, err := exec.Command("tar", "-C", big, "-cf", bigTar, ".").CombinedOutput(); err != nil {
		t.Fatalf("tar: %v %s", err, out)
	}
	for _, src := range []string{big, bigTar} {
		out, code := cli("layer", "build", "--kind", "toolkit", "big:1", src)
		if code == 0 || !strings.Contains(out, "resource_exhausted") || !strings.Contains(out, "--build-upload-max") {
			t.Errorf("%s: exit %d: %s", src, code, out)
		}
		if s := spooled(); len(s) > 0 {
			t.Errorf("%s: left %v", src, s)
		}
	}
	// A client that sends everything before it reads (no Expect:
	// 100-continue, chunked) still gets the 413.
	body, _ := os.ReadFile(bigTar)
	req, _ := http.NewRequest(http.MethodPost, url+"/v1/layers/build?kind=toolkit&ref=big:2", io.MultiReader(bytes.NewReader(body)))
	req.Header.Set("Authorization", "Bearer "+strings.TrimSpace(string(key)))
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("raw upload: %v", err)
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != http.StatusRequestEntityTooLarge || !strings.Contains(string(b), "--build-upload-max") {
		t.Errorf("raw upload: %d %s", res.StatusCode, b)
	}
	// No key, no upload.
	res, err = http.Post(url+"/v1/layers/build?kind=toolkit&ref=nokey:1", "application/x-tar", bytes.NewReader(body[:1024]))
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusUnauthorized {
		t.Errorf("upload without a key: %d", res.StatusCode)
	}

	// A client gone mid-upload: the spooled part is removed.
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(conn, "POST /v1/layers/build?kind=toolkit&ref=gone:1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nTransfer-Encoding: chunked\r\n\r\n", strings.TrimSpace(string(key)))
	fmt.Fprintf(conn, "%x\r\n%s\r\n", 100000, body[:100000])
	waitFor(t, 30*time.Second, "the upload to be spooled", func() bool { return len(spooled()) == 1 })
	conn.Close()
	waitFor(t, 30*time.Second, "the spooled upload to be removed", func() bool { return len(spooled()) == 0 })

	// Under the bound, it builds.
	small := tree(t, map[string]string{"f": "small"})
	if out, code := cli("layer", "build", "--kind", "toolkit", "small:1", small); code != 0 || !strings.Contains(out, "\nsmall@sha256:") {
		t.Errorf("small upload: %s", out)
	}
}

package e2e

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/klauspost/compress/zstd"
	"golang.org/x/sys/unix"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
)

// --- helpers ---

// createWith makes a sandbox with exactly these create flags and deletes it
// when the test ends.
func createWith(t *testing.T, args ...string) string {
	t.Helper()
	stdout, stderr, code := run3(nil, append([]string{"create"}, args...)...)
	if code != 0 {
		t.Fatalf("create %v: %s %s", args, stdout, stderr)
	}
	id := strings.TrimSpace(stdout)
	t.Cleanup(func() { run(nil, "rm", id) })
	return id
}

// shoalOK runs the CLI and fails the test unless it exits 0; it returns
// stdout.
func shoalOK(t *testing.T, args ...string) string {
	t.Helper()
	stdout, stderr, code := run3(nil, args...)
	if code != 0 {
		t.Fatalf("shoal %s: exit %d: %s %s", strings.Join(args, " "), code, stdout, stderr)
	}
	return stdout
}

// sh runs a shell command in a sandbox and returns its stdout.
func sh(t *testing.T, id, script string) string {
	t.Helper()
	return shoalOK(t, "exec", id, "--", "sh", "-c", script)
}

// tree writes files (path -> content) under a new temporary directory.
func tree(t *testing.T, files map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	for p, c := range files {
		p = filepath.Join(dir, p)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// buildLayer builds a layer through the CLI and returns its digest.
func buildLayer(t *testing.T, kind, ref, src string, extra ...string) string {
	t.Helper()
	out := shoalOK(t, append([]string{"layer", "build", "--kind", kind, ref, src}, extra...)...)
	_, digest, ok := strings.Cut(strings.TrimSpace(out), "@")
	if !ok {
		t.Fatalf("layer build printed %q", out)
	}
	return digest
}

func inspectLayer(t *testing.T, ref string) *pb.Layer {
	t.Helper()
	res, err := sdk(t).Layers.GetLayer(context.Background(), connectReq(&pb.GetLayerRequest{Ref: ref}))
	if err != nil {
		t.Fatalf("inspect %s: %v", ref, err)
	}
	return res.Msg
}

func sandboxDigests(t *testing.T, id string) []string {
	t.Helper()
	sb, err := sdk(t).Get(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, l := range sb.Layers {
		out = append(out, l.Digest)
	}
	return out
}

// layerMount is where the node mounts an image (DATA/layers/mnt/<16 hex>).
func layerMount(digest string) string {
	return filepath.Join(dataDir, "layers", "mnt", strings.TrimPrefix(digest, "sha256:")[:16])
}

func isMounted(dir string) bool { return slices.Contains(mountsUnder(filepath.Dir(dir)), dir) }

func imagePath(digest string) string {
	return filepath.Join(dataDir, "layers", "blobs", "sha256", strings.TrimPrefix(digest, "sha256:")+".erofs")
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// allImages lists every image (tagged or not) as the API reports them.
func allImages(t *testing.T) map[string][]string {
	t.Helper()
	res, err := sdk(t).Layers.ListLayers(context.Background(), connectReq(&pb.ListLayersRequest{All: true}))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]string{}
	for _, l := range res.Msg.Layers {
		out[l.Digest] = l.Tags
	}
	return out
}

// imageLayer is an OCI image layer holding a tar of entries.
type tarEnt struct {
	name, body string
	typ        byte
	link       string
}

func ociLayer(t *testing.T, ents ...tarEnt) v1.Layer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range ents {
		h := &tar.Header{Name: e.name, Mode: 0o644, Typeflag: e.typ, Linkname: e.link, Size: int64(len(e.body)), ModTime: time.Unix(1700000000, 0)}
		if e.typ == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Typeflag == tar.TypeDir {
			h.Mode = 0o755
		}
		if h.Typeflag != tar.TypeReg {
			h.Size = 0
		}
		tw.WriteHeader(h)
		io.WriteString(tw, e.body)
	}
	tw.Close()
	b := buf.Bytes()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// ptyPair opens a pseudo-terminal: the master to read from, the slave to
// hand to a process as its terminal.
func ptyPair(t *testing.T) (master, slave *os.File) {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Skipf("no pseudo-terminals: %v", err)
	}
	if err := unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(int(m.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	s, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	return m, s
}

// --- tests ---

// TestLayerTagsInUseAndGC: tags move atomically, sandboxes keep the digest
// they were created from, and neither rm nor gc removes an image in use.
func TestLayerTagsInUseAndGC(t *testing.T) {
	need(t)
	dA := buildLayer(t, "toolkit", "tgc:1", tree(t, map[string]string{"opt/tgc/version": "A"}))
	shoalOK(t, "layer", "tag", "tgc:1", "tgc:stable")
	if ls := shoalOK(t, "layer", "ls"); !strings.Contains(ls, "tgc:1 ") || !strings.Contains(ls, "tgc:stable ") {
		t.Fatalf("layer ls:\n%s", ls)
	}
	sb1 := createWith(t, "--base", baseRef, "--toolkit", "tgc:stable")

	// A new version: the tag moves, the running sandbox does not notice.
	dB := buildLayer(t, "toolkit", "tgc:1", tree(t, map[string]string{"opt/tgc/version": "B"}))
	_, stderr, code := run3(nil, "layer", "tag", "tgc:1", "tgc:stable")
	if code != 0 || !strings.Contains(stderr, "moved tgc:stable from "+dA[:19]) {
		t.Fatalf("re-tag: %d %q", code, stderr)
	}
	if got := sh(t, sb1, "cat /opt/tgc/version"); got != "A" {
		t.Errorf("running sandbox sees %q after the tag moved", got)
	}
	if got := sandboxDigests(t, sb1); got[0] != dA {
		t.Errorf("running sandbox's layer %s, want %s", got[0], dA)
	}
	sb2 := createWith(t, "--base", baseRef, "--toolkit", "tgc:stable")
	if got := sh(t, sb2, "cat /opt/tgc/version"); got != "B" {
		t.Errorf("new sandbox sees %q", got)
	}

	// A is untagged but in use: inspect says so; rm and gc leave it.
	in := inspectLayer(t, dA)
	if len(in.Tags) != 0 || !slices.Equal(in.UsedBySandboxes, []string{sb1}) || in.Mounts != 1 {
		t.Errorf("inspect %s: tags %v used by %v mounts %d", dA, in.Tags, in.UsedBySandboxes, in.Mounts)
	}
	out, code := run(nil, "layer", "rm", dA)
	if code == 0 || !strings.Contains(out, "failed_precondition") || !strings.Contains(out, "used by sandbox "+sb1) {
		t.Errorf("rm of an image in use: %d %s", code, out)
	}
	shoalOK(t, "layer", "gc")
	if !fileExists(imagePath(dA)) || !isMounted(layerMount(dA)) {
		t.Fatal("gc removed an image in use")
	}
	if _, ok := allImages(t)[dA]; !ok {
		t.Error("layer ls --all does not list the untagged image")
	}
	// rm of a tag whose image another tag still points at only untags.
	if out := shoalOK(t, "layer", "rm", "tgc:stable"); out != "untagged tgc:stable\n" {
		t.Errorf("rm tgc:stable printed %q", out)
	}
	if !fileExists(imagePath(dB)) {
		t.Error("rm of one of two tags removed the image")
	}

	// Once its sandbox is gone, A is collected; B (tagged) stays.
	shoalOK(t, "rm", sb1)
	if !eventually(teardownTimeout, func() bool { return !isMounted(layerMount(dA)) }) {
		t.Error("A still mounted after its last sandbox went")
	}
	var gc struct {
		Removed []struct{ Digest string }
	}
	if err := json.Unmarshal([]byte(shoalOK(t, "layer", "gc", "--json")), &gc); err != nil {
		t.Fatal(err)
	}
	var removed []string
	for _, l := range gc.Removed {
		removed = append(removed, l.Digest)
	}
	if !slices.Contains(removed, dA) || slices.Contains(removed, dB) {
		t.Errorf("gc removed %v; want %s and not %s", removed, dA, dB)
	}
	if fileExists(imagePath(dA)) || !fileExists(imagePath(dB)) {
		t.Error("gc: wrong images on disk")
	}
	// The last tag of an image in use: untagged, image kept until unused.
	out = shoalOK(t, "layer", "rm", "tgc:1")
	if !strings.Contains(out, "untagged tgc:1") || strings.Contains(out, "deleted") || !fileExists(imagePath(dB)) {
		t.Errorf("rm of the last tag of an image in use: %q", out)
	}
	shoalOK(t, "rm", sb2)
	shoalOK(t, "layer", "gc")
	if fileExists(imagePath(dB)) {
		t.Error("B not collected once unused and untagged")
	}
}

// TestLayerSources builds layers from a tar.zst, an OCI image layout and a
// docker-archive (whiteouts and opaque directories applied) and runs
// sandboxes on them.
func TestLayerSources(t *testing.T) {
	need(t)
	dir, err := os.MkdirTemp(buildRoot, "sources") // also read in place (--server-path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	img, err := mutate.AppendLayers(empty.Image,
		ociLayer(t, tarEnt{name: "opt/", typ: tar.TypeDir}, tarEnt{name: "opt/app/", typ: tar.TypeDir},
			tarEnt{name: "opt/app/old.py", body: "old"}, tarEnt{name: "opt/app/lib/", typ: tar.TypeDir}, tarEnt{name: "opt/app/lib/x", body: "x"},
			tarEnt{name: "opt/tmpfile", body: "t"}, tarEnt{name: "opt/keep", body: "k1"}),
		ociLayer(t, tarEnt{name: "opt/app/", typ: tar.TypeDir}, tarEnt{name: "opt/app/.wh..wh..opq"}, tarEnt{name: "opt/app/new.py", body: "new"},
			tarEnt{name: "opt/.wh.tmpfile"}, tarEnt{name: "opt/keep", body: "k2"}, tarEnt{name: "opt/ln", typ: tar.TypeSymlink, link: "/opt/keep"}),
	)
	if err != nil {
		t.Fatal(err)
	}
	lp, err := layout.Write(filepath.Join(dir, "oci"), empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := lp.AppendImage(img, layout.WithAnnotations(map[string]string{"org.opencontainers.image.ref.name": "app:1"})); err != nil {
		t.Fatal(err)
	}
	tag, _ := name.NewTag("app:1")
	if err := tarball.WriteToFile(filepath.Join(dir, "docker.tar"), tag, img); err != nil {
		t.Fatal(err)
	}
	var rootfs bytes.Buffer
	tw := tar.NewWriter(&rootfs)
	for _, f := range []struct{ n, b string }{{"opt/app/new.py", "new"}, {"opt/keep", "k2"}} {
		tw.WriteHeader(&tar.Header{Name: f.n, Mode: 0o644, Size: int64(len(f.b)), Typeflag: tar.TypeReg})
		io.WriteString(tw, f.b)
	}
	tw.WriteHeader(&tar.Header{Name: "opt/ln", Typeflag: tar.TypeSymlink, Linkname: "/opt/keep"})
	tw.Close()
	zf, _ := os.Create(filepath.Join(dir, "rootfs.tar.zst"))
	zw, _ := zstd.NewWriter(zf)
	zw.Write(rootfs.Bytes())
	zw.Close()
	zf.Close()

	for _, tt := range []struct {
		name, src, source string
		extra             []string
	}{
		{"tar.zst", filepath.Join(dir, "rootfs.tar.zst"), "tar.zst upload", nil},
		{"oci-layout", filepath.Join(dir, "oci"), "oci-archive upload", nil}, // the CLI sends the directory as a tar
		{"oci-layout-in-place", filepath.Join(dir, "oci"), "oci-layout " + filepath.Join(dir, "oci"), []string{"--server-path"}},
		{"docker-archive", filepath.Join(dir, "docker.tar"), "docker-archive upload", nil},
		{"docker-archive-in-place", filepath.Join(dir, "docker.tar"), "docker-archive " + filepath.Join(dir, "docker.tar"), []string{"--server-path"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ref := "src-" + strings.ReplaceAll(tt.name, ".", "-") + ":1"
			buildLayer(t, "toolkit", ref, tt.src, append([]string{"--compression", "lz4"}, tt.extra...)...)
			if l := inspectLayer(t, ref); !strings.HasPrefix(l.Source, tt.source) || l.Compression != "lz4" {
				t.Errorf("source %q compression %q", l.Source, l.Compression)
			}
			id := createWith(t, "--base", baseRef, "--toolkit", ref)
			got := sh(t, id, "cd /opt && find . | sort && cat app/new.py keep ln")
			want := ".\n./app\n./app/new.py\n./keep\n./ln\nnewk2k2"
			if got != want {
				t.Errorf("sandbox sees:\n%s\nwant:\n%s", got, want)
			}
		})
	}
}

// TestLayerCommitWhiteouts commits a sandbox's changes and checks that a
// sandbox from base + the new workspace sees exactly the same tree: files
// deleted stay deleted, a directory replaced shows only its new content.
func TestLayerCommitWhiteouts(t *testing.T) {
	need(t)
	root, err := busyboxRootfs()
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(root)
	for p, c := range map[string]string{"etc/motd": "hello", "data/a": "a", "data/sub/b": "b", "opt/tool/bin": "v1"} {
		os.MkdirAll(filepath.Join(root, filepath.Dir(p)), 0o755)
		os.WriteFile(filepath.Join(root, p), []byte(c), 0o644)
	}
	buildLayer(t, "base", "cbase:1", root)
	sb := createWith(t, "--base", "cbase:1")
	sh(t, sb, `set -e
		rm /etc/motd
		rm -rf /data && mkdir -p /data/sub && echo new > /data/sub/new
		rm -rf /opt/tool
		mkdir -p /repo/.git && echo 'print(42)' > /repo/main.py && ln -s /repo/main.py /repo/link && ln /repo/main.py /repo/hard.py
		chmod 700 /repo && chown 1000:1000 /repo/main.py`)
	snapshot := "find /etc /data /opt /repo | sort; cat /repo/link /data/sub/new; stat -c '%a %u' /repo /repo/main.py; ls -i /repo/main.py /repo/hard.py | awk '{print $1}' | uniq | wc -l"
	want := sh(t, sb, snapshot)

	// A device node in the sandbox is refused, with the reason. (In a
	// user namespace the sandbox cannot even make one.)
	if out, code := run(nil, "exec", sb, "--", "mknod", "/repo/null", "c", "1", "3"); code != 0 {
		if !strings.Contains(out, "not permitted") {
			t.Fatalf("mknod: %d %s", code, out)
		}
	} else {
		out, code := run(nil, "layer", "commit", sb, "--kind", "workspace", "cws:1")
		if code == 0 || !strings.Contains(out, "failed_precondition") || !strings.Contains(out, "/repo/null: a character device (1:3)") {
			t.Fatalf("commit with a device node: %d %s", code, out)
		}
		sh(t, sb, "rm /repo/null")
	}

	stdout, stderr, code := run3(nil, "layer", "commit", sb, "--kind", "workspace", "cws:1")
	if code != 0 || !strings.HasPrefix(stdout, "cws@sha256:") || !strings.Contains(stderr, "copying the sandbox's changes") {
		t.Fatalf("commit: %d %q %q", code, stdout, stderr)
	}
	if l := inspectLayer(t, "cws:1"); l.Kind != pb.LayerKind_LAYER_KIND_WORKSPACE || !strings.Contains(l.Source, "commit of sandbox "+sb+" over cbase:1") {
		t.Errorf("committed layer: %v", l)
	}
	sb2 := createWith(t, "--base", "cbase:1", "--workspace", "cws:1")
	if got := sh(t, sb2, snapshot); got != want {
		t.Errorf("base + commit:\n%s\nthe committed sandbox:\n%s", got, want)
	}
	for _, p := range []string{"/etc/motd", "/data/a", "/data/sub/b", "/opt/tool"} {
		if _, _, code := run3(nil, "exec", sb2, "--", "test", "-e", p); code == 0 {
			t.Errorf("%s deleted in the committed sandbox is back", p)
		}
	}
	// The agent's own mount point is not part of the layer.
	mnt := layerMount(inspectLayer(t, "cws:1").Digest)
	if _, err := os.Lstat(filepath.Join(mnt, ".shoal")); err == nil {
		t.Error("the commit holds /.shoal")
	}
	// A commit of a commit: the second sandbox's own changes on top.
	sh(t, sb2, "rm /repo/main.py && echo v2 > /data/sub/new")
	shoalOK(t, "layer", "commit", sb2, "--kind", "workspace", "cws:2")
	sb3 := createWith(t, "--base", "cbase:1", "--workspace", "cws:2", "--workspace", "cws:1")
	if got := sh(t, sb3, "cat /data/sub/new; test -e /repo/main.py || echo gone; cat /repo/hard.py"); got != "v2\ngone\nprint(42)\n" {
		t.Errorf("stacked commits: %q", got)
	}
}

// TestLayer32Lowers: a sandbox from one base and 31 toolkits.
func TestLayer32Lowers(t *testing.T) {
	need(t)
	args := []string{"--base", baseRef}
	for i := range 31 {
		ref := fmt.Sprintf("many%02d:1", i)
		buildLayer(t, "toolkit", ref, tree(t, map[string]string{"shared": fmt.Sprint(i), fmt.Sprintf("tk/%02d", i): "x"}))
		args = append(args, "--toolkit", ref)
	}
	id := createWith(t, args...)
	if got := sh(t, id, "echo $(cat /shared); ls /tk | wc -l; cat /etc/hostname"); got != "0\n31\nlayer-hostname\n" {
		t.Errorf("32-layer sandbox: %q (want the first toolkit's /shared, 31 toolkit dirs, the base)", got)
	}
	if n := len(sandboxDigests(t, id)); n != 32 {
		t.Errorf("%d layers recorded, want 32", n)
	}
}

// TestEnvironments: named stacks resolved at creation.
func TestEnvironments(t *testing.T) {
	need(t)
	d1 := buildLayer(t, "toolkit", "envtk:1", tree(t, map[string]string{"tool": "1"}))
	buildLayer(t, "workspace", "envws:1", tree(t, map[string]string{"work/task": "t"}))
	if out := shoalOK(t, "env", "create", "pyenv", "--base", baseRef, "--workspace", "envws:1", "--toolkit", "envtk:1"); out != "pyenv\n" {
		t.Errorf("env create printed %q", out)
	}
	if ls := shoalOK(t, "env", "ls"); !strings.Contains(ls, "pyenv") || !strings.Contains(ls, "envtk:1") || !strings.Contains(ls, "BACKEND") {
		t.Errorf("env ls:\n%s", ls)
	}
	// A backend of its own must be one the node offers.
	if _, stderr, code := run3(nil, "env", "create", "bad-backend", "--base", baseRef, "--backend", "nosuch"); code == 0 || !strings.Contains(stderr, `backend "nosuch" is not available on this node`) {
		t.Errorf("env create --backend nosuch: exit %d, %s", code, stderr)
	}
	sbOld := createWith(t, "--template", "pyenv")
	if got := sh(t, sbOld, "cat /tool /work/task"); got != "1t" {
		t.Errorf("sandbox from template: %q", got)
	}
	// Moving a tag of the environment upgrades later sandboxes only.
	d2 := buildLayer(t, "toolkit", "envtk:1", tree(t, map[string]string{"tool": "2"}))
	sbNew := createWith(t, "--template", "pyenv")
	if got := sh(t, sbNew, "cat /tool"); got != "2" {
		t.Errorf("sandbox after the tag moved: %q", got)
	}
	if got, want := sandboxDigests(t, sbNew)[0], d2; got != want {
		t.Errorf("new sandbox's toolkit %s, want %s", got, want)
	}
	if got := sh(t, sbOld, "cat /tool"); got != "1" || sandboxDigests(t, sbOld)[0] != d1 {
		t.Errorf("old sandbox changed: %q", got)
	}
	// Extra layers stack after the environment's; the SDK's template field.
	buildLayer(t, "toolkit", "envextra:1", tree(t, map[string]string{"extra": "e", "tool": "extra"}))
	sb, err := sdk(t).Create(context.Background(), &pb.CreateSandboxRequest{Template: "pyenv", Toolkits: []string{"envextra:1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer sdk(t).Delete(context.Background(), sb.Id)
	if got := sh(t, sb.Id, "cat /tool /extra"); got != "2e" {
		t.Errorf("template + extra toolkit: %q (the environment's toolkit comes first)", got)
	}
	var env struct {
		Resolved []struct{ Digest string }
	}
	if err := json.Unmarshal([]byte(shoalOK(t, "env", "inspect", "pyenv")), &env); err != nil {
		t.Fatal(err)
	}
	if len(env.Resolved) != 3 || env.Resolved[0].Digest != d2 {
		t.Errorf("env inspect resolved: %v", env.Resolved)
	}
	// A tag an environment names cannot be removed.
	out, code := run(nil, "layer", "rm", "envtk:1")
	if code == 0 || !strings.Contains(out, "environment pyenv names it") {
		t.Errorf("rm of a tag an environment uses: %d %s", code, out)
	}
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"create", "--template", "nosuch"}, "not_found"},
		{[]string{"create", "--template", "pyenv", "--base", baseRef}, "none of the others can be"},
		{[]string{"env", "create", "pyenv", "--base", baseRef}, "already_exists"},
		{[]string{"env", "create", "bad", "--base", "envtk:1"}, "not a base layer"},
		{[]string{"env", "create", "bad", "--base", baseRef, "--toolkit", "envws:1"}, "not a toolkit layer"},
		{[]string{"env", "create", "bad", "--base", baseRef, "--toolkit", "missing:1"}, "not_found"},
		{[]string{"env", "rm", "nosuch"}, "not_found"},
	}
	for _, tc := range cases {
		if out, code := run(nil, tc.args...); code == 0 || !strings.Contains(out, tc.want) {
			t.Errorf("%v: %d %q, want %q", tc.args, code, out, tc.want)
		}
	}
	shoalOK(t, "env", "create", "pyenv", "--base", baseRef, "--replace")
	shoalOK(t, "env", "rm", "pyenv")
	if out := shoalOK(t, "env", "ls"); strings.Contains(out, "pyenv") {
		t.Errorf("env ls after rm: %s", out)
	}
	// Sandboxes created from it keep running.
	if got := sh(t, sbNew, "cat /tool"); got != "2" {
		t.Errorf("sandbox after env rm: %q", got)
	}
}

func TestLayerExportImport(t *testing.T) {
	need(t)
	digest := buildLayer(t, "toolkit", "xport:1", tree(t, map[string]string{"bin/x": "exported"}), "--compression", "lz4hc")
	file := filepath.Join(t.TempDir(), "xport.tar")
	shoalOK(t, "layer", "export", "xport:1", file)
	// The file is a tar: metadata, then the image.
	f, _ := os.Open(file)
	tr := tar.NewReader(f)
	var names []string
	for {
		h, err := tr.Next()
		if err != nil {
			break
		}
		names = append(names, h.Name)
	}
	f.Close()
	if !slices.Equal(names, []string{"shoal-layer.json", "image.erofs"}) {
		t.Fatalf("export holds %v", names)
	}
	// Gone from the server, then back.
	shoalOK(t, "layer", "rm", "xport:1")
	if fileExists(imagePath(digest)) {
		t.Fatal("rm left the image")
	}
	if out := shoalOK(t, "layer", "import", file); out != "xport@"+digest+"\n" {
		t.Errorf("import printed %q", out)
	}
	if l := inspectLayer(t, "xport:1"); l.Digest != digest || l.Compression != "lz4hc" || l.Kind != pb.LayerKind_LAYER_KIND_TOOLKIT {
		t.Errorf("imported layer %v", l)
	}
	id := createWith(t, "--base", baseRef, "--toolkit", "xport:1")
	if got := sh(t, id, "cat /bin/x"); got != "exported" {
		t.Errorf("sandbox on the imported layer: %q", got)
	}
	// Through pipes, under another tag.
	var buf bytes.Buffer
	cmd := exec.Command(filepath.Join(binDir, "shoal"), "layer", "export", "xport:1", "-")
	cmd.Env = append(os.Environ(), "SHOAL_URL="+apiURL, "SHOAL_API_KEY="+apiKey)
	cmd.Stdout = &buf
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	if out, code := run(buf.Bytes(), "layer", "import", "-", "--tag", "xport:copy"); code != 0 || !strings.Contains(out, digest) {
		t.Errorf("import from stdin: %d %s", code, out)
	}
	// A modified file is refused, and nothing is stored.
	b, _ := os.ReadFile(file)
	b[len(b)-4096] ^= 0xff // inside the image (the tar ends with 1 KiB of zeros, padding before)
	bad := filepath.Join(t.TempDir(), "bad.tar")
	os.WriteFile(bad, b, 0o644)
	if out, code := run(nil, "layer", "import", bad, "--tag", "xport:bad"); code == 0 || !strings.Contains(out, "invalid_argument") || !strings.Contains(out, "digest mismatch") {
		t.Errorf("import of a modified file: %d %s", code, out)
	}
	if _, code := run(nil, "layer", "inspect", "xport:bad"); code == 0 {
		t.Error("a refused import left a tag")
	}
	if out, code := run(nil, "layer", "export", "nosuch:1", filepath.Join(t.TempDir(), "x")); code == 0 || !strings.Contains(out, "not_found") {
		t.Errorf("export of a missing layer: %d %s", code, out)
	}
	if out, code := run([]byte("not a tar"), "layer", "import", "-"); code == 0 || !strings.Contains(out, "not a layer export") {
		t.Errorf("import of garbage: %d %s", code, out)
	}
}

// TestUpgradeCostProof is the O(k) claim, end to end: m bases, k toolkits
// and N workspaces; sandboxes from several combinations; one toolkit
// upgraded. Exactly one new image is built, every new sandbox that names
// the toolkit gets it, running sandboxes keep the old one mounted until
// they end, and nothing else changes.
func TestUpgradeCostProof(t *testing.T) {
	need(t)
	const m, k, n = 2, 3, 4
	root, err := busyboxRootfs()
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(root)
	for i := range m {
		os.WriteFile(filepath.Join(root, "etc/os-id"), []byte(fmt.Sprint("os", i)), 0o644)
		buildLayer(t, "base", fmt.Sprintf("up-os%d:1", i), root)
	}
	for i := range k {
		buildLayer(t, "toolkit", fmt.Sprintf("up-tk%d:1", i), tree(t, map[string]string{fmt.Sprintf("opt/tk%d", i): "v1"}))
	}
	for i := range n {
		buildLayer(t, "workspace", fmt.Sprintf("up-ws%d:1", i), tree(t, map[string]string{"work/task": fmt.Sprint("task", i)}))
	}
	combos := [][]string{ // base, workspace, toolkits...
		{"up-os0:1", "up-ws0:1", "up-tk0:1"},
		{"up-os1:1", "up-ws1:1", "up-tk0:1", "up-tk1:1"},
		{"up-os0:1", "up-ws2:1", "up-tk2:1"},
		{"up-os1:1", "up-ws3:1", "up-tk1:1", "up-tk0:1"},
	}
	createCombo := func(c []string) string {
		args := []string{"--base", c[0], "--workspace", c[1]}
		for _, tk := range c[2:] {
			args = append(args, "--toolkit", tk)
		}
		return createWith(t, args...)
	}
	var running []string
	for _, c := range combos {
		running = append(running, createCombo(c))
	}
	before := allImages(t)
	oldTk0 := inspectLayer(t, "up-tk0:1").Digest
	digestsBefore := map[string][]string{}
	for _, id := range running {
		digestsBefore[id] = sandboxDigests(t, id)
	}

	// The upgrade: one toolkit rebuilt.
	newTk0 := buildLayer(t, "toolkit", "up-tk0:1", tree(t, map[string]string{"opt/tk0": "v2"}))
	after := allImages(t)
	var added []string
	for d := range after {
		if _, ok := before[d]; !ok {
			added = append(added, d)
		}
	}
	if len(added) != 1 || added[0] != newTk0 || len(after) != len(before)+1 {
		t.Fatalf("upgrade added images %v (%d -> %d), want exactly %s", added, len(before), len(after), newTk0)
	}

	// Running sandboxes: unchanged, the old toolkit still mounted.
	for i, id := range running {
		if got := sandboxDigests(t, id); !slices.Equal(got, digestsBefore[id]) {
			t.Errorf("sandbox %d's layers changed: %v -> %v", i, digestsBefore[id], got)
		}
		if slices.Contains(combos[i], "up-tk0:1") {
			if got := sh(t, id, "cat /opt/tk0"); got != "v1" {
				t.Errorf("running sandbox %d sees tk0 %q", i, got)
			}
		}
	}
	if !isMounted(layerMount(oldTk0)) {
		t.Fatal("old toolkit unmounted while sandboxes use it")
	}
	// New sandboxes of the same combinations get the new toolkit, and only
	// that changes.
	for i, c := range combos {
		id := createCombo(c)
		got, was := sandboxDigests(t, id), digestsBefore[running[i]]
		for j := range got {
			if was[j] == oldTk0 {
				if got[j] != newTk0 {
					t.Errorf("new sandbox %d layer %d: %s, want the new toolkit", i, j, got[j])
				}
			} else if got[j] != was[j] {
				t.Errorf("new sandbox %d layer %d changed: %s -> %s", i, j, was[j], got[j])
			}
		}
		want := fmt.Sprintf("os%d task%d", i%2, []int{0, 1, 2, 3}[i])
		if slices.Contains(c, "up-tk0:1") {
			want += " v2"
		}
		if got := strings.TrimSpace(sh(t, id, "echo $(cat /etc/os-id) $(cat /work/task) $(cat /opt/tk0 2>/dev/null)")); got != want {
			t.Errorf("new sandbox %d sees %q, want %q", i, got, want)
		}
		shoalOK(t, "rm", id)
	}
	// The old toolkit stays mounted until the last sandbox using it ends.
	var users []string
	for i, id := range running {
		if slices.Contains(combos[i], "up-tk0:1") {
			users = append(users, id)
		}
	}
	for i, id := range users {
		if !isMounted(layerMount(oldTk0)) {
			t.Fatalf("old toolkit unmounted with %d users left", len(users)-i)
		}
		shoalOK(t, "rm", id)
	}
	// Unmounted by the teardown of the last, which follows its delete.
	if !eventually(teardownTimeout, func() bool { return !isMounted(layerMount(oldTk0)) }) {
		t.Error("old toolkit still mounted a minute after its last sandbox ended")
	}
	// Now unused and untagged: gc removes it, and none of the tagged ones.
	shoalOK(t, "layer", "gc")
	if fileExists(imagePath(oldTk0)) {
		t.Error("gc kept the old toolkit")
	}
	for d, tags := range after {
		if len(tags) > 0 && !fileExists(imagePath(d)) {
			t.Errorf("gc removed %s (%v)", d, tags)
		}
	}
}

// TestLayerProgress: a bar on a terminal, plain lines otherwise.
func TestLayerProgress(t *testing.T) {
	need(t)
	src := tree(t, map[string]string{"small": "s"})
	big := make([]byte, 32<<20)
	for i := range big {
		big[i] = byte(i * 7)
	}
	os.WriteFile(filepath.Join(src, "big"), big, 0o644)

	_, stderr, code := run3(nil, "layer", "build", "--kind", "toolkit", "progress:1", src, "--compression", "lz4hc")
	if code != 0 {
		t.Fatal(stderr)
	}
	for _, s := range []string{"checking the tree", "building erofs (2 files, 32.0 MiB, lz4hc)", "hashing the image", "done in "} {
		if !strings.Contains(stderr, s) {
			t.Errorf("plain progress lacks %q:\n%s", s, stderr)
		}
	}
	if strings.Contains(stderr, "\r") || strings.Contains(stderr, "\033[") {
		t.Errorf("terminal codes in plain progress: %q", stderr)
	}

	master, slave := ptyPair(t)
	defer master.Close()
	cmd := exec.Command(filepath.Join(binDir, "shoal"), "layer", "build", "--kind", "toolkit", "progress:2", src, "--compression", "lz4hc")
	cmd.Env = append(os.Environ(), "SHOAL_URL="+apiURL, "SHOAL_API_KEY="+apiKey)
	var stdout bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, slave
	var tty bytes.Buffer
	var wg sync.WaitGroup
	wg.Go(func() { io.Copy(&tty, master) })
	err := cmd.Run()
	slave.Close()
	master.SetReadDeadline(time.Now().Add(2 * time.Second))
	wg.Wait()
	if err != nil {
		t.Fatalf("build on a terminal: %v\n%s", err, tty.String())
	}
	out := tty.String()
	if !strings.Contains(out, "\r\033[K  mkfs    [") || !strings.Contains(out, "100%") || !strings.Contains(out, "32.0 MiB") {
		t.Errorf("no progress bar on the terminal:\n%q", out)
	}
	if !strings.HasPrefix(stdout.String(), "progress@sha256:") {
		t.Errorf("stdout %q", stdout.String())
	}
}

// TestLayerBuildDevNodes: `shoal layer build` of a directory shaped like
// a debootstrap root (device nodes in /dev, uploaded in the client's tar)
// builds, saying once that it left them out; a device node elsewhere is
// refused (TestLayerBadInput).
func TestLayerBuildDevNodes(t *testing.T) {
	need(t)
	src := tree(t, map[string]string{"etc/hostname": "deb", "dev/pts/.keep": ""})
	for name, dev := range map[string]int{"console": int(unix.Mkdev(5, 1)), "null": int(unix.Mkdev(1, 3)), "ptmx": int(unix.Mkdev(5, 2))} {
		if err := unix.Mknod(filepath.Join(src, "dev", name), unix.S_IFCHR|0o666, dev); err != nil {
			t.Fatal(err)
		}
	}
	stdout, stderr, code := run3(nil, "layer", "build", "--kind", "toolkit", "devnodes:1", src)
	if code != 0 {
		t.Fatalf("build of a tree with /dev/console: %s", stderr)
	}
	if n := strings.Count(stderr, "warning: left out 3 device node(s) under /dev (/dev/console, /dev/null, /dev/ptmx): the sandbox gets its own /dev"); n != 1 {
		t.Errorf("%d warnings, want 1:\n%s", n, stderr)
	}
	if !strings.HasPrefix(stdout, "devnodes@sha256:") {
		t.Errorf("stdout %q", stdout)
	}
}

func TestLayerBadInput(t *testing.T) {
	need(t)
	junk := filepath.Join(t.TempDir(), "junk.tar")
	os.WriteFile(junk, bytes.Repeat([]byte("junk"), 1000), 0o644)
	devdir := t.TempDir()
	if err := unix.Mknod(filepath.Join(devdir, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))); err != nil {
		t.Fatal(err)
	}
	id := createWith(t, "--base", baseRef)
	cases := []struct {
		args []string
		want []string
	}{
		{[]string{"layer", "build", "--kind", "toolkit", "bad:1", junk}, []string{"invalid_argument", "not a tar archive"}},
		{[]string{"layer", "build", "--kind", "toolkit", "bad:1", devdir}, []string{"invalid_argument", "null is a character device"}},
		{[]string{"layer", "build", "--kind", "toolkit", "bad", devdir}, []string{"invalid_argument", "NAME:VERSION"}},
		{[]string{"layer", "build", "--kind", "toolkit", "--compression", "zstd", "bad:1", devdir}, []string{"invalid_argument", "valid are none, plain, lz4, lz4hc"}},
		{[]string{"layer", "build", "--kind", "toolkit", "--image", "x:1", "bad:1", t.TempDir()}, []string{"invalid_argument", "not an image"}},
		{[]string{"layer", "tag", "nosuch:1", "x:1"}, []string{"not_found", "nosuch:1"}},
		{[]string{"layer", "tag", baseRef, "x"}, []string{"invalid_argument", "name:version"}},
		{[]string{"layer", "rm", "nosuch:1"}, []string{"not_found"}},
		{[]string{"layer", "rm", "Busybox:1"}, []string{"invalid_argument", `layer name "Busybox"`}},
		{[]string{"layer", "inspect", "sha256:abc"}, []string{"invalid_argument", "want sha256:<64 lowercase hex>"}},
		{[]string{"layer", "commit", "aaaaaaaaaaaaaaaaaaaa", "--kind", "workspace", "c:1"}, []string{"not_found"}},
		{[]string{"layer", "commit", id, "--kind", "base", "c:1"}, []string{"--kind must be workspace or toolkit"}},
		{[]string{"layer", "commit", id, "--kind", "workspace", "c"}, []string{"invalid_argument"}},
		{[]string{"create", "--base", baseRef, "--toolkit", baseRef}, []string{"invalid_argument", "is a base layer, not a toolkit layer"}},
		{[]string{"create", "--toolkit", baseRef}, []string{"base", "template"}},
	}
	for _, tc := range cases {
		out, code := run(nil, tc.args...)
		if code == 0 {
			t.Errorf("%v succeeded: %s", tc.args, out)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(out, w) {
				t.Errorf("%v: %q lacks %q", tc.args, out, w)
			}
		}
	}
	// Base commits are refused by the API too, not only the CLI.
	_, err := sdk(t).CommitLayer(context.Background(), &pb.CommitLayerRequest{SandboxId: id, Kind: pb.LayerKind_LAYER_KIND_BASE, Ref: "c:1"}, nil)
	if err == nil || !strings.Contains(err.Error(), "not a base") {
		t.Errorf("API commit as base: %v", err)
	}
	if _, code := run(nil, "layer", "inspect", "bad:1"); code == 0 {
		t.Error("a failed build left a tag")
	}
}

func connectReq[T any](m *T) *connect.Request[T] { return connect.NewRequest(m) }

// TestLayerCommitSymlinkSwapAttack: inside a sandbox, a loop keeps swapping
// /work/x between a 4777 regular file and a symlink to a file of the host
// (0600), and /work/d between a 4777 directory and a symlink to a host
// directory (0700), while the sandbox is committed several times. The
// host's files never get into a layer and keep their modes. (The node
// walked the upper by path: lstat, then open, chmod or readdir; it read the
// host's files into the layer and chmodded them 4777.)
func TestLayerCommitSymlinkSwapAttack(t *testing.T) {
	need(t)
	var r [16]byte
	rand.Read(r[:])
	secret := "canary-" + hex.EncodeToString(r[:])
	host := t.TempDir()
	canary := filepath.Join(host, "admin.key")
	if err := os.WriteFile(canary, []byte(secret), 0o600); err != nil {
		t.Fatal(err)
	}
	canaryDir := filepath.Join(host, "secrets")
	os.Mkdir(canaryDir, 0o700)
	if err := os.WriteFile(filepath.Join(canaryDir, "token"), []byte(secret), 0o600); err != nil {
		t.Fatal(err)
	}
	checkCanary := func() {
		t.Helper()
		fi, err := os.Lstat(canary)
		if err != nil || fi.Mode() != 0o600 {
			t.Fatalf("the host's canary is now %v (%v), was -rw-------", fi.Mode(), err)
		}
		if b, _ := os.ReadFile(canary); string(b) != secret {
			t.Fatalf("the host's canary was written: %q", b)
		}
		if fi, err := os.Lstat(canaryDir); err != nil || fi.Mode() != os.ModeDir|0o700 {
			t.Fatalf("the host's directory is now %v (%v), was drwx------", fi.Mode(), err)
		}
	}

	sb := create(t)
	// /work/a, walked first, widens the window between reading a
	// directory and visiting its entries.
	sh(t, sb, fmt.Sprintf(`set -e; mkdir /work/a; cd /work/a; seq 1 2000 | xargs touch; cd /work
		echo mine >x; chmod 4777 x; ln -s %s x.alt
		mkdir d; echo mine >d/own; chmod 4777 d; ln -s %s d.alt`, canary, canaryDir))
	// swapper exchanges the names (renameat2): they always exist, their
	// types flip as fast as the sandbox can.
	startInSandbox(t, sb, "sh", "-c", "cd /work && exec swapper x x.alt d d.alt")
	deadline := time.Now().Add(10 * time.Second)
	for first := sh(t, sb, "ls -l /work/x"); sh(t, sb, "ls -l /work/x") == first; {
		if time.Now().After(deadline) {
			t.Fatal("the swap loop does not run")
		}
	}
	for i := range 5 {
		stdout, stderr, code := run3(nil, "layer", "commit", sb, "--kind", "workspace", fmt.Sprintf("attack:%d", i))
		if code != 0 {
			t.Fatalf("commit %d: %s %s", i, stdout, stderr)
		}
		checkCanary()
		_, digest, _ := strings.Cut(strings.TrimSpace(stdout), "@")
		img, err := os.ReadFile(imagePath(digest)) // uncompressed: file data is in the clear
		if err != nil {
			t.Fatal(err)
		}
		if bytes.Contains(img, []byte(secret)) {
			t.Fatalf("commit %d: the layer holds the host's secret", i)
		}
		if !bytes.Contains(img, []byte(canary)) && !bytes.Contains(img, []byte("mine")) {
			t.Errorf("commit %d: neither the file nor the symlink is in the layer", i)
		}
	}
	checkCanary()
}

// TestLayerCommitFreezesSandbox: while its writable layer is copied, the
// sandbox is frozen (its freezer cgroup is FROZEN and a counter loop in it
// makes no progress); afterwards it runs again.
func TestLayerCommitFreezesSandbox(t *testing.T) {
	need(t)
	sb := create(t)
	state := filepath.Join("/sys/fs/cgroup/freezer/shoal", runcID(t, sb), "freezer.state")
	if _, err := os.Stat(state); err != nil {
		t.Skipf("no v1 freezer cgroup for the sandbox: %v", err)
	}
	freezer := func() string {
		b, _ := os.ReadFile(state)
		return strings.TrimSpace(string(b))
	}
	counterFile := filepath.Join(upperOf(t, sb), "work", "counter")
	counter := func() string {
		b, _ := os.ReadFile(counterFile)
		return strings.TrimSpace(string(b))
	}
	advances := func() bool {
		c := counter()
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			if n := counter(); n != "" && n != c {
				return true
			}
		}
		return false
	}
	// Enough entries for the copy to take a while.
	sh(t, sb, "mkdir -p /work/many && cd /work/many && seq 1 20000 | xargs touch")
	startInSandbox(t, sb, "sh", "-c", "i=0; while :; do i=$((i+1)); echo $i >/work/counter; done")
	if !advances() {
		t.Fatal("the counter loop does not run")
	}

	type result struct {
		stdout, stderr string
		code           int
	}
	done := make(chan result, 1)
	go func() {
		stdout, stderr, code := run3(nil, "layer", "commit", sb, "--kind", "workspace", "frozen:1")
		done <- result{stdout, stderr, code}
	}()
	var res result
	sawFrozen, checked := false, false
poll:
	for {
		select {
		case res = <-done:
			break poll
		default:
		}
		if freezer() == "FROZEN" {
			sawFrozen = true
			if !checked {
				before := counter()
				time.Sleep(100 * time.Millisecond)
				after := counter()
				if freezer() == "FROZEN" { // frozen all along: one commit, one freeze
					checked = true
					if after != before {
						t.Errorf("the counter went from %s to %s in a frozen sandbox", before, after)
					}
				}
			}
		}
		time.Sleep(2 * time.Millisecond)
	}
	if res.code != 0 {
		t.Fatalf("commit: %s %s", res.stdout, res.stderr)
	}
	if !sawFrozen {
		t.Error("the sandbox was never seen frozen during the commit")
	}
	if !strings.Contains(res.stderr, "sandbox frozen") {
		t.Errorf("the commit did not say the sandbox was frozen: %s", res.stderr)
	}
	if st := freezer(); st != "THAWED" {
		t.Errorf("after the commit the sandbox is %s", st)
	}
	if !advances() {
		t.Error("the sandbox makes no progress after the commit")
	}
	if got := sh(t, sb, "echo alive"); got != "alive\n" {
		t.Errorf("exec after the commit: %q", got)
	}
}

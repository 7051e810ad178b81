package e2e

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"io/fs"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"golang.org/x/crypto/bcrypt"
)

// registry is a real registry server (Debian's docker-registry,
// distribution 2.8) started by a test on a free port with its own storage.
type registry struct {
	host   string // 127.0.0.1:PORT
	user   string // basic auth, if any
	pass   string
	caFile string // the test's CA, if the registry serves TLS
	caPool *x509.CertPool
}

type registryOpts struct {
	auth bool // htpasswd basic auth (alice / a password)
	tls  bool // TLS with a certificate of a CA made by the test
}

func startRegistry(t *testing.T, o registryOpts) *registry {
	t.Helper()
	need(t)
	bin, err := exec.LookPath("docker-registry")
	if err != nil {
		t.Skip("needs docker-registry (Debian's package of distribution's registry server): apt-get install docker-registry")
	}
	dir := t.TempDir()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &registry{host: ln.Addr().String()}
	ln.Close()
	cfg := fmt.Sprintf("version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: %s\n  delete:\n    enabled: true\nhttp:\n  addr: %s\n", filepath.Join(dir, "data"), r.host)
	if o.tls {
		cert, key := r.makeCA(t, dir)
		cfg += fmt.Sprintf("  tls:\n    certificate: %s\n    key: %s\n", cert, key)
	}
	if o.auth {
		r.user, r.pass = "alice", fmt.Sprintf("pw-%d", time.Now().UnixNano())
		hash, err := bcrypt.GenerateFromPassword([]byte(r.pass), bcrypt.MinCost)
		if err != nil {
			t.Fatal(err)
		}
		htpasswd := filepath.Join(dir, "htpasswd")
		if err := os.WriteFile(htpasswd, []byte(r.user+":"+string(hash)+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		cfg += fmt.Sprintf("auth:\n  htpasswd:\n    realm: test\n    path: %s\n", htpasswd)
	}
	cfgFile := filepath.Join(dir, "config.yml")
	if err := os.WriteFile(cfgFile, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	logf, err := os.Create(filepath.Join(dir, "registry.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "serve", cfgFile)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		logf.Close()
	})
	client := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: r.caPool}}}
	url := r.scheme() + "://" + r.host + "/v2/"
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if res, err := client.Get(url); err == nil {
			res.Body.Close()
			break
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(filepath.Join(dir, "registry.log"))
			t.Fatalf("the registry did not answer on %s:\n%s", url, b)
		}
	}
	return r
}

func (r *registry) scheme() string {
	if r.caPool != nil {
		return "https"
	}
	return "http"
}

// makeCA writes a CA and a certificate of it for 127.0.0.1 and localhost.
func (r *registry) makeCA(t *testing.T, dir string) (certFile, keyFile string) {
	t.Helper()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "shoal test registry CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "127.0.0.1"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, DNSNames: []string{"localhost"},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, KeyUsage: x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, _ := x509.MarshalECPrivateKey(key)
	r.caFile = filepath.Join(dir, "ca.pem")
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	os.WriteFile(r.caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), 0o644)
	os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
	os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600)
	r.caPool = x509.NewCertPool()
	r.caPool.AddCert(ca)
	return certFile, keyFile
}

func (r *registry) remoteOpts() []remote.Option {
	opts := []remote.Option{remote.WithTransport(&http.Transport{TLSClientConfig: &tls.Config{RootCAs: r.caPool}})}
	if r.user != "" {
		opts = append(opts, remote.WithAuth(&authn.Basic{Username: r.user, Password: r.pass}))
	}
	return opts
}

// push puts img in the registry as repoTag and returns its full reference.
func (r *registry) push(t *testing.T, repoTag string, img v1.Image) string {
	t.Helper()
	ref, err := name.ParseReference(r.host + "/" + repoTag)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(ref, img, r.remoteOpts()...); err != nil {
		t.Fatalf("push %s: %v", ref, err)
	}
	return ref.Name()
}

func (r *registry) pushIndex(t *testing.T, repoTag string, idx v1.ImageIndex) string {
	t.Helper()
	ref, err := name.ParseReference(r.host + "/" + repoTag)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.WriteIndex(ref, idx, r.remoteOpts()...); err != nil {
		t.Fatalf("push %s: %v", ref, err)
	}
	return ref.Name()
}

// dirLayer is an OCI layer of a directory tree (the test's busybox root).
func dirLayer(t *testing.T, root string) v1.Layer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if rel == "." {
			return nil
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		link := ""
		if fi.Mode()&fs.ModeSymlink != 0 {
			link, _ = os.Readlink(p)
		}
		h, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		h.Name = rel
		if d.IsDir() {
			h.Name += "/"
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if fi.Mode().IsRegular() {
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			defer f.Close()
			_, err = io.Copy(tw, f)
			return err
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	tw.Close()
	b := buf.Bytes()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func image(t *testing.T, arch string, cfg v1.Config, layers ...v1.Layer) v1.Image {
	t.Helper()
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		t.Fatal(err)
	}
	cf, _ := img.ConfigFile()
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture, cf.Config = "linux", arch, cfg
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		t.Fatal(err)
	}
	return img
}

// pulled is what `shoal layer pull` prints.
type pulled struct {
	Ref          string   `json:"ref"`
	Digest       string   `json:"digest"`
	Layers       []string `json:"layers"`
	FetchedBytes int64    `json:"fetched_bytes"`
	ReusedLayers int      `json:"reused_layers"`
}

func pullImage(t *testing.T, args ...string) pulled {
	t.Helper()
	out := shoalOK(t, append([]string{"layer", "pull"}, args...)...)
	var p pulled
	if err := json.Unmarshal([]byte(out), &p); err != nil {
		t.Fatalf("layer pull printed %q: %v", out, err)
	}
	return p
}

// swebenchImages pushes images as SWE-bench's are made: a shared base (the
// test's busybox root), a shared environment layer (tools on a PATH of
// their own, a file deleted from the base, a directory made opaque), and a
// top layer of their own (the task's repository in /testbed).
func swebenchImages(t *testing.T, reg *registry, tasks ...string) (refs []string, shared []v1.Layer) {
	t.Helper()
	rootfs, err := busyboxRootfs()
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(rootfs)
	os.MkdirAll(filepath.Join(rootfs, "etc", "conf.d"), 0o755)
	os.WriteFile(filepath.Join(rootfs, "etc", "conf.d", "old"), []byte("old"), 0o644)
	os.WriteFile(filepath.Join(rootfs, "etc", "motd"), []byte("base"), 0o644)
	base := dirLayer(t, rootfs)
	envLayer := ociLayer(t,
		tarEnt{name: "opt/", typ: tar.TypeDir}, tarEnt{name: "opt/tools/", typ: tar.TypeDir}, tarEnt{name: "opt/tools/bin/", typ: tar.TypeDir},
		tarEnt{name: "opt/tools/bin/runtests", body: "#!/bin/sh\necho tests of $(basename $PWD) pass\n"},
		tarEnt{name: "etc/", typ: tar.TypeDir}, tarEnt{name: "etc/.wh.motd"},
		tarEnt{name: "etc/conf.d/", typ: tar.TypeDir}, tarEnt{name: "etc/conf.d/.wh..wh..opq"}, tarEnt{name: "etc/conf.d/new", body: "new"},
	)
	// runtests must be executable: ociLayer makes 0644 files.
	envLayer = chmodLayer(t, envLayer, "opt/tools/bin/runtests", 0o755)
	cfg := v1.Config{
		Env:        []string{"PATH=/opt/tools/bin:/usr/bin:/bin", "LANG=C.UTF-8"},
		WorkingDir: "/testbed", User: "user", Cmd: []string{"runtests"},
	}
	for _, task := range tasks {
		top := ociLayer(t, tarEnt{name: "testbed/", typ: tar.TypeDir}, tarEnt{name: "testbed/TASK", body: task})
		refs = append(refs, reg.push(t, "swe/"+task+":latest", image(t, runtime.GOARCH, cfg, base, envLayer, top)))
	}
	return refs, []v1.Layer{base, envLayer}
}

// chmodLayer rewrites one file's mode in a layer.
func chmodLayer(t *testing.T, l v1.Layer, path string, mode int64) v1.Layer {
	t.Helper()
	rc, err := l.Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	var buf bytes.Buffer
	tr, tw := tar.NewReader(rc), tar.NewWriter(&buf)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if h.Name == path {
			h.Mode = mode
		}
		tw.WriteHeader(h)
		io.Copy(tw, tr)
	}
	tw.Close()
	b := buf.Bytes()
	out, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestImagePull pulls SWE-bench-style images from a real registry through
// the CLI: layers shared between images are fetched once, the image's
// config is the sandbox's defaults, and a create takes an image as its
// base.
func TestImagePull(t *testing.T) {
	reg := startRegistry(t, registryOpts{})
	refs, _ := swebenchImages(t, reg, "astropy-1", "django-2")

	first := pullImage(t, refs[0], "--env", "astropy-1")
	if len(first.Layers) != 3 || first.ReusedLayers != 0 {
		t.Errorf("first pull: %+v", first)
	}
	second := pullImage(t, refs[1])
	if second.ReusedLayers != 2 || second.Layers[0] != first.Layers[0] || second.Layers[1] != first.Layers[1] {
		t.Errorf("second image, sharing two layers: %+v", second)
	}
	again := pullImage(t, refs[1])
	if again.ReusedLayers != 3 || again.FetchedBytes != 0 {
		t.Errorf("a pulled image pulled again: %+v", again)
	}

	// A sandbox of the environment: the stack is the image, its config
	// the defaults.
	id := createWith(t, "--template", "astropy-1")
	if got := sh(t, id, `echo "$(pwd) $(id -u) $PATH $LANG"`); strings.TrimSpace(got) != "/testbed 1000 /opt/tools/bin:/usr/bin:/bin C.UTF-8" {
		t.Errorf("cwd, user and env from the image: %q", got)
	}
	if got := sh(t, id, "cat TASK; runtests; ls /etc/conf.d; test -e /etc/motd || echo motd deleted"); got != "astropy-1tests of testbed pass\nnew\nmotd deleted\n" {
		t.Errorf("the image's tree: %q", got)
	}
	// The image's command, run when asked; ARGs replace its CMD.
	if got := shoalOK(t, "exec", "--image-cmd", id); got != "tests of testbed pass\n" {
		t.Errorf("exec --image-cmd: %q", got)
	}
	if got := shoalOK(t, "exec", "--image-cmd", id, "--", "echo", "instead"); got != "instead\n" {
		t.Errorf("exec --image-cmd with ARGs: %q", got)
	}
	if sb, err := sdk(t).Get(context.Background(), id); err != nil || sb.Image.GetWorkingDir() != "/testbed" || sb.Image.GetUser() != "user" {
		t.Errorf("the sandbox's image config: %v, %v", sb.GetImage(), err)
	}
	// Overridden per command.
	if got := shoalOK(t, "exec", "--cwd", "/", "--user", "root", id, "--", "sh", "-c", "echo $(pwd) $(id -u)"); strings.TrimSpace(got) != "/ 0" {
		t.Errorf("cwd and user given: %q", got)
	}

	// --base IMAGE: the image pulled already, not fetched again; the
	// create's env over the image's.
	id2 := createWith(t, "--base", refs[1], "--env", "LANG=C")
	if got := sh(t, id2, `echo "$(cat TASK) $LANG $(id -un)"`); strings.TrimSpace(got) != "django-2 C user" {
		t.Errorf("create --base IMAGE: %q", got)
	}

	// A multi-platform index: this node's platform's image.
	other := "arm64"
	if runtime.GOARCH == "arm64" {
		other = "amd64"
	}
	mine := image(t, runtime.GOARCH, v1.Config{}, ociLayer(t, tarEnt{name: "arch", body: runtime.GOARCH}))
	theirs := image(t, other, v1.Config{}, ociLayer(t, tarEnt{name: "arch", body: other}))
	idx := mutate.AppendManifests(empty.Index,
		mutate.IndexAddendum{Add: theirs, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: other}}},
		mutate.IndexAddendum{Add: mine, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: runtime.GOARCH}}},
	)
	multi := pullImage(t, reg.pushIndex(t, "multi:1", idx))
	md, _ := mine.Digest()
	if multi.Digest != md.String() {
		t.Errorf("index: pulled %s, want this platform's %s", multi.Digest, md)
	}
	foreign := reg.pushIndex(t, "foreign:1", mutate.AppendManifests(empty.Index,
		mutate.IndexAddendum{Add: theirs, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: other}}}))

	// Bad input: a clear error, nothing left.
	before := len(allImages(t))
	for _, c := range []struct{ ref, want string }{
		{reg.host + "/no/such:1", "not_found"},
		{foreign, "no image for linux/" + runtime.GOARCH},
		{"127.0.0.1:1/nothing:1", "unavailable"},
		{reg.host + "/UPPER:1", "invalid_argument"},
	} {
		out, code := run(nil, "layer", "pull", "--image", c.ref)
		if code == 0 || !strings.Contains(out, c.want) {
			t.Errorf("layer pull %s: exit %d: %s (want %q)", c.ref, code, out, c.want)
		}
	}
	if after := len(allImages(t)); after != before {
		t.Errorf("failed pulls left %d images", after-before)
	}
}

// TestImagePullAuthTLS pulls from a registry over TLS (the test's CA) with
// basic auth: with the client's docker login forwarded, then with the
// server's own (serve --registry-auth). Neither shows up in the server's
// log.
func TestImagePullAuthTLS(t *testing.T) {
	reg := startRegistry(t, registryOpts{auth: true, tls: true})
	rootfs, err := busyboxRootfs()
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(rootfs)
	ref := reg.push(t, "private/app:1", image(t, runtime.GOARCH, v1.Config{Env: []string{"SECRET_IMAGE=1"}}, dirLayer(t, rootfs)))
	ref2 := reg.push(t, "private/app:2", image(t, runtime.GOARCH, v1.Config{}, dirLayer(t, rootfs), ociLayer(t, tarEnt{name: "two", body: "2"})))

	// The client's docker login (DOCKER_CONFIG), forwarded.
	dockerDir := t.TempDir()
	auth := base64.StdEncoding.EncodeToString([]byte(reg.user + ":" + reg.pass))
	os.WriteFile(filepath.Join(dockerDir, "config.json"), []byte(`{"auths":{"`+reg.host+`":{"auth":"`+auth+`"}}}`), 0o600)

	// The server does not know the test's CA yet.
	t.Setenv("DOCKER_CONFIG", dockerDir)
	if out, code := run(nil, "layer", "pull", ref); code == 0 || !strings.Contains(out, "certificate") {
		t.Errorf("pull over TLS of an unknown CA: exit %d: %s", code, out)
	}
	restartServeWith(t, "--registry-ca", reg.caFile)
	p := pullImage(t, ref)
	if len(p.Layers) != 1 {
		t.Errorf("pull with the client's login: %+v", p)
	}
	t.Setenv("DOCKER_CONFIG", t.TempDir()) // no login
	if out, code := run(nil, "layer", "pull", ref2); code == 0 || !strings.Contains(out, "permission_denied") {
		t.Errorf("pull without a login: exit %d: %s", code, out)
	}

	// The server's own login.
	serverAuth := filepath.Join(t.TempDir(), "auth.json")
	os.WriteFile(serverAuth, []byte(`{"auths":{"`+reg.host+`":{"auth":"`+auth+`"}}}`), 0o600)
	killServe()
	serveExtra = []string{"--registry-ca", reg.caFile, "--registry-auth", serverAuth}
	if err := startServe(); err != nil {
		t.Fatal(err)
	}
	if p := pullImage(t, ref2); p.ReusedLayers != 1 || len(p.Layers) != 2 {
		t.Errorf("pull with the server's login: %+v", p)
	}
	id := createWith(t, "--base", ref)
	if got := sh(t, id, "echo $SECRET_IMAGE"); got != "1\n" {
		t.Errorf("sandbox of the private image: %q", got)
	}
	log, _ := os.ReadFile(filepath.Join(dataDir, "serve.log"))
	if strings.Contains(string(log), reg.pass) || strings.Contains(string(log), auth) {
		t.Error("the registry password is in the server's log")
	}
}

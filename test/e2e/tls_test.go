package e2e

import (
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// TestServeTLS: a serve with --tls-cert and --tls-client-ca, its
// certificates made by `shoal tls`, serves the CLI and the Python SDK
// that trust its CA and present a client certificate (a layer upload, a
// create, an exec, files, a delete), and refuses a client without a
// certificate, one that does not trust the CA, and plain HTTP; its health
// check needs no certificate. Bad TLS flags stop serve at start.
func TestServeTLS(t *testing.T) {
	need(t)
	shoalBin := filepath.Join(binDir, "shoal")
	certs := t.TempDir()
	tlsCLI := func(args ...string) string {
		t.Helper()
		out, err := exec.Command(shoalBin, append([]string{"tls", "--dir", certs}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("shoal tls %v: %v\n%s", args, err, out)
		}
		return string(out)
	}
	tlsCLI("ca")
	tlsCLI("cert", "server", "--host", "127.0.0.1", "--host", "localhost")
	tlsCLI("cert", "alice", "--server=false")
	if out, err := exec.Command(shoalBin, "tls", "--dir", certs, "cert", "nohost").CombinedOutput(); err == nil || !strings.Contains(string(out), "--host") {
		t.Errorf("a server certificate without --host: %v %s, want refused", err, out)
	}
	ca := filepath.Join(certs, "ca.pem")

	data, err := os.MkdirTemp("/tmp", "setls")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unmountUnder(data); os.RemoveAll(data) }) // after the serve stops (cleanups run last first)
	// Bad flags: refused before anything starts.
	for _, bad := range [][]string{
		{"--tls-cert", filepath.Join(certs, "server.pem")},
		{"--tls-client-ca", ca},
		{"--tls-cert", filepath.Join(certs, "server.pem"), "--tls-key", filepath.Join(certs, "alice.key")},
	} {
		out, err := exec.Command(shoalBin, append([]string{"serve", "--data", data, "--e2b-listen="}, bad...)...).CombinedOutput()
		if err == nil || !strings.Contains(string(out), "tls") {
			t.Errorf("serve %v: %v %s, want refused naming the TLS flags", bad, err, out)
		}
	}

	addr := startExtraServe(t, data, "--e2b-listen=", "--pool-size", "0", "--egress-subnet=",
		"--tls-cert", filepath.Join(certs, "server.pem"), "--tls-key", filepath.Join(certs, "server.key"), "--tls-client-ca", ca)
	url := "https://" + addr
	key, err := waitKey(data)
	if err != nil {
		t.Fatal(err)
	}
	env := func(extra ...string) []string {
		return append(append(os.Environ(), "SHOAL_URL="+url, "SHOAL_API_KEY="+key), extra...)
	}
	withCert := env("SHOAL_CA="+ca, "SHOAL_CERT="+filepath.Join(certs, "alice.pem"), "SHOAL_CERT_KEY="+filepath.Join(certs, "alice.key"))
	cli := func(env []string, args ...string) (string, error) {
		cmd := exec.Command(shoalBin, args...)
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		return strings.TrimSpace(string(out)), err
	}
	// The health check: the CA only (the node's API is up once it answers).
	caOnly, err := shoal.ClientTLS(ca, "", "")
	if err != nil {
		t.Fatal(err)
	}
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: caOnly}}
	waitFor(t, 2*time.Minute, "the TLS serve", func() bool {
		res, err := hc.Get(url + "/healthz")
		if err != nil {
			return false
		}
		res.Body.Close()
		return res.StatusCode == http.StatusOK
	})

	root, err := busyboxRootfs()
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(root)
	if out, err := cli(withCert, "layer", "build", "--kind", "base", "bb:tls", root); err != nil {
		t.Fatalf("layer build over TLS: %v\n%s", err, out)
	}
	id, err := cli(withCert, "create", "--base", "bb:tls")
	if err != nil {
		t.Fatalf("create over TLS: %v\n%s", err, id)
	}
	if out, err := cli(withCert, "exec", id, "--", "echo", "over tls"); err != nil || out != "over tls" {
		t.Errorf("exec over TLS: %v %q", err, out)
	}

	// Refused: no client certificate; a CA that is not the server's;
	// plain HTTP.
	if out, err := cli(env("SHOAL_CA="+ca), "ls"); err == nil || !strings.Contains(out, "client certificate") {
		t.Errorf("ls without a client certificate: %v %s, want unauthenticated saying why", err, out)
	}
	if out, err := cli(env("SHOAL_CERT="+filepath.Join(certs, "alice.pem"), "SHOAL_CERT_KEY="+filepath.Join(certs, "alice.key")), "ls"); err == nil || !strings.Contains(out, "certificate") {
		t.Errorf("ls not trusting the server's CA: %v %s, want a certificate error", err, out)
	}
	if out, err := cli(append(withCert, "SHOAL_URL=http://"+addr), "ls"); err == nil {
		t.Errorf("ls over plain HTTP to the TLS port: answered %s", out)
	}

	// The Python SDK, from the same environment.
	if exec.Command("/usr/bin/python3", "-c", "import httpx").Run() != nil {
		t.Log("python SDK step skipped: /usr/bin/python3 has no httpx")
	} else {
		script := `
import shoal, sys
from shoal import Sandbox
sb = Sandbox.connect(sys.argv[1])
r = sb.commands.run("echo py over tls")
assert r.stdout == "py over tls\n", r
sb.files.write("/tmp/f", "data")
assert sb.files.read("/tmp/f") == "data"
print("ok")
`
		cmd := exec.Command("/usr/bin/python3", "-c", script, id)
		cmd.Dir = "../../sdk/python"
		cmd.Env = withCert
		if out, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "ok") {
			t.Errorf("python SDK over TLS: %v\n%s", err, out)
		}
		cmd = exec.Command("/usr/bin/python3", "-c", script, id)
		cmd.Dir = "../../sdk/python"
		cmd.Env = env("SHOAL_CA=" + ca)
		if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), "client certificate") {
			t.Errorf("python SDK without a client certificate: %v\n%s, want refused saying why", err, out)
		}
	}
	if out, err := cli(withCert, "rm", id); err != nil {
		t.Errorf("rm over TLS: %v %s", err, out)
	}
}

// waitKey reads the admin key serve writes to data at start.
func waitKey(data string) (string, error) {
	var b []byte
	var err error
	for i := 0; i < 600; i++ {
		if b, err = os.ReadFile(filepath.Join(data, "admin.key")); err == nil && len(b) > 0 {
			return strings.TrimSpace(string(b)), nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return "", err
}

// Package cluster_test runs a cluster on one machine: an embedded etcd, two
// `shoal serve --role node` processes (a third joins for the Python SDK's
// suite) and two `--role control` processes on
// 127.0.0.1, and drives it through the control replicas with the Go SDK
// (the client the CLI is built on): creates spread over the nodes, exec and
// files are routed to the sandbox's node, a node killed has its sandboxes
// reported lost while the other node's keep working, and the node
// restarted on its data directory has them back. The dashboard of a
// replica shows both nodes and the sandboxes of each, and its terminal
// reaches a sandbox on either (dash_test.go). E2B's API and envd, through
// a replica's E2B endpoint, reach sandboxes on both nodes (e2b_test.go).
// Environments and keyed creates are the cluster's (state_test.go), and
// so are layer tags (layers_test.go). Its links are TLS (tls_test.go): etcd
// and the nodes' APIs require client certificates, which the replicas
// present.
//
// It needs root, runc, mkfs.erofs and busybox (as test/e2e); without them
// it skips, saying which is missing.
package cluster_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/cluster"
	"github.com/shoal-sandbox/shoal/internal/cluster/etcdtest"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

const baseRef = "busybox:1"

func need(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (runc, mounts, cgroups)")
	}
	for _, bin := range []string{"runc", "mkfs.erofs", "busybox"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Skip("needs " + bin + " installed")
		}
	}
}

func build(t *testing.T) string {
	dir := t.TempDir()
	for _, b := range [][]string{
		{"go", "build", "-o", filepath.Join(dir, "shoal"), "../../cmd/shoal"},
		{"go", "build", "-o", filepath.Join(dir, "shoal-agent"), "../../cmd/shoal-agent"},
	} {
		cmd := exec.Command(b[0], b[1:]...)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%v: %v\n%s", b, err, out)
		}
	}
	return dir
}

func freeAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// proc is one serve process.
type proc struct {
	name, addr, data string
	e2b              string // its E2B endpoint's address
	args             []string
	cmd              *exec.Cmd
}

func (p *proc) start(t *testing.T, bin string) {
	t.Helper()
	log, err := os.OpenFile(filepath.Join(p.data, "serve.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	p.cmd = exec.Command(filepath.Join(bin, "shoal"), append([]string{"serve", "--data", p.data, "--listen", p.addr}, p.args...)...)
	p.cmd.Stdout, p.cmd.Stderr = log, log
	// FnCall: the Python suite's shell language on the cluster's base (as
	// its own server fixture configures it), on every node.
	fncall := filepath.Join(p.data, "fncall.json")
	lang := `{"languages": [{"name": "sh", "base": "` + baseRef + `", "source": "main.sh", "run": ["sh", "main.sh", "{args}"]}]}`
	if err := os.WriteFile(fncall, []byte(lang), 0o600); err != nil {
		t.Fatal(err)
	}
	p.cmd.Env = append(os.Environ(), "SHOAL_FNCALL_CONFIG="+fncall)
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if res, err := apiHTTP.Get(apiURL(p.addr) + "/healthz"); err == nil {
			res.Body.Close()
			return
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(filepath.Join(p.data, "serve.log"))
			t.Fatalf("%s did not answer within 2 minutes (a node recovering sandboxes on a loaded host is slow):\n%s", p.name, b)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitNodes waits until every control replica's /healthz counts n live
// nodes.
func waitNodes(t *testing.T, controls []*proc, n int) {
	t.Helper()
	waitFor(t, fmt.Sprintf("%d nodes seen by every control replica", n), func() error {
		for _, c := range controls {
			res, err := apiHTTP.Get(apiURL(c.addr) + "/healthz")
			if err != nil {
				return err
			}
			var b bytes.Buffer
			b.ReadFrom(res.Body)
			res.Body.Close()
			if !strings.Contains(b.String(), fmt.Sprintf(`"nodes":%d`, n)) {
				return fmt.Errorf("%s: %s", c.name, b.String())
			}
		}
		return nil
	})
}

// kill ends the process at once (a crash: no lease revoked).
func (p *proc) kill() {
	if p.cmd != nil && p.cmd.Process != nil {
		p.cmd.Process.Signal(syscall.SIGKILL)
		p.cmd.Wait()
		p.cmd = nil
	}
}

func (p *proc) stop() {
	if p.cmd != nil && p.cmd.Process != nil {
		p.cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { p.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			p.cmd.Process.Signal(syscall.SIGKILL)
			<-done
		}
		p.cmd = nil
	}
}

func client(t *testing.T, addr, key string) *shoal.Client {
	c, err := shoal.New(shoal.Options{URL: apiURL(addr), APIKey: key, CAFile: certs.ca, CertFile: certs.clientCert, KeyFile: certs.clientKey})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func waitFor(t *testing.T, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s: %v", what, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestCluster(t *testing.T) {
	need(t)
	t0 := time.Now()
	step := func(what string) { t.Logf("%6.1fs %s", time.Since(t0).Seconds(), what) }
	bin := build(t)
	step("built")
	tlsSetup(t) // tls_test.go
	etcd := etcdtest.StartTLS(t, etcdtest.TLS{Cert: certs.nodeCert, Key: certs.nodeKey, ClientCA: certs.ca})
	key := "sk_shoal_clustertest_" + fmt.Sprint(time.Now().UnixNano())
	mkdata := func(name string) string {
		d, err := os.MkdirTemp("/tmp", "sc"+name) // short: unix socket paths live under it
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(d, "admin.key"), []byte(key+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		return d
	}
	// The nodes share a layer store (a directory here; a shared file
	// system or S3 in a fleet).
	store, err := os.MkdirTemp("/tmp", "scstore")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(store) })
	nodes := []*proc{{name: "n1"}, {name: "n2"}}
	for i, n := range nodes {
		n.addr, n.e2b, n.data = freeAddr(t), freeAddr(t), mkdata(n.name)
		n.args = []string{"--role", "node", "--etcd", etcd, "--node-name", n.name, "--node-ttl", "2s", "--layer-store", "file://" + store,
			"--e2b-listen", n.e2b, "--egress-subnet", fmt.Sprintf("10.%d.0.0/16", 254+i), "--pool-size", "0", "--min-available", "none",
			"--userns-base", fmt.Sprint(1_500_000_000 + i*100_000_000)}
		n.args = append(n.args, nodeTLS(n)...)
	}
	nodes[1].args = append(nodes[1].args, "--log-format", "json") // n2's log: JSON lines
	// n3 joins later (before the Python suite, which runs on three nodes)
	// and stays; the steps before it and the node-loss steps are of n1
	// and n2.
	n3 := &proc{name: "n3"}
	n3.addr, n3.e2b, n3.data = freeAddr(t), freeAddr(t), mkdata(n3.name)
	n3.args = []string{"--role", "node", "--etcd", etcd, "--node-name", n3.name, "--node-ttl", "2s", "--layer-store", "file://" + store,
		"--e2b-listen", n3.e2b, "--egress-subnet", "10.252.0.0/16", "--pool-size", "0", "--min-available", "none",
		"--userns-base", fmt.Sprint(1_700_000_000)}
	n3.args = append(n3.args, nodeTLS(n3)...)
	controls := []*proc{{name: "c1"}, {name: "c2"}}
	for _, c := range controls {
		c.addr, c.e2b, c.data = freeAddr(t), freeAddr(t), mkdata(c.name)
		c.args = append([]string{"--role", "control", "--etcd", etcd, "--e2b-listen", c.e2b}, controlTLS()...)
	}
	t.Cleanup(func() {
		for _, c := range controls {
			c.stop()
		}
		// Delete what the test made on each node, through the node.
		for _, n := range nodes {
			if n.cmd == nil {
				n.start(t, bin)
			}
			c := client(t, n.addr, key)
			if sbs, err := c.List(context.Background()); err == nil {
				for _, sb := range sbs {
					c.Delete(context.Background(), sb.Id)
				}
			}
			n.stop()
			if t.Failed() {
				b, _ := os.ReadFile(filepath.Join(n.data, "serve.log"))
				t.Logf("%s log:\n%s", n.name, b)
			}
			os.RemoveAll(n.data)
		}
		if n3.cmd != nil {
			c := client(t, n3.addr, key)
			if sbs, err := c.List(context.Background()); err == nil {
				for _, sb := range sbs {
					c.Delete(context.Background(), sb.Id)
				}
			}
			n3.stop()
			if t.Failed() {
				b, _ := os.ReadFile(filepath.Join(n3.data, "serve.log"))
				t.Logf("%s log:\n%s", n3.name, b)
			}
		}
		os.RemoveAll(n3.data)
		for _, c := range controls {
			os.RemoveAll(c.data)
		}
	})
	for _, n := range nodes {
		n.start(t, bin)
	}
	for _, c := range controls {
		c.start(t, bin)
	}
	step("started")
	// The base layer, built on each node through its own API (the same
	// content: the cluster's tag, which the second build leaves as it is).
	rootfs := busyboxRootfs(t)
	for _, n := range nodes {
		cmd := exec.Command(filepath.Join(bin, "shoal"), "layer", "build", "--kind", "base", baseRef, rootfs)
		cmd.Env = append(os.Environ(), cliEnv(n.addr, key)...)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("layer build on %s: %v\n%s", n.name, err, out)
		}
	}
	step("layers built")
	checkNodeTLS(t, context.Background(), nodes[0], key) // tls_test.go
	c1, c2 := client(t, controls[0].addr, key), client(t, controls[1].addr, key)
	// A bound for the whole cluster check, not a timing: the Python suite
	// through a replica alone took 4.3 min at load 15.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	waitNodes(t, controls, 2)

	// Creates spread: 2 through one replica land on both nodes (the first
	// one's reservation makes the other node the emptier; two replicas
	// reserve apart until the nodes' next reports, so through both the
	// two may meet on one node).
	onNode := map[string][]string{}
	tags := map[string]string{cluster.Tag("n1"): "n1", cluster.Tag("n2"): "n2"}
	var ids []string
	for i := 0; i < 2; i++ {
		c := c1
		sb, err := c.Create(ctx, &pb.CreateSandboxRequest{Base: baseRef, MemoryBytes: 64 << 20, TimeoutSeconds: 600})
		if err != nil {
			t.Fatalf("create %d: %v", i, err)
		}
		n := tags[cluster.TagOf(sb.Id)]
		if n == "" {
			t.Fatalf("sandbox ID %s names no node", sb.Id)
		}
		onNode[n] = append(onNode[n], sb.Id)
		ids = append(ids, sb.Id)
	}
	if len(onNode["n1"]) == 0 || len(onNode["n2"]) == 0 {
		t.Fatalf("2 creates did not spread over 2 nodes: %v", onNode)
	}
	// A node's every log line names it; n2's are JSON, with the stable
	// keys on a create's line.
	for _, n := range nodes {
		b, _ := os.ReadFile(filepath.Join(n.data, "serve.log"))
		created := 0
		for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
			if strings.HasPrefix(line, "time=") && !strings.Contains(line, " node="+n.name) {
				t.Fatalf("%s's log line without node=%s: %s", n.name, n.name, line)
			}
			if !strings.HasPrefix(line, "{") {
				continue
			}
			var rec map[string]any
			if err := json.Unmarshal([]byte(line), &rec); err != nil || rec["node"] != n.name {
				t.Fatalf("%s's JSON log line without \"node\":%q: %s (%v)", n.name, n.name, line, err)
			}
			if rec["msg"] == "sandbox created" {
				created++
				for _, k := range []string{"sandbox_id", "tenant", "layer"} {
					if _, ok := rec[k]; !ok {
						t.Fatalf("%s: a create's log line without %s: %s", n.name, k, line)
					}
				}
			}
		}
		if n.name == "n2" && created == 0 {
			t.Fatalf("n2's log (JSON) has no create:\n%s", b)
		}
	}
	step("created")
	// Environments in etcd, keyed creates across replicas (state_test.go).
	checkClusterState(t, ctx, bin, controls, nodes, key, c1, c2)
	step("cluster state")
	// Layer tags in etcd, layer builds and tags through the replicas
	// (layers_test.go).
	checkLayerTags(t, ctx, bin, controls, nodes, key, c1, c2)
	step("layer tags")
	// Exec and files, routed by either replica to the sandbox's node.
	for i, id := range ids {
		c := []*shoal.Client{c2, c1}[i%2]
		content := "hello " + id
		if _, err := c.WriteFile(ctx, id, "/work/a.txt", 0o644, strings.NewReader(content)); err != nil {
			t.Fatalf("write file in %s: %v", id, err)
		}
		var out bytes.Buffer
		st, err := c.Exec(ctx, id, shoal.ExecOptions{Args: []string{"cat", "/work/a.txt"}, Stdout: &out})
		if err != nil || st.Code != 0 || out.String() != content {
			t.Fatalf("exec in %s: %q, %+v, %v; want %q", id, out.String(), st, err, content)
		}
		var back bytes.Buffer
		if _, err := c.ReadFile(ctx, id, "/work/a.txt", &back); err != nil || back.String() != content {
			t.Fatalf("read file of %s: %q %v", id, back.String(), err)
		}
	}
	// The dashboard of a replica: both nodes, each sandbox on its node,
	// commands and a terminal routed to it.
	checkDashboard(t, ctx, bin, controls[0].addr, key, onNode)
	checkDashboardPage(t, controls[1].addr, key, onNode)
	step("dashboard")
	// A watch through a replica: armed (its header relayed), then events.
	w, err := c1.Watch(ctx, ids[0], "/work", false)
	if err != nil {
		t.Fatalf("watch through control: %v", err)
	}
	if _, err := c2.WriteFile(ctx, ids[0], "/work/w.txt", 0o644, strings.NewReader("w")); err != nil {
		t.Fatal(err)
	}
	// A write is a temporary file renamed into place: wait for w.txt's
	// event among the first few.
	for i := 0; ; i++ {
		ev, err := w.Next()
		if err != nil || i == 20 {
			t.Fatalf("watch through control: %v %v, and no event for /work/w.txt", ev, err)
		}
		if ev.GetPath() == "/work/w.txt" {
			break
		}
	}
	w.Close()
	sbs, err := c1.List(ctx)
	if err != nil || len(sbs) != 2 {
		t.Fatalf("list through control: %d sandboxes, %v; want 2", len(sbs), err)
	}
	pythonSDK(t, controls[1].addr, key) // the Python SDK, unchanged, against a control replica
	step("python")
	// A third node joins (it mirrors the tags and mounts the base from
	// the shared store: nothing is built on it), then the SDK's own
	// end-to-end suite runs through a replica over the three.
	n3.start(t, bin)
	tags[cluster.Tag("n3")] = "n3"
	waitNodes(t, controls, 3)
	pythonSuite(t, bin, controls[0].addr, key) // the SDK's own end-to-end suite through a replica
	step("python suite on three nodes")
	checkE2B(t, ctx, controls, nodes, key, tags) // E2B's API and envd through the replicas (e2b_test.go)
	step("e2b")
	checkTenants(t, ctx, bin, controls, nodes, key, tags) // tenants' keys and quotas across the cluster (tenants_test.go)
	step("tenants")

	// Kill n2: after its lease ends its sandboxes are reported lost, and
	// n1's keep working; new creates go to the live nodes.
	nodes[1].kill()
	lost := onNode["n2"][0]
	waitFor(t, "n2's sandbox reported lost", func() error {
		_, err := c1.Get(ctx, lost)
		if connect.CodeOf(err) == connect.CodeUnavailable && strings.Contains(err.Error(), "lost") {
			return nil
		}
		return fmt.Errorf("get %s: %v", lost, err)
	})
	checkDashboardLost(t, controls[1].addr, key, "n2", lost)
	checkE2BLost(t, ctx, controls[0], key, lost)
	// The other replica lists them lost too, at once (it may not have
	// seen the lease end yet: then the node does not answer).
	sbs, err = c2.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	nLost := 0
	for _, sb := range sbs {
		if sb.State == pb.SandboxState_SANDBOX_STATE_ERROR && strings.Contains(sb.Error, "lost") {
			nLost++
		}
	}
	if len(sbs) != 2 || nLost != len(onNode["n2"]) {
		t.Fatalf("list after n2 died: %d sandboxes, %d lost; want 2, %d lost", len(sbs), nLost, len(onNode["n2"]))
	}
	for _, id := range onNode["n1"] {
		var out bytes.Buffer
		if st, err := c2.Exec(ctx, id, shoal.ExecOptions{Args: []string{"echo", "still"}, Stdout: &out}); err != nil || st.Code != 0 || out.String() != "still\n" {
			t.Fatalf("exec in %s on the live node: %q %+v %v", id, out.String(), st, err)
		}
	}
	sb, err := c1.Create(ctx, &pb.CreateSandboxRequest{Base: baseRef, MemoryBytes: 64 << 20})
	if n := tags[cluster.TagOf(sb.GetId())]; err != nil || n != "n1" && n != "n3" {
		t.Fatalf("create with n2 down: %v on %q, want n1 or n3", err, n)
	}
	if err := c1.Delete(ctx, sb.Id); err != nil {
		t.Fatal(err)
	}

	changeEnvsWhileDown(t, ctx, controls[0], key)
	step("lost and the rest checked")
	// n2 restarted on its data directory: its sandboxes are back, and the
	// environments changed while it was down are as etcd has them.
	nodes[1].start(t, bin)
	checkEnvsCaughtUp(t, ctx, nodes[1], key)
	waitFor(t, "n2's sandbox back", func() error {
		var out bytes.Buffer
		st, err := c1.Exec(ctx, lost, shoal.ExecOptions{Args: []string{"cat", "/work/a.txt"}, Stdout: &out})
		if err != nil {
			return err
		}
		if st.Code != 0 || out.String() != "hello "+lost {
			return fmt.Errorf("exec: %q %+v", out.String(), st)
		}
		return nil
	})
	step("n2 back")
	for _, id := range ids {
		if err := c2.Delete(ctx, id); err != nil {
			t.Fatalf("delete %s: %v", id, err)
		}
	}
	if _, err := c1.Get(ctx, ids[0]); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("get after delete: %v, want not found", err)
	}
	if sbs, err := c1.List(ctx); err != nil || len(sbs) != 0 {
		t.Fatalf("list after deleting all: %d %v", len(sbs), err)
	}
	// A build through a replica is a node's: its refusal relayed.
	st, err := c1.Layers.BuildLayer(ctx, connect.NewRequest(&pb.BuildLayerRequest{Ref: "x:1"}))
	if err == nil {
		for st.Receive() {
		}
		err = st.Err()
		st.Close()
	}
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("a build with no kind through control: %v, want invalid_argument", err)
	}
	// Last (it leaves replica 1 dead): killed mid-burst of keyed creates,
	// retried through replica 2, one sandbox per key (state_test.go).
	checkReplicaKilledMidBurst(t, ctx, controls[0], c1, c2)
	step("replica killed mid-burst")
}

// busyboxRootfs makes a minimal root file system: busybox with its
// applets and the usual directories.
func busyboxRootfs(t *testing.T) string {
	root := t.TempDir()
	for _, d := range []string{"bin", "etc", "root", "tmp", "proc", "sys", "dev", "work"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	os.Chmod(filepath.Join(root, "tmp"), 0o1777)
	bb, _ := exec.LookPath("busybox")
	b, err := os.ReadFile(bb)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "bin", "busybox"), b, 0o755); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(bb, "--list").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, applet := range strings.Fields(string(out)) {
		if applet != "busybox" {
			os.Symlink("busybox", filepath.Join(root, "bin", applet))
		}
	}
	// The same tree as the Python SDK's tests build (sdk/python/tests/
	// conftest.py), which run on it through a replica (pythonSuite).
	for p, content := range map[string]string{
		"etc/passwd":     "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\nuser:x:1000:1000:user:/home/user:/bin/sh\n",
		"etc/group":      "root:x:0:\nnogroup:x:65534:\nuser:x:1000:\nusers:x:100:user\n",
		"www/index.html": "hello from the sandbox\n",
	} {
		os.MkdirAll(filepath.Dir(filepath.Join(root, p)), 0o755)
		if err := os.WriteFile(filepath.Join(root, p), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.MkdirAll(filepath.Join(root, "home", "user"), 0o755); err != nil {
		t.Fatal(err)
	}
	os.Chown(filepath.Join(root, "home", "user"), 1000, 1000)
	return root
}

// pythonSDK runs the Python SDK (sdk/python, unchanged) against the
// control replica at addr: a create, a file write, a command and the
// cluster's status (monitor.status: both nodes, the sandbox's node). It is
// skipped (returns false) where the SDK's dependency httpx is missing.
// pythonSuite runs the Python SDK's end-to-end suite (sdk/python/tests)
// against a control replica (SHOAL_SDK_CLUSTER: container sandboxes, the
// busybox base built on every node; what a replica does not serve skips,
// saying why). SHOAL_CLUSTER_PYTEST=0 leaves it out.
func pythonSuite(t *testing.T, bin, addr, key string) {
	py := "/usr/bin/python3"
	if os.Getenv("SHOAL_CLUSTER_PYTEST") == "0" {
		t.Log("python suite skipped: SHOAL_CLUSTER_PYTEST=0")
		return
	}
	if exec.Command(py, "-c", "import httpx, pytest").Run() != nil {
		t.Log("python suite skipped: /usr/bin/python3 has no httpx or pytest")
		return
	}
	cmd := exec.Command(py, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "tests")
	cmd.Dir = "../../sdk/python"
	cmd.Env = append(os.Environ(), "SHOAL_SDK_CLUSTER=http://"+addr+"|"+key, "SHOAL_BIN_DIR="+bin)
	out, err := cmd.CombinedOutput()
	tail := string(out)
	if i := strings.LastIndex(tail, "\n="); i > 0 {
		tail = tail[i:]
	}
	t.Logf("python suite through a control replica: %s", strings.TrimSpace(tail))
	if err != nil {
		t.Fatalf("python suite through a control replica: %v\n%s", err, out)
	}
}

func pythonSDK(t *testing.T, addr, key string) bool {
	py := "/usr/bin/python3"
	if exec.Command(py, "-c", "import httpx").Run() != nil {
		t.Log("python SDK step skipped: /usr/bin/python3 has no httpx")
		return false
	}
	script := `
import shoal
from shoal import Sandbox, environments, monitor
# Environments are the cluster's: a revision, and a replace from a stale one refused.
e = environments.create("py-env", base="busybox:1")
assert e.revision > 0 and environments.get("py-env").revision == e.revision, e
e2 = environments.create("py-env", base="busybox:1", replace=True, if_revision=e.revision)
assert e2.revision > e.revision, e2
try:
    environments.create("py-env", base="busybox:1", replace=True, if_revision=e.revision)
    raise AssertionError("a replace from a stale revision went through")
except shoal.FailedPrecondition:
    pass
# A keyed create twice: one sandbox.
with Sandbox.create(template="py-env", memory="64M", client_key="py-key/1") as a:
    b = Sandbox.create(template="py-env", memory="64M", client_key="py-key/1")
    if b.id != a.id:
        b.kill()
    assert b.id == a.id, (a.id, b.id)
environments.rm("py-env")
# Layer tags are the cluster's: a tag made through this replica, a create
# from it at once (on whichever node), the tag removed.
from shoal import layers
t = layers.tag("busybox:1", "py-base:1")
assert t.layer.digest == layers.get("busybox:1").digest, t
with Sandbox.create(base="py-base:1", memory="64M") as sb2:
    assert sb2.commands.run("true").exit_code == 0
layers.rm("py-base:1")
with Sandbox.create(base="busybox:1", memory="64M") as sb:
    sb.files.write("/work/p.txt", "from python")
    r = sb.commands.run("cat /work/p.txt")
    assert r.exit_code == 0 and r.stdout == "from python", r
    st = monitor.status()  # every node, each sandbox on its node
    assert sorted(n.name for n in st.nodes) == ["n1", "n2"] and all(n.state == "up" and n.heartbeat_at for n in st.nodes), st.nodes
    mine = [s for s in st.sandboxes if s.sandbox_id == sb.id]
    assert mine and mine[0].node in ("n1", "n2") and mine[0].state == "running", st.sandboxes
    print("ok", sb.id)
`
	cmd := exec.Command(py, "-c", script)
	cmd.Env = append(os.Environ(), "PYTHONPATH=../../sdk/python", "SHOAL_URL=http://"+addr, "SHOAL_API_KEY="+key)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.HasPrefix(string(out), "ok ") {
		t.Fatalf("python SDK through control: %v\n%s", err, out)
	}
	return true
}

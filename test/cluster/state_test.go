package cluster_test

// The cluster's state in etcd, through the real processes: environments
// written through one replica are read through the other and at every
// node, a conflicting update is refused, a create from one through the
// other replica works; a create retried with its client key through the
// other replica returns the same sandbox; a node down while environments
// change catches up when it comes back.

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/api/shoal/v1/shoalv1connect"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

func layers(addr string) shoalv1connect.LayerServiceClient {
	return shoalv1connect.NewLayerServiceClient(apiHTTP, apiURL(addr))
}

func keyed[T any](msg *T, key string) *connect.Request[T] {
	r := connect.NewRequest(msg)
	r.Header().Set("Authorization", "Bearer "+key)
	return r
}

// envNames lists the environments the API at addr has.
func envNames(ctx context.Context, addr, key string) ([]string, error) {
	res, err := layers(addr).ListEnvironments(ctx, keyed(&pb.ListEnvironmentsRequest{}, key))
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range res.Msg.Environments {
		out = append(out, e.Name)
	}
	return out, nil
}

// cli runs the shoal CLI against the API at addr.
func cli(t *testing.T, bin, addr, key string, args ...string) (string, error) {
	cmd := exec.Command(filepath.Join(bin, "shoal"), args...)
	cmd.Env = append(os.Environ(), cliEnv(addr, key)...)
	out, err := cmd.CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

func checkClusterState(t *testing.T, ctx context.Context, bin string, controls, nodes []*proc, key string, c1, c2 *shoal.Client) {
	t.Helper()
	a, b := layers(controls[0].addr), layers(controls[1].addr)
	env, err := a.CreateEnvironment(ctx, keyed(&pb.CreateEnvironmentRequest{Name: "task-env", Base: baseRef}, key))
	if err != nil {
		t.Fatalf("create an environment through replica 1: %v", err)
	}
	if env.Msg.Revision == 0 || len(env.Msg.Resolved) != 1 {
		t.Fatalf("the environment as made: %+v; want a revision and its base resolved", env.Msg)
	}
	got, err := b.GetEnvironment(ctx, keyed(&pb.GetEnvironmentRequest{Name: "task-env"}, key))
	if err != nil || got.Msg.Revision != env.Msg.Revision || got.Msg.Base != baseRef {
		t.Fatalf("the environment through replica 2: %+v %v; want revision %d", got.Msg, err, env.Msg.Revision)
	}
	for _, n := range nodes {
		waitFor(t, "the environment at node "+n.name, func() error {
			names, err := envNames(ctx, n.addr, key)
			if err != nil || !slices.Contains(names, "task-env") {
				return fmt.Errorf("%v %v", names, err)
			}
			return nil
		})
	}
	// Conflicts: a second create of the name, a replace from a revision
	// someone moved past.
	if _, err := b.CreateEnvironment(ctx, keyed(&pb.CreateEnvironmentRequest{Name: "task-env", Base: baseRef}, key)); connect.CodeOf(err) != connect.CodeAlreadyExists {
		t.Fatalf("create the environment again: %v; want already_exists", err)
	}
	moved, err := b.CreateEnvironment(ctx, keyed(&pb.CreateEnvironmentRequest{Name: "task-env", Base: baseRef, Replace: true, IfRevision: env.Msg.Revision}, key))
	if err != nil {
		t.Fatalf("replace at its revision: %v", err)
	}
	if _, err := a.CreateEnvironment(ctx, keyed(&pb.CreateEnvironmentRequest{Name: "task-env", Base: baseRef, Replace: true, IfRevision: env.Msg.Revision}, key)); connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("replace from a stale revision: %v; want failed_precondition", err)
	}
	// A node's own API writes the cluster's too.
	if _, err := layers(nodes[0].addr).CreateEnvironment(ctx, keyed(&pb.CreateEnvironmentRequest{Name: "task-env", Base: baseRef, Replace: true, IfRevision: env.Msg.Revision}, key)); connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("replace from a stale revision on a node: %v; want failed_precondition", err)
	}
	// And the CLI's.
	if out, err := cli(t, bin, controls[0].addr, key, "env", "create", "task-env", "--base", baseRef, "--replace", "--if-revision", fmt.Sprint(env.Msg.Revision)); err == nil || !strings.Contains(out, "changed since revision") {
		t.Fatalf("shoal env create --if-revision (stale): %v: %s; want refused", err, out)
	}
	// A create from it through the other replica, at once.
	sb, err := c2.Create(ctx, &pb.CreateSandboxRequest{Template: "task-env", MemoryBytes: 64 << 20})
	if err != nil {
		t.Fatalf("create from the environment through replica 2: %v", err)
	}
	if err := c1.Delete(ctx, sb.Id); err != nil {
		t.Fatal(err)
	}
	t.Logf("environment at revisions %d, %d", env.Msg.Revision, moved.Msg.Revision)

	// A keyed create retried through the other replica: the same sandbox.
	first, err := c1.Create(ctx, &pb.CreateSandboxRequest{Base: baseRef, MemoryBytes: 64 << 20, ClientKey: "state-test/1"})
	if err != nil {
		t.Fatal(err)
	}
	again, err := c2.Create(ctx, &pb.CreateSandboxRequest{Base: baseRef, MemoryBytes: 64 << 20, ClientKey: "state-test/1"})
	if err != nil || again.Id != first.Id {
		t.Fatalf("the keyed create retried through replica 2: %v %v; want %s", again.GetId(), err, first.Id)
	}
	if err := c2.Delete(ctx, first.Id); err != nil {
		t.Fatal(err)
	}
	// The CLI's --client-key, through one replica then the other.
	id1, err1 := cli(t, bin, controls[0].addr, key, "create", "--base", baseRef, "--memory", "64M", "--client-key", "state-test/cli")
	id2, err2 := cli(t, bin, controls[1].addr, key, "create", "--base", baseRef, "--memory", "64M", "--client-key", "state-test/cli")
	if err1 != nil || err2 != nil || id1 != id2 {
		t.Fatalf("shoal create --client-key through both replicas: %q %v, %q %v; want one sandbox", id1, err1, id2, err2)
	}
	if err := c1.Delete(ctx, id1); err != nil {
		t.Fatal(err)
	}
}

// checkReplicaKilledMidBurst kills replica dead (c1's) in the middle of a
// burst of keyed creates through it, retries every create it did not
// answer through c2, and checks that every key has exactly one sandbox.
func checkReplicaKilledMidBurst(t *testing.T, ctx context.Context, dead *proc, c1, c2 *shoal.Client) {
	t.Helper()
	const keys = 10
	ids := make([]string, keys)
	retried := 0
	var mu sync.Mutex
	answered := make(chan struct{}, keys)
	var wg sync.WaitGroup
	for k := range keys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req := &pb.CreateSandboxRequest{Base: baseRef, MemoryBytes: 32 << 20, TimeoutSeconds: 300, ClientKey: fmt.Sprintf("burst/%d", k)}
			sb, err := c1.Create(ctx, req)
			if err == nil {
				answered <- struct{}{}
			} else {
				mu.Lock()
				retried++
				mu.Unlock()
				for range 10 { // as a client does: retry, through the other replica
					if sb, err = c2.Create(ctx, req); err == nil || connect.CodeOf(err) != connect.CodeUnavailable {
						break
					}
					time.Sleep(200 * time.Millisecond)
				}
			}
			if err != nil {
				t.Errorf("key burst/%d: %v", k, err)
				return
			}
			ids[k] = sb.Id
		}()
	}
	select { // the first answer: the rest are under way
	case <-answered:
	case <-time.After(2 * time.Minute):
		t.Fatal("no create of the burst answered within 2 minutes")
	}
	dead.kill()
	wg.Wait()
	if t.Failed() {
		return
	}
	sbs, err := c2.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	live := map[string]bool{}
	for _, sb := range sbs {
		live[sb.Id] = true
	}
	seen := map[string]bool{}
	for k, id := range ids {
		if !live[id] || seen[id] {
			t.Fatalf("key burst/%d: sandbox %s (live %v, given to another key %v)", k, id, live[id], seen[id])
		}
		seen[id] = true
	}
	if len(sbs) != keys {
		t.Fatalf("%d sandboxes after a burst of %d keyed creates (%d retried through the other replica): a key made two", len(sbs), keys, retried)
	}
	t.Logf("replica killed mid-burst: %d of %d keyed creates retried through the other replica, %d sandboxes", retried, keys, len(sbs))
	for id := range live {
		c2.Delete(ctx, id)
	}
}

// changeEnvsWhileDown changes the environments through a replica while a
// node is down; checkEnvsCaughtUp checks the node has the changes once
// back.
func changeEnvsWhileDown(t *testing.T, ctx context.Context, control *proc, key string) {
	t.Helper()
	c := layers(control.addr)
	if _, err := c.DeleteEnvironment(ctx, keyed(&pb.DeleteEnvironmentRequest{Name: "task-env"}, key)); err != nil {
		t.Fatalf("remove an environment with a node down: %v", err)
	}
	if _, err := c.CreateEnvironment(ctx, keyed(&pb.CreateEnvironmentRequest{Name: "later-env", Base: baseRef}, key)); err != nil {
		t.Fatalf("create an environment with a node down: %v", err)
	}
}

func checkEnvsCaughtUp(t *testing.T, ctx context.Context, n *proc, key string) {
	t.Helper()
	names, err := envNames(ctx, n.addr, key)
	if err != nil || !slices.Equal(names, []string{"later-env"}) {
		t.Fatalf("%s's environments back up: %v %v; want later-env alone", n.name, names, err)
	}
}

package cluster_test

// Layer tags are the cluster's: layers built through a replica (uploads,
// relayed to a node with the shared layer store), a tag made through one
// replica seen by every node and used by a create through the other; the
// tag moved through a node's own API, the next creates through the
// replicas, at once, get the new version (on either node) while the
// sandbox made before keeps the old; the tag removed
// through a replica leaves every node.

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// layerDigest is the digest ref has at the API at addr.
func layerDigest(ctx context.Context, addr, key, ref string) (string, error) {
	res, err := layers(addr).GetLayer(ctx, keyed(&pb.GetLayerRequest{Ref: ref}, key))
	if err != nil {
		return "", err
	}
	return res.Msg.Digest, nil
}

// marker runs cat /marker in sandbox id.
func marker(ctx context.Context, c *shoal.Client, id string) (string, error) {
	var out bytes.Buffer
	st, err := c.Exec(ctx, id, shoal.ExecOptions{Args: []string{"cat", "/marker"}, Stdout: &out})
	if err != nil {
		return "", err
	}
	if st.Code != 0 {
		return "", fmt.Errorf("cat /marker: exit %d", st.Code)
	}
	return out.String(), nil
}

func checkLayerTags(t *testing.T, ctx context.Context, bin string, controls, nodes []*proc, key string, c1, c2 *shoal.Client) {
	t.Helper()
	// Two versions of a base, each built from an upload through a
	// replica (the CLI tars the directory).
	digests := map[string]string{}
	for i, v := range []string{"1", "2"} {
		dir := busyboxRootfs(t)
		if err := os.WriteFile(filepath.Join(dir, "marker"), []byte("v"+v), 0o644); err != nil {
			t.Fatal(err)
		}
		if out, err := cli(t, bin, controls[i].addr, key, "layer", "build", "--kind", "base", "mark:"+v, dir); err != nil {
			t.Fatalf("shoal layer build through replica %d: %v\n%s", i+1, err, out)
		}
		d, err := layerDigest(ctx, controls[1-i].addr, key, "mark:"+v)
		if err != nil {
			t.Fatalf("mark:%s through the other replica: %v", v, err)
		}
		digests[v] = d
	}
	a, b := layers(controls[0].addr), layers(controls[1].addr)
	// A tag made through replica 1: every node has it.
	tagged, err := a.TagLayer(ctx, keyed(&pb.TagLayerRequest{Source: "mark:1", Target: "task-base:1"}, key))
	if err != nil || tagged.Msg.Layer.GetDigest() != digests["1"] {
		t.Fatalf("tag through replica 1: %v %v", tagged, err)
	}
	seeAt := func(digest string) {
		for _, n := range nodes {
			waitFor(t, "task-base:1 at "+digest+" on node "+n.name, func() error {
				d, err := layerDigest(ctx, n.addr, key, "task-base:1")
				if err != nil || d != digest {
					return fmt.Errorf("%s %v", d, err)
				}
				return nil
			})
		}
	}
	seeAt(digests["1"])
	// A create from it through replica 2.
	sb1, err := c2.Create(ctx, &pb.CreateSandboxRequest{Base: "task-base:1", MemoryBytes: 64 << 20})
	if err != nil {
		t.Fatalf("create from task-base:1 through replica 2: %v", err)
	}
	if m, err := marker(ctx, c2, sb1.Id); err != nil || m != "v1" {
		t.Fatalf("the sandbox made from task-base:1: /marker %q %v; want v1", m, err)
	}
	// Moved through a node's own API: in etcd first (it says where the
	// tag was), then on every node.
	moved, err := layers(nodes[1].addr).TagLayer(ctx, keyed(&pb.TagLayerRequest{Source: "mark:2", Target: "task-base:1"}, key))
	if err != nil || moved.Msg.PreviousDigest != digests["1"] || moved.Msg.Layer.GetDigest() != digests["2"] {
		t.Fatalf("move task-base:1 through node %s: %v %v; want from %s to %s", nodes[1].name, moved, err, digests["1"], digests["2"])
	}
	// The next creates, at once (through either replica, on either node,
	// whose copy may not have the move yet: the replica tells the node
	// the tag's revision), get the new version; the sandbox made before
	// keeps the old.
	var made []string
	for i, c := range []*shoal.Client{c1, c2, c1, c2} {
		sb, err := c.Create(ctx, &pb.CreateSandboxRequest{Base: "task-base:1", MemoryBytes: 64 << 20})
		if err != nil {
			t.Fatalf("create %d from the moved tag: %v", i, err)
		}
		made = append(made, sb.Id)
		if m, err := marker(ctx, c, sb.Id); err != nil || m != "v2" {
			t.Fatalf("a sandbox made right after the move (%s): /marker %q %v; want v2", sb.Id, m, err)
		}
	}
	seeAt(digests["2"])
	// And through the CLI, through replica 2: the tag as the cluster has it.
	if out, err := cli(t, bin, controls[1].addr, key, "layer", "inspect", "task-base:1"); err != nil || !strings.Contains(out, digests["2"]) {
		t.Fatalf("shoal layer inspect task-base:1 through replica 2: %v\n%s", err, out)
	}
	if m, err := marker(ctx, c1, sb1.Id); err != nil || m != "v1" {
		t.Fatalf("the sandbox made before the move: /marker %q %v; want v1 still", m, err)
	}
	for _, id := range append(made, sb1.Id) {
		if err := c1.Delete(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	// Removed through replica 2: gone from every node.
	if _, err := b.DeleteLayer(ctx, keyed(&pb.DeleteLayerRequest{Ref: "task-base:1"}, key)); err != nil {
		t.Fatalf("remove task-base:1 through replica 2: %v", err)
	}
	for _, n := range nodes {
		waitFor(t, "task-base:1 gone from node "+n.name, func() error {
			if _, err := layerDigest(ctx, n.addr, key, "task-base:1"); connect.CodeOf(err) != connect.CodeNotFound {
				return fmt.Errorf("get: %v", err)
			}
			return nil
		})
	}
}

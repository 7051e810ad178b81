package cluster

// Layer tags are cluster state, as environments are (envs.go): one key per
// tag in etcd, moved in one transaction through any control replica or
// node, and mirrored by every node into its layer store (where its creates
// resolve them, and where its garbage collection sees the images they
// name). The images themselves are in the nodes' shared layer store (or,
// without one, on the node that built them).
//
//	layers/tags/<name>/<version>            layer.Layer as JSON; the key's
//	                                        ModRevision is the tag's revision
//	layers/tags/<tenant>/<name>/<version>   a tenant's tag (layer.Layer.Key:
//	                                        tenants own their tags; those
//	                                        without a tenant are shared)

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/limits"
)

const layerTagsPrefix = Prefix + "layers/tags/"

// LayerTag is a tag as etcd has it: the layer it points at, and the
// revision of its last move.
type LayerTag struct {
	layer.Layer
	Revision int64
}

// layerTagKey is the etcd key of the tag of key ref (layer.Layer.Key:
// "[tenant/]name:version").
func layerTagKey(ref string) (string, error) {
	t, name, version, err := layer.ParseTagKey(ref)
	if err != nil {
		return "", errdefs.Mark(errdefs.ErrInvalidArgument, err)
	}
	if t != "" {
		t += "/"
	}
	return layerTagsPrefix + t + name + "/" + version, nil
}

// tagMoveAttempts bounds the retries of a tag move that raced another
// move of the same tag.
const tagMoveAttempts = 10

// PutLayerTag points the tag l.Key() at l in one transaction and returns
// the tag as written and the digest it pointed at before ("" if it is
// new). A tag that points at l's digest and kind already is left as it is
// (its layer returned): rebuilding the same content changes nothing. The
// layer's image is not checked here: the caller (a node) has it, or the
// shared store does.
func PutLayerTag(ctx context.Context, cli *clientv3.Client, l layer.Layer) (LayerTag, string, error) {
	k, err := layerTagKey(l.Key())
	if err != nil {
		return LayerTag{}, "", err
	}
	if _, err := layer.ParseKind(string(l.Kind)); err != nil || !strings.HasPrefix(l.Digest, "sha256:") || l.Size <= 0 {
		return LayerTag{}, "", errdefs.New(errdefs.ErrInvalidArgument, "tag %s: a layer with a kind, a digest and a size is required", l.Ref())
	}
	l.Remote, l.Mirrored = "", 0
	v, err := json.Marshal(l)
	if err != nil {
		return LayerTag{}, "", err
	}
	for range tagMoveAttempts {
		resp, err := cli.Get(ctx, k)
		if err != nil {
			return LayerTag{}, "", errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("read tag %s from etcd: %w", l.Ref(), err))
		}
		var old string
		cmp := clientv3.Compare(clientv3.CreateRevision(k), "=", 0)
		if len(resp.Kvs) > 0 {
			prev, err := decodeLayerTag(resp.Kvs[0].Value, resp.Kvs[0].ModRevision)
			if err == nil && prev.Digest == l.Digest && prev.Kind == l.Kind {
				return prev, prev.Digest, nil
			}
			old = prev.Digest
			cmp = clientv3.Compare(clientv3.ModRevision(k), "=", resp.Kvs[0].ModRevision)
		}
		tx, err := cli.Txn(ctx).If(cmp).Then(clientv3.OpPut(k, string(v))).Commit()
		if err != nil {
			return LayerTag{}, "", errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("write tag %s to etcd: %w", l.Ref(), err))
		}
		if tx.Succeeded {
			return LayerTag{Layer: l, Revision: tx.Header.Revision}, old, nil
		}
		// Moved by someone else since the read: read it again.
	}
	return LayerTag{}, "", errdefs.New(errdefs.ErrUnavailable, "tag %s: moved by others %d times while this move was tried: try again", l.Ref(), tagMoveAttempts)
}

// DeleteLayerTag removes a tag and returns the revision of its removal;
// an unknown one is not found.
func DeleteLayerTag(ctx context.Context, cli *clientv3.Client, ref string) (int64, error) {
	k, err := layerTagKey(ref)
	if err != nil {
		return 0, err
	}
	resp, err := cli.Delete(ctx, k)
	if err != nil {
		return 0, errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("remove tag %s from etcd: %w", ref, err))
	}
	if resp.Deleted == 0 {
		return 0, fmt.Errorf("tag %s: %w", ref, layer.ErrNotFound)
	}
	return resp.Header.Revision, nil
}

// GetLayerTag reads a tag from etcd (a linearizable read).
func GetLayerTag(ctx context.Context, cli *clientv3.Client, ref string) (LayerTag, error) {
	k, err := layerTagKey(ref)
	if err != nil {
		return LayerTag{}, err
	}
	resp, err := cli.Get(ctx, k)
	if err != nil {
		return LayerTag{}, errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("read tag %s from etcd: %w", ref, err))
	}
	if len(resp.Kvs) == 0 {
		return LayerTag{}, fmt.Errorf("tag %s: %w", ref, layer.ErrNotFound)
	}
	return decodeLayerTag(resp.Kvs[0].Value, resp.Kvs[0].ModRevision)
}

// ListLayerTags reads every tag, by name then version.
func ListLayerTags(ctx context.Context, cli *clientv3.Client) ([]LayerTag, int64, error) {
	resp, err := cli.Get(ctx, layerTagsPrefix, clientv3.WithPrefix())
	if err != nil {
		return nil, 0, errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("read layer tags from etcd: %w", err))
	}
	out := make([]LayerTag, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		if t, err := decodeLayerTag(kv.Value, kv.ModRevision); err == nil {
			out = append(out, t)
		}
	}
	return out, resp.Header.Revision, nil
}

func decodeLayerTag(v []byte, rev int64) (LayerTag, error) {
	var l layer.Layer
	if err := json.Unmarshal(v, &l); err != nil {
		return LayerTag{}, fmt.Errorf("decode layer tag: %w", err)
	}
	if _, _, _, err := layer.ParseTagKey(l.Key()); err != nil {
		return LayerTag{}, fmt.Errorf("decode layer tag: %w", err)
	}
	l.Remote, l.Mirrored = "", 0
	return LayerTag{Layer: l, Revision: rev}, nil
}

// refOfTagKey is the "[tenant/]name:version" (layer.Layer.Key) of a key
// under layerTagsPrefix.
func refOfTagKey(k string) string {
	k = strings.TrimPrefix(k, layerTagsPrefix)
	if i := strings.LastIndexByte(k, '/'); i >= 0 {
		return k[:i] + ":" + k[i+1:]
	}
	return k
}

// TagSink is where a node keeps its copy of the cluster's layer tags (its
// layer store); a sink of MirrorLayers that has it gets the tags too.
type TagSink interface {
	// MirrorTag points l.Key() at l (l.Mirrored: etcd's revision).
	MirrorTag(l layer.Layer) error
	// UnmirrorTag removes a tag (by its key); one already gone is not an
	// error.
	UnmirrorTag(key string) error
	// List returns every tag of the copy (layer.Layer.Mirrored is 0 for
	// one made on the node before it joined the cluster).
	List() ([]layer.Layer, error)
}

// TagRevisions reads the revisions of the tags refs (at most limits.Layers
// of them, a stack's most; others are left out) in one etcd transaction: ref → the
// revision of its last move; a tag etcd does not have is left out.
func TagRevisions(ctx context.Context, cli *clientv3.Client, refs []string) (map[string]int64, error) {
	var ops []clientv3.Op
	var keys []string
	for _, r := range refs {
		k, err := layerTagKey(r)
		if err != nil || len(ops) == limits.Layers {
			continue
		}
		ops = append(ops, clientv3.OpGet(k, clientv3.WithKeysOnly()))
		keys = append(keys, r)
	}
	out := map[string]int64{}
	if len(ops) == 0 {
		return out, nil
	}
	resp, err := cli.Txn(ctx).Then(ops...).Commit()
	if err != nil {
		return nil, errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("read layer tags from etcd: %w", err))
	}
	for i, r := range resp.Responses {
		if kvs := r.GetResponseRange().GetKvs(); len(kvs) > 0 {
			out[keys[i]] = kvs[0].ModRevision
		}
	}
	return out, nil
}

// Package cluster keeps the cluster's state in etcd: the nodes (each
// registered under a lease that its heartbeats keep alive, with its address
// and capacity report), the tag each node's sandbox IDs start with, and a
// catalog of sandboxes by node, so that the sandboxes of a node that died
// are reported lost rather than silently missing.
//
// Keys (all under Prefix):
//
//	nodes/<name>          NodeInfo as JSON, under the node's lease: gone
//	                      when the node stops heartbeating
//	tags/<tag>            the name of the node whose IDs start with <tag>
//	                      (claimed once, never under a lease: a dead
//	                      node's IDs still resolve to it)
//	sandboxes/<tag>/<id>  CatalogEntry as JSON, written by the node in the
//	                      background (never on a request's path)
//	tenancy/...           tenants' keys and quotas (tenants.go)
//	envs/<name>           an environment (envs.go), mirrored by every node
//	layers/tags/<n>/<v>   a layer tag (layertags.go), mirrored by every node
//	creates/<hash>        where a create with a client key went (creates.go)
//
// A node runs a Registration (node side); each control replica runs a
// Directory, which watches the nodes and tags and feeds placement, and a
// Usage, which follows the catalog to check tenants' quotas across the
// cluster. Both roles follow the tenants' keys (Tenancy).
package cluster

import (
	"crypto/sha256"
	"encoding/base32"
	"fmt"
	"strings"
	"time"

	"github.com/shoal-sandbox/shoal/internal/placement"
)

// Prefix is where the cluster's keys live in etcd.
const Prefix = "/shoal/"

const (
	nodesPrefix     = Prefix + "nodes/"
	tagsPrefix      = Prefix + "tags/"
	sandboxesPrefix = Prefix + "sandboxes/"
)

// TagLen is the length of a node's tag, the prefix of its sandbox IDs.
const TagLen = 4

// NodeInfo is what a node publishes about itself.
type NodeInfo struct {
	Name string `json:"name"`
	Tag  string `json:"tag"`
	// URL of its API (http://host:port), where control replicas forward.
	URL string `json:"url"`
	// E2BURL of its E2B endpoint (http://host:port), where control
	// replicas forward E2B's API and sandbox traffic; empty when the node
	// serves none.
	E2BURL string `json:"e2b_url,omitempty"`
	// LayerStore is the URL of the layer store the node shares with
	// others (empty: none): control replicas send layer builds, imports
	// and tags to a node with one, so that every node sees the layer.
	LayerStore string `json:"layer_store,omitempty"`
	// Load: the capacity report, as placement reads it.
	Load    placement.Node `json:"load"`
	Started time.Time      `json:"started"`
	Updated time.Time      `json:"updated"`
}

// CatalogEntry is a sandbox as the catalog knows it.
type CatalogEntry struct {
	ID      string    `json:"id"`
	Node    string    `json:"node"`
	Tenant  string    `json:"tenant,omitempty"`
	Created time.Time `json:"created"`
	// MilliCPU and Memory are the sandbox's limits, which tenants'
	// cluster-wide quotas count (Usage); zero in entries written before
	// they were recorded.
	MilliCPU int64 `json:"millicpu,omitempty"`
	Memory   int64 `json:"memory_bytes,omitempty"`
}

// Tag is the tag of node name: the first TagLen characters of the base32
// of its SHA-256, in the alphabet of sandbox IDs. Two names with the same
// tag cannot both register (the second is refused: rename it).
func Tag(name string) string {
	sum := sha256.Sum256([]byte(name))
	return strings.ToLower(base32.StdEncoding.EncodeToString(sum[:]))[:TagLen]
}

// TagOf is the node tag a sandbox ID starts with.
func TagOf(id string) string {
	if len(id) < TagLen {
		return ""
	}
	return id[:TagLen]
}

// ValidNodeName checks a node name: 1 to 63 characters of a-z, 0-9 and -.
func ValidNodeName(name string) error {
	if name == "" || len(name) > 63 {
		return fmt.Errorf("node name %q: want 1 to 63 characters", name)
	}
	for _, c := range name {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
			return fmt.Errorf("node name %q: want characters a-z, 0-9 and -", name)
		}
	}
	return nil
}

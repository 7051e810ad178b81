package node

import (
	"crypto/rand"
	"encoding/base32"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"go.etcd.io/bbolt"

	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/netpolicy"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// State is a sandbox's lifecycle state as persisted by the node.
type State string

const (
	StateCreating State = "creating"
	StateRunning  State = "running"
	StateDeleting State = "deleting"
	// StatePaused: the sandbox's processes are stopped in place and its
	// memory reclaimed (sandbox.Pauser); the next request that needs its
	// guest agent resumes it (Manager.Agent), or Manager.Resume does.
	StatePaused State = "paused"
	// StateError: the sandbox's runtime is gone (for example its init died
	// or the host rebooted); the only thing left to do is delete it.
	StateError State = "error"
)

// LayerRef is one layer of a sandbox, resolved to its digest at creation so
// that moving a tag never changes a running sandbox.
type LayerRef struct {
	Kind   string `json:"kind"`
	Ref    string `json:"ref"`
	Digest string `json:"digest"`
}

// Record is what the node persists about one sandbox.
type Record struct {
	ID        string            `json:"id"`
	Backend   string            `json:"backend"`
	State     State             `json:"state"`
	Error     string            `json:"error,omitempty"`
	Layers    []LayerRef        `json:"layers"` // top to bottom
	Resources sandbox.Resources `json:"resources"`
	Timeout   time.Duration     `json:"timeout"`
	Created   time.Time         `json:"created"`
	Expires   time.Time         `json:"expires"`
	Metadata  map[string]string `json:"metadata,omitempty"`
	Env       map[string]string `json:"env,omitempty"`
	Handle    sandbox.Handle    `json:"handle"`
	ClientKey string            `json:"client_key,omitempty"`
	// Network is the egress asked for; nil: loopback only.
	Network *netpolicy.Request `json:"network,omitempty"`
	// Tenant owns the sandbox ("": the admin's, as every sandbox made
	// before tenants existed); only its keys and admin keys see it.
	Tenant string `json:"tenant,omitempty"`
	// AutoPause: paused after this long without a request and without a
	// running command; 0 = never.
	AutoPause time.Duration `json:"auto_pause,omitempty"`
	// Pause describes the last pause (set while paused, kept after resume
	// until the next pause).
	Pause *PauseInfo `json:"pause,omitempty"`
	// Image: the config of the OCI image it was made from (images.go):
	// the WorkingDir and User of its commands that name none, and the
	// image's command; nil otherwise.
	Image *layer.ImageConfig `json:"image,omitempty"`
}

// PauseInfo is what the node knows of a sandbox's last pause.
type PauseInfo struct {
	At    time.Time          `json:"at"`
	Auto  bool               `json:"auto,omitempty"` // by the idle policy
	Stats sandbox.PauseStats `json:"stats"`
	// FSOnly: the pause ended the sandbox's processes first (its files
	// are kept, its processes and memory are not).
	FSOnly bool `json:"fs_only,omitempty"`
	// Evicted: memory pressure moved its memory off the host since
	// (sandbox.Evicter); Evict has what that did.
	Evicted bool                `json:"evicted,omitempty"`
	Evict   *sandbox.PauseStats `json:"evict,omitempty"`
	// ResumedAt and ResumeTook: the resume that ended it (zero while paused).
	ResumedAt  time.Time     `json:"resumed_at,omitempty"`
	ResumeTook time.Duration `json:"resume_took,omitempty"`
}

var (
	bucketSandboxes  = []byte("node.sandboxes")
	bucketClientKeys = []byte("node.client_keys") // client key → sandbox ID
)

// newID returns a random sandbox ID: 20 lowercase base32 characters (100
// bits), safe in host names, paths and runtime IDs.
func newID() string {
	var b [13]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err) // crypto/rand never fails on Linux
	}
	return strings.ToLower(base32.StdEncoding.WithPadding(base32.NoPadding).EncodeToString(b[:]))[:20]
}

// validID reports whether s has the shape of an ID made by newID, so that an
// ID from a request can be used in a path.
func validID(s string) bool {
	if len(s) != 20 {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= '2' && c <= '7') {
			return false
		}
	}
	return true
}

// clientKeyOf is the key of a create's client key in bucketClientKeys:
// client keys are per tenant, so that one tenant's key never returns
// another's sandbox ("" keeps the format from before tenants).
func clientKeyOf(tenant, key string) string {
	if tenant == "" {
		return key
	}
	return tenant + "\x00" + key
}

func putRecord(tx *bbolt.Tx, r *Record) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	return tx.Bucket(bucketSandboxes).Put([]byte(r.ID), b)
}

func loadRecords(db *bbolt.DB) ([]*Record, error) {
	var out []*Record
	err := db.View(func(tx *bbolt.Tx) error {
		return tx.Bucket(bucketSandboxes).ForEach(func(k, v []byte) error {
			r := new(Record)
			if err := json.Unmarshal(v, r); err != nil {
				return fmt.Errorf("decode sandbox %s: %w", k, err)
			}
			out = append(out, r)
			return nil
		})
	})
	return out, err
}

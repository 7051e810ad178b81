// Package node is the node agent's sandbox manager: it creates sandboxes on a
// backend from resolved layers, persists every sandbox in the embedded store,
// recovers them after a restart of the process, deletes idle ones when their
// timeout expires, and hands the session layer a client for each sandbox's
// guest agent.
package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/bbolt"
	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/boltgroup"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/limits"
	"github.com/shoal-sandbox/shoal/internal/metrics"
	"github.com/shoal-sandbox/shoal/internal/netpolicy"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
	"github.com/shoal-sandbox/shoal/internal/tenant"
)

// Errors returned by the manager; the API edge maps them to status codes.
var (
	ErrInvalid    = errdefs.ErrInvalidArgument
	ErrNotFound   = errdefs.ErrNotFound
	ErrNotRunning = errdefs.ErrFailedPrecondition
)

// Config configures a Manager.
type Config struct {
	DataDir        string        // sandboxes live in DataDir/sandboxes
	AgentBinary    string        // host path of the static shoal-agent
	DefaultBackend string        // "container"
	DefaultTimeout time.Duration // idle timeout when a create gives none
	MaxTimeout     time.Duration
	DefaultMemory  int64
	// MaxMemory bounds a sandbox's memory; 0 means the host's memory.
	MaxMemory       int64
	DefaultMilliCPU int64
	PidsLimit       int64
	// CommitMaxBytes bounds the bytes of files a commit copies from a
	// sandbox's writable layer; 0 means layer.DefaultCommitMaxBytes.
	CommitMaxBytes int64
	// DefaultDisk is the size of the writable layer of a sandbox whose
	// create gives none, on backends that bound it (sandbox.DiskLimiter);
	// 0 means DefaultDiskBytes, negative no limit. MaxDisk bounds what a
	// create may ask (0: DefaultMaxDiskBytes).
	DefaultDisk int64
	MaxDisk     int64
	// DefaultLog is the log budget of a sandbox whose create gives none
	// (the bytes of its commands' output logs kept on the host); 0 means
	// a quarter of its disk (at least MinLogBytes), or DefaultLogBytes for
	// a sandbox without a disk limit. MaxLog bounds what a create may ask
	// (0: DefaultMaxLogBytes). Log budgets count against DiskBudget with
	// the disks.
	DefaultLog int64
	MaxLog     int64
	// DiskBudget bounds the sum of the disk sizes of the node's sandboxes
	// (admission: a create beyond it is refused as resource_exhausted).
	// 0: no bound.
	DiskBudget int64
	// Metrics counts creates and deletes (nil: not counted).
	Metrics *metrics.Metrics
	// Capacity: how far the node oversubscribes memory and CPU, and the
	// floor of the host's available memory (admission.go); zero: no bound.
	Capacity Capacity
	// Quotas gives each tenant's quota, enforced at admission
	// (admission.go); nil: none.
	Quotas Quotas
	// AutoPause is the idle time after which a sandbox is paused when its
	// create does not say; 0 = never (the default).
	AutoPause time.Duration
	// PausedTimeout: a sandbox paused this long is deleted (default 24 h).
	PausedTimeout time.Duration
	// Pressure: pausing idle sandboxes, longest idle first, when the
	// host's available memory runs low (pressure.go); zero: off.
	Pressure Pressure
	// IDPrefix: the first characters of every sandbox ID this node makes,
	// naming the node in a cluster (cluster.go); "": none.
	IDPrefix string
	// DeleteBacklog: how many deleted sandboxes may wait, frozen, for
	// their teardown after the delete was answered (reap.go); 0 means
	// DefaultDeleteBacklog, negative: every delete tears down first.
	DeleteBacklog int
}

// Disk sizes.
const (
	MinDiskBytes        = 16 << 20
	DefaultDiskBytes    = 1 << 30
	DefaultMaxDiskBytes = 1 << 40
)

// Log budgets.
const (
	MinLogBytes        = 1 << 20
	DefaultLogBytes    = 256 << 20
	DefaultMaxLogBytes = 64 << 30
)

// Validate fills defaults and checks the configuration.
func (c *Config) Validate() error {
	if c.DataDir == "" {
		return errors.New("node config: data dir is required")
	}
	// The agent socket lives at DataDir/sandboxes/<id>/agent.sock and unix
	// socket paths are limited to 107 bytes.
	if n := len(filepath.Join(c.DataDir, "sandboxes", newID(), "agent.sock")); n > 107 {
		return fmt.Errorf("node config: data dir %q is too long for unix socket paths (%d > 107 bytes): choose a shorter one", c.DataDir, n)
	}
	if c.AgentBinary == "" {
		return errors.New("node config: agent binary path is required")
	}
	if err := validIDPrefix(c.IDPrefix); err != nil { // cluster.go
		return err
	}
	if _, err := os.Stat(c.AgentBinary); err != nil {
		return fmt.Errorf("node config: agent binary: %w", err)
	}
	if c.DefaultBackend == "" {
		c.DefaultBackend = "container"
	}
	if c.DefaultTimeout == 0 {
		c.DefaultTimeout = 30 * time.Minute
	}
	if c.MaxTimeout == 0 {
		c.MaxTimeout = 24 * time.Hour
	}
	if c.DefaultMemory == 0 {
		c.DefaultMemory = 512 << 20
	}
	if c.MaxMemory == 0 {
		var si unix.Sysinfo_t
		if err := unix.Sysinfo(&si); err == nil {
			c.MaxMemory = int64(si.Totalram) * int64(si.Unit)
		}
		if c.MaxMemory <= 0 {
			c.MaxMemory = 1 << 40
		}
	}
	if c.MaxMemory < 32<<20 || c.DefaultMemory > c.MaxMemory {
		return fmt.Errorf("node config: max memory %d must be at least 32 MiB and the default memory %d", c.MaxMemory, c.DefaultMemory)
	}
	if c.MaxTimeout < time.Second || c.DefaultTimeout > c.MaxTimeout {
		return fmt.Errorf("node config: max timeout %s must be at least 1s and the default timeout %s", c.MaxTimeout, c.DefaultTimeout)
	}
	if c.DefaultMilliCPU == 0 {
		c.DefaultMilliCPU = 1000
	}
	if c.PidsLimit == 0 {
		c.PidsLimit = 1024
	}
	if c.DefaultDisk == 0 {
		c.DefaultDisk = DefaultDiskBytes
	}
	if c.MaxDisk == 0 {
		c.MaxDisk = DefaultMaxDiskBytes
	}
	if c.MaxDisk < MinDiskBytes {
		return fmt.Errorf("node config: max disk %d bytes is below the minimum of %d", c.MaxDisk, MinDiskBytes)
	}
	if c.DefaultDisk > 0 && (c.DefaultDisk < MinDiskBytes || c.DefaultDisk > c.MaxDisk) {
		return fmt.Errorf("node config: default disk %d bytes is not between %d and the max disk %d", c.DefaultDisk, MinDiskBytes, c.MaxDisk)
	}
	if c.MaxLog == 0 {
		c.MaxLog = DefaultMaxLogBytes
	}
	if c.MaxLog < MinLogBytes || c.DefaultLog < 0 || (c.DefaultLog > 0 && (c.DefaultLog < MinLogBytes || c.DefaultLog > c.MaxLog)) {
		return fmt.Errorf("node config: default log budget %d bytes and max %d: want both at least %d, the default at most the max (0: a quarter of the disk)", c.DefaultLog, c.MaxLog, MinLogBytes)
	}
	if c.DiskBudget < 0 {
		return errors.New("node config: negative disk or pids budget")
	}
	if c.PausedTimeout == 0 {
		c.PausedTimeout = 24 * time.Hour
	}
	if c.AutoPause < 0 || c.AutoPause > c.MaxTimeout {
		return fmt.Errorf("node config: auto-pause %s: want 0 (off) up to %s", c.AutoPause, c.MaxTimeout)
	}
	if err := c.Pressure.validate(); err != nil {
		return err
	}
	if c.CommitMaxBytes < 0 {
		return fmt.Errorf("node config: commit max bytes %d is negative", c.CommitMaxBytes)
	}
	if c.DeleteBacklog == 0 {
		c.DeleteBacklog = DefaultDeleteBacklog
	}
	return nil
}

// Manager owns the sandboxes of one node. It is safe for concurrent use.
type Manager struct {
	cfg      Config
	log      *slog.Logger
	db       *bbolt.DB
	layers   *layer.Store
	backends map[string]sandbox.Backend

	mu        sync.Mutex        // guards sandboxes and every entry's fields
	sandboxes map[string]*entry // by ID

	keyLocks map[string]chan struct{} // guarded by mu: creates in flight per client key
	// admitting holds what the creates in flight were admitted with
	// (admission.go), until their entry is in sandboxes. Guarded by mu.
	admitting map[string]admission
	onDelete  []func(id string) // set before serving; called after each delete
	onReset   []func(id string) // set before serving; called as each reset begins
	onEnd     []func(id string) // set before serving; called before a file-system-only pause ends the processes
	// buckets are the tenants' create-rate token buckets (admission.go).
	// Guarded by mu.
	buckets map[string]*tenant.Bucket

	autoPausing atomic.Bool // an autoPause round is running
	reclaiming  atomic.Bool // a memory-pressure round is running (pressure.go)
	// lastStallRound: when the last round for memory stalls (PSI) began, in
	// Unix nanoseconds (pressure.go).
	lastStallRound atomic.Int64

	// lastCreate: when the last create began, in Unix nanoseconds; the
	// reaper yields to creates (reap.go).
	lastCreate atomic.Int64
	reap       reaper // reap.go
}

// entry is the in-memory state of one sandbox. Its fields are guarded by
// Manager.mu; rec.ID never changes after creation, rec.Handle only on a
// resume (a backend may give a new one).
type entry struct {
	rec      Record
	agent    *agent.Client
	acquired bool          // layer mounts are held for this sandbox
	dirty    bool          // rec.Expires changed since it was last persisted
	running  int           // commands in flight (the sandbox is not idle)
	commit   chan struct{} // held (one slot) by the commit in flight; made by the first
	deleted  chan struct{} // closed when a delete finished; nil until one starts
	// recovered: Recover found it running; Run checks that its agent
	// answers (checkAgent).
	recovered bool
	// unresponsive: its agent has not answered since the node restarted.
	// The sandbox shows as in error, but is persisted as running and
	// returns to running as soon as its agent answers (checkAgent).
	unresponsive bool
	// trans is closed when the pause or resume in flight ends; nil when
	// none is (see pause.go).
	trans chan struct{}
	// lastActive: the last request or command activity (the auto-pause
	// clock).
	lastActive time.Time
}

// persisted is what the store keeps of e: an unresponsive sandbox is still
// running as far as the next start of the node is concerned.
func (e *entry) persisted() Record {
	rec := e.rec
	if e.unresponsive {
		rec.State, rec.Error = StateRunning, ""
	}
	return rec
}

// New opens the manager over an open store. Call Recover before serving.
func New(cfg Config, db *bbolt.DB, layers *layer.Store, backends []sandbox.Backend, log *slog.Logger) (*Manager, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := db.Update(func(tx *bbolt.Tx) error {
		_, err := tx.CreateBucketIfNotExists(bucketSandboxes)
		return err
	}); err != nil {
		return nil, fmt.Errorf("open sandbox store: %w", err)
	}
	if err := os.MkdirAll(filepath.Join(cfg.DataDir, "sandboxes"), 0o700); err != nil {
		return nil, err
	}
	m := &Manager{
		cfg:       cfg,
		log:       log,
		db:        db,
		layers:    layers,
		backends:  map[string]sandbox.Backend{},
		sandboxes: map[string]*entry{},
	}
	if err := db.Update(func(tx *bbolt.Tx) error {
		_, err := tx.CreateBucketIfNotExists(bucketClientKeys)
		return err
	}); err != nil {
		return nil, fmt.Errorf("open sandbox store: %w", err)
	}
	m.keyLocks = map[string]chan struct{}{}
	m.admitting = map[string]admission{}
	m.buckets = map[string]*tenant.Bucket{}
	m.reap.wake = make(chan struct{}, 1)
	for _, b := range backends {
		m.backends[b.Name()] = b
	}
	if _, ok := m.backends[cfg.DefaultBackend]; !ok {
		return nil, fmt.Errorf("node config: default backend %q is not available", cfg.DefaultBackend)
	}
	return m, nil
}

// Layers is the node's layer store.
func (m *Manager) Layers() *layer.Store { return m.layers }

// CPU classes of a sandbox (CreateRequest.QoS).
const (
	QoSLatencySensitive = "ls"
	QoSBestEffort       = "be"
)

// CreateRequest asks for one sandbox.
type CreateRequest struct {
	Backend string
	// QoS: "ls" (latency-sensitive, the default; "" too) or "be" (best
	// effort: sandbox.Resources.BestEffort).
	QoS string
	// Template names an environment (layer.Env) to take the layers from,
	// resolved now; see applyTemplate in layers.go. Exclusive with Base.
	Template   string
	Base       string
	Workspaces []string
	Toolkits   []string
	Memory     int64
	MilliCPU   int64
	// Disk is the size of the writable layer; 0 for the node's default.
	Disk int64
	// LogBudget bounds the bytes of its commands' output logs the node
	// keeps (oldest output pruned first); 0 for the node's default.
	LogBudget int64
	Timeout   time.Duration
	Metadata  map[string]string
	Env       map[string]string
	// ClientKey makes the create idempotent: repeating a create with the
	// same key returns the sandbox made for it (while it exists).
	ClientKey string
	// Network: nil is loopback only; see internal/netpolicy.
	Network *netpolicy.Request
	// Tenant will own the sandbox ("": the admin); its quota applies
	// (admission.go) and its client keys are its own.
	Tenant string
	// Owner is whose names the template and the layer references are
	// resolved as (layer.Owner): a tenant's own, then shared ones. The
	// zero value sees shared names only.
	Owner layer.Owner
	// AutoPause: pause after this long idle; nil = the node's default, 0 =
	// never.
	AutoPause *time.Duration
	// image: the config of the image the stack comes from (images.go),
	// set by the create from its base or its template; nil otherwise.
	image *layer.ImageConfig
}

// CheckBackend says whether this node offers a backend (an environment's
// default backend is checked with it).
func (m *Manager) CheckBackend(name string) error {
	if _, ok := m.backends[name]; ok {
		return nil
	}
	names := make([]string, 0, len(m.backends))
	for n := range m.backends {
		names = append(names, n)
	}
	sort.Strings(names)
	if len(name) > 64 {
		name = name[:64] + "..."
	}
	return errdefs.New(ErrInvalid, "backend %q is not available on this node (available: %v)", name, names)
}

func (m *Manager) validate(req *CreateRequest) error {
	if req.Backend == "" {
		req.Backend = m.cfg.DefaultBackend
	}
	switch req.QoS {
	case "", QoSLatencySensitive, QoSBestEffort:
	default:
		return errdefs.New(ErrInvalid, "qos %q: want %q (latency-sensitive, the default) or %q (best effort)", req.QoS, QoSLatencySensitive, QoSBestEffort)
	}
	if err := m.CheckBackend(req.Backend); err != nil {
		return err
	}
	if req.Base == "" {
		return errdefs.New(ErrInvalid, "a base layer is required (--base NAME:VERSION, or --template NAME)")
	}
	if n := 1 + len(req.Workspaces) + len(req.Toolkits); n > limits.Layers {
		return errdefs.New(ErrInvalid, "%d layers, more than the maximum of %d in one sandbox", n, limits.Layers)
	}
	for _, r := range append([]string{req.Base}, append(req.Workspaces, req.Toolkits...)...) {
		if err := limits.String("layer ref", r, limits.RefBytes); err != nil {
			return err
		}
	}
	if err := limits.String("client key", req.ClientKey, limits.IDBytes); err != nil {
		return err
	}
	if req.Memory == 0 {
		req.Memory = m.cfg.DefaultMemory
	}
	if req.Memory < 32<<20 || req.Memory > m.cfg.MaxMemory {
		return errdefs.New(ErrInvalid, "memory must be between 32 MiB and %s (this node's maximum), got %d bytes", limits.Size(m.cfg.MaxMemory), req.Memory)
	}
	if req.MilliCPU == 0 {
		req.MilliCPU = m.cfg.DefaultMilliCPU
	}
	if max := int64(runtime.NumCPU()) * 1000; req.MilliCPU < 10 || req.MilliCPU > max {
		return errdefs.New(ErrInvalid, "cpus must be between 0.01 and %d (this node's cores), got %.3f", max/1000, float64(req.MilliCPU)/1000)
	}
	if err := m.validateLog(req); err != nil {
		return err
	}
	if err := m.validateDisk(req); err != nil {
		return err
	}
	if req.Timeout == 0 {
		req.Timeout = m.cfg.DefaultTimeout
	}
	if err := m.CheckTimeout(req.Timeout); err != nil {
		return err
	}
	if req.AutoPause == nil {
		d := m.cfg.AutoPause
		req.AutoPause = &d
	}
	if d := *req.AutoPause; d != 0 && (d < time.Second || d > m.cfg.MaxTimeout) {
		return errdefs.New(ErrInvalid, "auto-pause must be 0 (never) or between 1s and %s, got %s", m.cfg.MaxTimeout, d)
	}
	if err := limits.Map("metadata", req.Metadata, false); err != nil {
		return err
	}
	if _, err := netpolicy.Parse(req.Network); err != nil {
		return errdefs.New(ErrInvalid, "%s", err)
	}
	if !req.Network.Egress() {
		req.Network = nil
	}
	return limits.Map("env", req.Env, true)
}

// resolve turns the requested refs into layers ordered top to bottom
// (toolkits, workspaces, base) and checks each one's kind.
func (m *Manager) resolve(req *CreateRequest) ([]layer.Layer, []LayerRef, error) {
	var out []layer.Layer
	var refs []LayerRef
	view := m.layers.As(req.Owner)
	add := func(ref string, want layer.Kind) error {
		l, err := view.Resolve(ref)
		if err != nil {
			return err
		}
		if l.Kind != want {
			return errdefs.New(ErrInvalid, "layer %s is a %s layer, not a %s layer", ref, l.Kind, want)
		}
		out = append(out, l)
		refs = append(refs, LayerRef{Kind: string(l.Kind), Ref: l.Ref(), Digest: l.Digest})
		return nil
	}
	for _, r := range req.Toolkits {
		if err := add(r, layer.KindToolkit); err != nil {
			return nil, nil, err
		}
	}
	for _, r := range req.Workspaces {
		if err := add(r, layer.KindWorkspace); err != nil {
			return nil, nil, err
		}
	}
	if err := add(req.Base, layer.KindBase); err != nil {
		return nil, nil, err
	}
	return out, refs, nil
}

// Create makes a sandbox and returns once its guest agent accepts
// connections. A failed create leaves nothing behind.
func (m *Manager) Create(ctx context.Context, req CreateRequest) (rec Record, err error) {
	if err := m.applyTemplate(&req); err != nil {
		return Record{}, err
	}
	if err := m.applyImage(ctx, &req); err != nil {
		return Record{}, err
	}
	if err := applyImageConfig(&req); err != nil {
		return Record{}, err
	}
	if err := m.validate(&req); err != nil {
		return Record{}, err
	}
	if req.ClientKey != "" {
		ck := clientKeyOf(req.Tenant, req.ClientKey)
		unlock, err := m.lockKey(ctx, ck)
		if err != nil {
			return Record{}, err
		}
		defer unlock()
		var id string
		m.db.View(func(tx *bbolt.Tx) error {
			id = string(tx.Bucket(bucketClientKeys).Get([]byte(ck)))
			return nil
		})
		if id != "" {
			if rec, err := m.Get(id); err == nil && rec.Tenant == req.Tenant {
				return rec, nil
			}
		}
	}
	start := time.Now()
	m.lastCreate.Store(start.UnixNano())
	ph := sandbox.StartPhases()
	defer func() {
		m.cfg.Metrics.Create(req.Backend, rec.Handle.Data["pooled"] == "true", time.Since(start), errdefs.Code(err))
	}()
	layers, refs, err := m.resolve(&req)
	if err != nil {
		return Record{}, err
	}
	ph.Mark("resolve")
	be := m.backends[req.Backend]
	id := m.newSandboxID() // cluster.go
	dir := filepath.Join(m.cfg.DataDir, "sandboxes", id)
	now := time.Now().UTC()
	rec = Record{
		ID:      id,
		Backend: req.Backend,
		State:   StateCreating,
		Layers:  refs,
		Resources: sandbox.Resources{
			MemoryBytes: req.Memory,
			MilliCPU:    req.MilliCPU,
			Pids:        m.cfg.PidsLimit,
			DiskBytes:   max(req.Disk, 0),
			BestEffort:  req.QoS == QoSBestEffort,
			LogBytes:    req.LogBudget,
		},
		Timeout:   req.Timeout,
		Created:   now,
		Expires:   now.Add(req.Timeout),
		Metadata:  req.Metadata,
		Env:       req.Env,
		Network:   req.Network,
		Tenant:    req.Tenant,
		AutoPause: *req.AutoPause,
		Image:     req.image,
		// A provisional handle: enough for the backend to clean up after a
		// crash in the middle of this create.
		Handle: sandbox.Handle{ID: id, Backend: req.Backend, Data: map[string]string{"dir": dir}},
	}
	var undo []func()
	defer func() {
		if err != nil {
			m.log.Warn("create failed", "sandbox_id", id, "tenant", req.Tenant, "backend", req.Backend, "layer", req.Base, "took", time.Since(start), "err", err)
			for i := len(undo) - 1; i >= 0; i-- {
				undo[i]()
			}
		}
	}()

	if err := m.admit(id, req.Tenant, rec.Resources); err != nil {
		return Record{}, err
	}
	undo = append(undo, func() { m.admitted(id) })
	ph.Mark("admit")

	// Persist first, so that a crash from here on is cleaned up by Recover.
	if err := boltgroup.Update(m.db, func(tx *bbolt.Tx) error { return putRecord(tx, &rec) }); err != nil {
		return Record{}, fmt.Errorf("persist sandbox %s: %w", id, err)
	}
	undo = append(undo, func() { m.forget(id) })
	if err := os.Mkdir(dir, 0o700); err != nil {
		return Record{}, fmt.Errorf("create sandbox dir: %w", err)
	}
	undo = append(undo, func() { os.RemoveAll(dir) })
	ph.Mark("persist")

	spec := sandbox.Spec{
		ID:          id,
		Dir:         dir,
		Resources:   rec.Resources,
		AgentBinary: m.cfg.AgentBinary,
		Env:         envList(req.Env),
		Network:     req.Network,
	}
	hostMounts := be.Capabilities().HostLayerMounts
	for _, l := range layers {
		sl := sandbox.Layer{Digest: l.Digest, Kind: string(l.Kind), ImagePath: m.layers.ImagePath(l.Digest)}
		if hostMounts {
			p, err := m.layers.Acquire(l.Digest)
			if err != nil {
				return Record{}, fmt.Errorf("mount layer %s: %w", l.Ref(), err)
			}
			digest := l.Digest
			undo = append(undo, func() { m.layers.Release(digest) })
			sl.MountPath = p
		}
		spec.Layers = append(spec.Layers, sl)
	}

	ph.Mark("layers")
	h, err := be.Create(ctx, spec)
	if err != nil {
		return Record{}, fmt.Errorf("create %s sandbox: %w", req.Backend, err)
	}
	ph.Mark("backend")
	undo = append(undo, func() {
		dctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		be.Delete(dctx, h)
	})
	if h.Data == nil {
		h.Data = map[string]string{}
	}
	h.Data["dir"] = dir
	rec.Handle = h
	rec.State = StateRunning
	rec.ClientKey = req.ClientKey
	if err := boltgroup.Update(m.db, func(tx *bbolt.Tx) error {
		if rec.ClientKey != "" {
			if err := tx.Bucket(bucketClientKeys).Put([]byte(clientKeyOf(rec.Tenant, rec.ClientKey)), []byte(id)); err != nil {
				return err
			}
		}
		return putRecord(tx, &rec)
	}); err != nil {
		return Record{}, fmt.Errorf("persist sandbox %s: %w", id, err)
	}
	ph.Mark("commit")
	m.mu.Lock()
	m.sandboxes[id] = &entry{rec: rec, agent: m.agentClient(be, h), acquired: hostMounts, lastActive: time.Now()}
	delete(m.admitting, id) // counted by its entry from now on
	m.mu.Unlock()
	m.log.Info("sandbox created", "sandbox_id", id, "tenant", req.Tenant, "backend", req.Backend, "layer", req.Base,
		"took", time.Since(start), "pooled", h.Data["pooled"] == "true", "phases", ph.String())
	return rec, nil
}

func envList(env map[string]string) []string {
	out := make([]string, 0, len(env))
	for k, v := range env {
		out = append(out, k+"="+v)
	}
	sort.Strings(out)
	return out
}

// lockKey serializes creates that carry the same client key.
func (m *Manager) lockKey(ctx context.Context, key string) (unlock func(), err error) {
	for {
		m.mu.Lock()
		busy, ok := m.keyLocks[key]
		if !ok {
			done := make(chan struct{})
			m.keyLocks[key] = done
			m.mu.Unlock()
			return func() {
				m.mu.Lock()
				delete(m.keyLocks, key)
				m.mu.Unlock()
				close(done)
			}, nil
		}
		m.mu.Unlock()
		select {
		case <-busy:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// forget removes a sandbox's record (and its client key) from the store.
func (m *Manager) forget(id string) {
	if err := boltgroup.Update(m.db, func(tx *bbolt.Tx) error {
		b := tx.Bucket(bucketSandboxes)
		var rec Record
		if v := b.Get([]byte(id)); v != nil && json.Unmarshal(v, &rec) == nil && rec.ClientKey != "" {
			keys := tx.Bucket(bucketClientKeys)
			if ck := []byte(clientKeyOf(rec.Tenant, rec.ClientKey)); string(keys.Get(ck)) == id {
				keys.Delete(ck)
			}
		}
		return b.Delete([]byte(id))
	}); err != nil {
		m.log.Error("forget sandbox", "sandbox_id", id, "err", err)
	}
}

func (m *Manager) lookup(id string) (*entry, error) {
	e, ok := m.sandboxes[id]
	if !ok {
		return nil, NotFound(id)
	}
	return e, nil
}

// NotFound is the error for a sandbox ID that names no sandbox here. The API
// faces answer the same for a sandbox another tenant owns (no existence
// oracle).
func NotFound(id string) error {
	if !validID(id) {
		return errdefs.New(ErrNotFound, "%q is not a sandbox ID", id)
	}
	return errdefs.New(ErrNotFound, "no sandbox %s on this node", id)
}

// Get returns a sandbox's record.
func (m *Manager) Get(id string) (Record, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, err := m.lookup(id)
	if err != nil {
		return Record{}, err
	}
	return e.rec, nil
}

// List returns every sandbox, oldest first.
func (m *Manager) List() []Record {
	m.mu.Lock()
	out := make([]Record, 0, len(m.sandboxes))
	for _, e := range m.sandboxes {
		out = append(out, e.rec)
	}
	m.mu.Unlock()
	sort.Slice(out, func(i, j int) bool {
		if !out[i].Created.Equal(out[j].Created) {
			return out[i].Created.Before(out[j].Created)
		}
		return out[i].ID < out[j].ID
	})
	return out
}

// SetTimeout sets a sandbox's idle timeout and restarts its clock.
// CheckTimeout checks a sandbox's idle timeout against this node's bounds
// (1 s to --max-timeout); Create and SetTimeout call it, and so does a face
// that keeps a timeout to apply later.
func (m *Manager) CheckTimeout(d time.Duration) error {
	return limits.Duration("timeout", d, time.Second, m.cfg.MaxTimeout)
}

func (m *Manager) SetTimeout(id string, d time.Duration) (Record, error) {
	if err := m.CheckTimeout(d); err != nil {
		return Record{}, err
	}
	m.mu.Lock()
	e, err := m.lookup(id)
	if err != nil {
		m.mu.Unlock()
		return Record{}, err
	}
	e.rec.Timeout = d
	e.rec.Expires = time.Now().UTC().Add(d)
	e.dirty = false
	rec, stored := e.rec, e.persisted()
	m.mu.Unlock()
	err = boltgroup.Update(m.db, func(tx *bbolt.Tx) error { return putRecord(tx, &stored) })
	return rec, err
}

// Agent returns the guest agent client of a running sandbox and counts the
// call as activity (it pushes the idle timeout back). A paused sandbox is
// resumed first (concurrent callers share one resume), and a sandbox being
// paused or resumed is waited for: this is the one place where requests
// that need the agent (exec, files, ports, watch, shells) get it.
func (m *Manager) Agent(id string) (*agent.Client, error) {
	for {
		m.mu.Lock()
		e, err := m.lookup(id)
		if err != nil {
			m.mu.Unlock()
			return nil, err
		}
		paused := e.rec.State == StatePaused && e.deleted == nil
		if e.trans == nil && !paused {
			defer m.mu.Unlock()
			if e.rec.State != StateRunning {
				return nil, notRunning(e)
			}
			m.touchLocked(e)
			return e.agent, nil
		}
		m.mu.Unlock()
		// Resume waits for a pause in flight too.
		if _, _, err := m.Resume(context.Background(), id); err != nil {
			return nil, err
		}
	}
}

func (m *Manager) touchLocked(e *entry) {
	e.lastActive = time.Now()
	if e.rec.State == StatePaused {
		return // its idle timeout is suspended (pause.go)
	}
	e.rec.Expires = e.lastActive.UTC().Add(e.rec.Timeout)
	e.dirty = true
}

// Delete destroys a sandbox: its processes, its mounts, its writable layer
// and its record. Deleting a sandbox that is being deleted waits for that.
func (m *Manager) Delete(ctx context.Context, id string) error {
	return m.delete(ctx, id, "request")
}

// delete deletes a sandbox; reason (request, timeout) is what metrics say.
func (m *Manager) delete(ctx context.Context, id, reason string) error {
	m.mu.Lock()
	e, err := m.lookup(id)
	if err != nil {
		m.mu.Unlock()
		return err
	}
	if e.deleted != nil {
		done := e.deleted
		m.mu.Unlock()
		select {
		case <-done:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	e.deleted = make(chan struct{})
	prev := e.rec.State
	e.rec.State = StateDeleting
	rec := e.rec
	m.mu.Unlock()

	// Recorded as deleting, then frozen and left to the reaper, or torn
	// down here (reap.go).
	err = m.markDeleting(&rec)
	if err == nil && !m.park(ctx, &rec, e.acquired) {
		err = m.teardown(ctx, &rec, e.acquired)
	}
	m.mu.Lock()
	if err != nil {
		e.rec.State = prev
		close(e.deleted)
		e.deleted = nil
	} else {
		delete(m.sandboxes, id)
		close(e.deleted)
	}
	m.mu.Unlock()
	if err == nil {
		for _, fn := range m.onDelete {
			fn(id)
		}
		m.log.Info("sandbox deleted", "sandbox_id", id, "reason", reason)
		m.cfg.Metrics.Delete(rec.Backend, reason)
	}
	return err
}

// StateCounts counts the sandboxes by backend and state.
func (m *Manager) StateCounts() map[[2]string]int {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := map[[2]string]int{}
	for _, e := range m.sandboxes {
		out[[2]string{e.rec.Backend, string(e.rec.State)}]++
	}
	for _, b := range m.reapBacklog() {
		out[[2]string{b, string(StateDeleting)}]++
	}
	return out
}

// Deleting reports whether a sandbox is being deleted, or is gone.
func (m *Manager) Deleting(id string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.sandboxes[id]
	return !ok || e.deleted != nil
}

// OnDelete registers fn to be called after each sandbox is deleted. Call it
// before serving.
func (m *Manager) OnDelete(fn func(id string)) { m.onDelete = append(m.onDelete, fn) }

// SandboxDir returns a sandbox's private directory on the host.
// LogBudget is the sandbox's log budget (session.LogBudgeter); 0 if it is
// not known here.
func (m *Manager) LogBudget(id string) int64 {
	rec, err := m.Get(id)
	if err != nil {
		return 0
	}
	if rec.Resources.LogBytes > 0 {
		return rec.Resources.LogBytes
	}
	return m.defaultLog(rec.Resources.DiskBytes)
}

func (m *Manager) SandboxDir(id string) (string, error) {
	if _, err := m.Get(id); err != nil {
		return "", err
	}
	return filepath.Join(m.cfg.DataDir, "sandboxes", id), nil
}

// Hold marks a sandbox busy (a command runs in it): it is not idle, so its
// timeout does not expire, until release is called.
func (m *Manager) Hold(id string) (release func(), err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, err := m.lookup(id)
	if err != nil {
		return nil, err
	}
	e.running++
	var once sync.Once
	return func() {
		once.Do(func() {
			m.mu.Lock()
			e.running--
			m.touchLocked(e)
			m.mu.Unlock()
		})
	}, nil
}

// destroy tears a sandbox down; it is also used by Recover for sandboxes
// left half-created or half-deleted by a crash.
func (m *Manager) destroy(ctx context.Context, rec *Record, release bool) error {
	if err := m.markDeleting(rec); err != nil {
		return err
	}
	return m.teardown(ctx, rec, release)
}

// markDeleting records the sandbox as deleting: from then on a crash ends
// in its teardown (Recover), whatever the delete had done.
func (m *Manager) markDeleting(rec *Record) error {
	rec.State = StateDeleting
	if err := boltgroup.Update(m.db, func(tx *bbolt.Tx) error { return putRecord(tx, rec) }); err != nil {
		return fmt.Errorf("persist sandbox %s: %w", rec.ID, err)
	}
	return nil
}

// teardown removes what a sandbox recorded as deleting holds: its
// backend's sandbox, its layer mounts (release), its dir and its record.
func (m *Manager) teardown(ctx context.Context, rec *Record, release bool) error {
	if be, ok := m.backends[rec.Backend]; ok {
		if err := be.Delete(ctx, rec.Handle); err != nil {
			return fmt.Errorf("delete sandbox %s: %w", rec.ID, err)
		}
	}
	if release {
		for _, l := range rec.Layers {
			if err := m.layers.Release(l.Digest); err != nil {
				m.log.Warn("release layer", "sandbox_id", rec.ID, "layer", l.Digest, "err", err)
			}
		}
	}
	if err := os.RemoveAll(filepath.Join(m.cfg.DataDir, "sandboxes", rec.ID)); err != nil {
		return fmt.Errorf("remove sandbox %s dir: %w", rec.ID, err)
	}
	m.forget(rec.ID)
	return nil
}

// Timeouts of what Recover and Run do for each sandbox after a restart: a
// sandbox that does not answer must not keep the node from serving.
const (
	// recoverTimeout bounds the backend's Recover of one sandbox (it asks
	// the runtime, not the sandbox).
	recoverTimeout = 10 * time.Second
	// cleanupTimeout bounds the removal of a sandbox a crash left half
	// created or half deleted.
	cleanupTimeout = 30 * time.Second
	// agentCheckTimeout bounds one ping of a recovered sandbox's agent;
	// agentRecheckMax is the longest wait between two pings of one that
	// does not answer.
	agentCheckTimeout = 3 * time.Second
	agentRecheckMax   = 30 * time.Second
)

// Recover loads the persisted sandboxes after a (re)start: running ones are
// re-attached (their layer mounts adopted), half-created and half-deleted
// ones are cleaned up, and layer mounts nobody uses are swept. It talks to
// the backends, never to a sandbox: Run then checks, in the background,
// that the agents of the running ones answer (checkAgent).
func (m *Manager) Recover(ctx context.Context) error {
	recs, err := loadRecords(m.db)
	if err != nil {
		return err
	}
	for _, rec := range recs {
		log := m.log.With("sandbox_id", rec.ID)
		be, ok := m.backends[rec.Backend]
		switch {
		case !ok:
			rec.State, rec.Error = StateError, fmt.Sprintf("backend %q is not enabled on this node", rec.Backend)
		case rec.State == StateCreating || rec.State == StateDeleting:
			log.Info("cleaning up sandbox interrupted while " + string(rec.State))
			cctx, cancel := context.WithTimeout(ctx, cleanupTimeout)
			err := m.destroy(cctx, rec, false)
			cancel()
			if err != nil {
				log.Error("clean up sandbox", "err", err)
				rec.State, rec.Error = StateError, err.Error()
			} else {
				continue
			}
		case rec.State == StatePaused, rec.State == StateRunning:
			cctx, cancel := context.WithTimeout(ctx, recoverTimeout)
			st, err := be.Recover(cctx, rec.Handle)
			cancel()
			switch {
			case err != nil:
				rec.State, rec.Error = StateError, "recover: "+err.Error()
			case st == sandbox.StatusPaused:
				if rec.State == StateRunning {
					// Paused by a Pause this node did not live to record.
					log.Warn("sandbox found paused: recorded as paused")
					now := time.Now().UTC()
					rec.State, rec.Pause, rec.Expires = StatePaused, &PauseInfo{At: now}, now.Add(m.cfg.PausedTimeout)
					if err := boltgroup.Update(m.db, func(tx *bbolt.Tx) error { return putRecord(tx, rec) }); err != nil {
						log.Error("persist paused sandbox", "err", err)
					}
				}
			case st != sandbox.StatusRunning:
				rec.State, rec.Error = StateError, "its runtime is "+string(st)
			default:
				// A running sandbox is frozen only during a commit: a node
				// that died meanwhile left it so. A node that died during a
				// resume may have thawed a paused one: paused in the store
				// is paused (its memory stays where the pause put it).
				if f, ok := be.(sandbox.Freezer); ok {
					fix, what := f.Thaw, "thaw sandbox"
					if rec.State == StatePaused {
						fix, what = f.Freeze, "freeze paused sandbox"
					}
					if err := fix(ctx, rec.Handle); err != nil {
						log.Error(what, "err", err)
					}
				}
			}
		}
		e := &entry{rec: *rec, agent: m.agentClient(be, rec.Handle), recovered: rec.State == StateRunning, lastActive: time.Now()}
		if (rec.State == StateRunning || rec.State == StatePaused) && be.Capabilities().HostLayerMounts {
			for _, l := range rec.Layers {
				if _, err := m.layers.Acquire(l.Digest); err != nil {
					log.Error("re-acquire layer", "layer", l.Digest, "err", err)
				}
			}
			e.acquired = true
		}
		if rec.State == StateError {
			log.Warn("sandbox recovered in error state", "err", rec.Error)
			boltgroup.Update(m.db, func(tx *bbolt.Tx) error { return putRecord(tx, rec) })
		}
		m.mu.Lock()
		m.sandboxes[rec.ID] = e
		m.mu.Unlock()
	}
	m.log.Info("recovered sandboxes", "count", len(m.sandboxes))
	return m.layers.Sweep()
}

// checkRecovered starts checkAgent for every sandbox Recover found running.
func (m *Manager) checkRecovered(ctx context.Context) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for id, e := range m.sandboxes {
		if e.recovered {
			e.recovered = false
			go m.checkAgent(ctx, id)
		}
	}
}

// checkAgent pings the agent of a sandbox recovered after a restart, each
// ping bounded by agentCheckTimeout. One that does not answer (stopped,
// traced, wedged) is shown in error, "unresponsive", and pinged again, less
// and less often, until it answers (it is running again), it is found dead
// (probe), it is deleted, or ctx ends.
func (m *Manager) checkAgent(ctx context.Context, id string) {
	delay := time.Second
	for {
		m.mu.Lock()
		e, ok := m.sandboxes[id]
		if !ok || (e.deleted == nil && e.rec.State != StateRunning && !e.unresponsive) {
			m.mu.Unlock()
			return // gone, or in error for good (probe)
		}
		deleting, ag := e.deleted != nil, e.agent
		m.mu.Unlock()
		if !deleting && m.pingAgent(ctx, id, ag) {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
		delay = min(2*delay, agentRecheckMax)
	}
}

// pingAgent is one ping of checkAgent; it reports whether the agent
// answered (or checking is over).
func (m *Manager) pingAgent(ctx context.Context, id string, ag *agent.Client) (done bool) {
	pctx, cancel := context.WithTimeout(ctx, agentCheckTimeout)
	_, err := ag.Ping(pctx)
	cancel()
	if ctx.Err() != nil {
		return true
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.sandboxes[id]
	switch {
	case !ok:
		return true
	case e.deleted != nil:
		return false // see how the delete ends
	case err == nil:
		if e.unresponsive {
			e.unresponsive = false
			e.rec.State, e.rec.Error = StateRunning, ""
			m.log.Info("sandbox agent answers again", "sandbox_id", id)
		}
		return true
	case e.unresponsive:
		return false
	case e.rec.State == StateRunning:
		e.unresponsive = true
		e.rec.State = StateError
		e.rec.Error = "its guest agent has not answered since the node restarted (" + err.Error() + "); the node keeps trying"
		m.log.Warn("sandbox agent does not answer after the restart; retrying in the background", "sandbox_id", id, "err", err)
		return false
	}
	return true // in error for good (probe)
}

// Run checks, in the background, that the agents of the sandboxes Recover
// found running answer (checkAgent); then, until ctx is done, it deletes
// sandboxes whose idle timeout expired, persists timeout changes and
// probes that sandboxes still live.
func (m *Manager) Run(ctx context.Context) {
	m.checkRecovered(ctx)
	defer m.startReaper(ctx)() // reap.go
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	lastFlush := time.Now()
	for {
		select {
		case <-ctx.Done():
			m.flush()
			return
		case now := <-tick.C:
			expired, idle := m.expired(now)
			if len(idle) > 0 {
				go m.autoPause(idle)
			}
			m.checkPressure()
			for _, id := range expired {
				go func(id string) {
					dctx, cancel := context.WithTimeout(context.Background(), time.Minute)
					defer cancel()
					m.log.Info("sandbox idle timeout", "sandbox_id", id)
					if err := m.delete(dctx, id, "timeout"); err != nil && !errors.Is(err, ErrNotFound) {
						m.log.Error("delete expired sandbox", "sandbox_id", id, "err", err)
					}
				}(id)
			}
			if now.Sub(lastFlush) >= 5*time.Second {
				m.flush()
				m.probe()
				lastFlush = now
			}
		}
	}
}

// expired returns the sandboxes whose idle timeout expired (to delete), and
// those idle for their AutoPause (to pause). A paused sandbox's timeout is
// the PausedTimeout its pause set.
func (m *Manager) expired(now time.Time) (expired, idle []string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for id, e := range m.sandboxes {
		if e.deleted != nil || e.trans != nil || e.rec.State == StateCreating {
			continue
		}
		if e.running > 0 && e.rec.State != StatePaused {
			m.touchLocked(e)
			continue
		}
		if now.After(e.rec.Expires) {
			expired = append(expired, id)
			continue
		}
		if e.rec.State == StateRunning && !e.unresponsive && e.rec.AutoPause > 0 && now.Sub(e.lastActive) >= e.rec.AutoPause {
			if _, ok := m.backends[e.rec.Backend].(sandbox.Pauser); ok {
				idle = append(idle, id)
			}
		}
	}
	return expired, idle
}

// probe marks running sandboxes whose init (the guest agent) is gone as in
// error, for backends that can tell cheaply (sandbox.Prober): their
// commands cannot run any more, and callers get a clear error instead of a
// refused connection. Deleting them still cleans everything up.
func (m *Manager) probe() {
	type cand struct {
		id string
		h  sandbox.Handle
		p  sandbox.Prober
	}
	var cands []cand
	m.mu.Lock()
	for id, e := range m.sandboxes {
		if (e.rec.State != StateRunning && !e.unresponsive) || e.deleted != nil {
			continue
		}
		if p, ok := m.backends[e.rec.Backend].(sandbox.Prober); ok {
			cands = append(cands, cand{id, e.rec.Handle, p})
		}
	}
	m.mu.Unlock()
	for _, c := range cands {
		alive, err := c.p.Alive(c.h)
		if err != nil || alive {
			continue
		}
		m.mu.Lock()
		e, ok := m.sandboxes[c.id]
		if !ok || (e.rec.State != StateRunning && !e.unresponsive) || e.deleted != nil {
			m.mu.Unlock()
			continue
		}
		e.unresponsive = false
		e.rec.State = StateError
		e.rec.Error = "its guest agent (the sandbox's init) exited; delete the sandbox"
		rec := e.rec
		m.mu.Unlock()
		m.log.Warn("sandbox init exited", "sandbox_id", c.id)
		if err := boltgroup.Update(m.db, func(tx *bbolt.Tx) error { return putRecord(tx, &rec) }); err != nil {
			m.log.Error("persist sandbox state", "sandbox_id", c.id, "err", err)
		}
	}
}

// flush persists expiry times pushed back by activity.
func (m *Manager) flush() {
	m.mu.Lock()
	var recs []Record
	for _, e := range m.sandboxes {
		if e.dirty && e.deleted == nil {
			recs = append(recs, e.persisted())
			e.dirty = false
		}
	}
	m.mu.Unlock()
	if len(recs) == 0 {
		return
	}
	err := m.db.Update(func(tx *bbolt.Tx) error {
		for i := range recs {
			// Skip sandboxes deleted since the snapshot above.
			if tx.Bucket(bucketSandboxes).Get([]byte(recs[i].ID)) == nil {
				continue
			}
			if err := putRecord(tx, &recs[i]); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		m.log.Error("persist sandbox timeouts", "err", err)
	}
}

// Package sandbox defines the contract between the node manager and the
// sandbox backends (container, microvm, fullvm, fncall): what a backend is
// asked to create, the handle it returns (persisted by the node so that a
// restarted node can recover its sandboxes), and the errors it reports.
//
// Every backend runs the same guest agent (cmd/shoal-agent) and exposes it to
// the node as a unix socket path in its Handle, so that the session layer
// (exec, files, ports) never depends on the backend kind.
package sandbox

import (
	"context"
	"errors"
	"time"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/netpolicy"
)

// Errors shared by all backends; check them with errors.Is.
var (
	// ErrNotFound: the sandbox (or its runtime state) does not exist
	// (errdefs.ErrNotFound).
	ErrNotFound = errdefs.Mark(errdefs.ErrNotFound, errors.New("sandbox not found"))
	// ErrUnsupported: the backend cannot do what the spec asks
	// (errdefs.ErrUnimplemented); the message says what and, where there
	// is one, the alternative. An error that a more precise kind fits (an
	// option this node was not configured for: failed precondition) is
	// marked with that kind too, which then wins (errdefs.Code's order).
	ErrUnsupported = errdefs.Mark(errdefs.ErrUnimplemented, errors.New("not supported by this backend"))
)

// Resources bounds what a sandbox may use. Zero means "backend default".
type Resources struct {
	MemoryBytes int64 // hard memory limit (OOM kill above it)
	MilliCPU    int64 // CPU bandwidth in thousandths of a core (1000 = one core)
	Pids        int64 // maximum number of tasks
	// DiskBytes is the size of the sandbox's writable layer (its own file
	// system, with an inode count derived from the size); 0 means no limit
	// but the host's disk. A backend that cannot bound it refuses a
	// non-zero value with ErrUnsupported.
	DiskBytes int64 `json:",omitempty"`
	// BestEffort: the sandbox gets the CPU others leave (qos "be"): the
	// lowest CPU weight, and its processes under SCHED_IDLE.
	BestEffort bool `json:",omitempty"`
	// LogBytes is the sandbox's log budget: the bytes of its commands'
	// output logs the node keeps on the host (internal/session/budget.go);
	// 0 on a sandbox made before budgets existed (the node's default).
	// The node's side only: backends ignore it.
	LogBytes int64 `json:",omitempty"`
}

// Layer is one read-only layer of a sandbox's root, as the backend sees it.
type Layer struct {
	Digest    string // "sha256:<hex>"
	Kind      string // base, workspace or toolkit
	ImagePath string // the EROFS image file
	// MountPath is where the node has mounted the image read-only on the
	// host; set only for backends whose Capabilities().HostLayerMounts is true.
	MountPath string
}

// Spec is everything a backend needs to create one sandbox.
type Spec struct {
	ID string
	// Dir is the sandbox's private state directory on the host, created by the
	// node before Create and removed by the node after Delete. Backends keep
	// their writable layer, runtime config and agent socket under it.
	Dir string
	// Layers are ordered from top (highest priority) to bottom: toolkits,
	// then workspaces, then exactly one base last (the overlayfs lowerdir order).
	Layers    []Layer
	Resources Resources
	// AgentBinary is the host path of the static shoal-agent binary.
	AgentBinary string
	// Network: nil (the default), or a request without egress, means a
	// private network namespace with loopback only; see internal/netpolicy.
	// A backend that cannot give egress fails with ErrUnsupported.
	Network *netpolicy.Request
	// Env is added to every process started in the sandbox.
	Env []string
}

// Handle is what a backend returns from Create. The node persists it (as
// JSON) and hands it back to Recover and Delete after a restart.
type Handle struct {
	ID      string `json:"id"`
	Backend string `json:"backend"`
	// AgentSocket is the host path of the unix socket served by the guest
	// agent of this sandbox.
	AgentSocket string `json:"agent_socket"`
	// Data is backend-private state (paths, runtime IDs), opaque to the node.
	Data map[string]string `json:"data,omitempty"`
	// IDMap is the host range the sandbox's user namespace maps its ids to,
	// or nil when it has none (its ids are the host's). A file the sandbox
	// owns as uid u is owned by HostUID+u on the host, in its writable
	// layer too: a commit shifts the ids back (layer.CommitOptions.IDMap).
	IDMap *IDMap `json:"idmap,omitempty"`
	// Agent is what the sandbox's agent said of itself while the backend
	// created the sandbox (a pooled container's claim), if it did: the
	// node's client of the agent trusts it instead of pinging the agent on
	// its first call (agent.Client.Learn). Not stored: a node that
	// recovers the sandbox asks.
	Agent *agent.Info `json:"-"`
}

// IDMap maps the ids 0..Size-1 of a sandbox to HostUID.. and HostGID.. on
// the host.
type IDMap struct {
	HostUID uint32 `json:"host_uid"`
	HostGID uint32 `json:"host_gid"`
	Size    uint32 `json:"size"`
}

// ToHost returns the host uid and gid of the sandbox's id (uid, gid).
func (m IDMap) ToHost(uid, gid uint32) (uint32, uint32) {
	return m.HostUID + uid, m.HostGID + gid
}

// FromHost returns the sandbox's ids of host ids (uid, gid): an id outside
// the range is what the sandbox sees it as, the overflow id 65534.
func (m IDMap) FromHost(uid, gid uint32) (uint32, uint32) {
	const overflow = 65534
	shift := func(id, base uint32) uint32 {
		if id >= base && id-base < m.Size {
			return id - base
		}
		return overflow
	}
	return shift(uid, m.HostUID), shift(gid, m.HostGID)
}

// Capabilities tells the node and placement what a backend can do, so that
// they never switch on backend names.
type Capabilities struct {
	// HostLayerMounts: the backend wants each layer mounted on the host
	// (Layer.MountPath set) rather than only the image file.
	HostLayerMounts bool
}

// Status is a backend's view of a sandbox after Recover.
type Status string

const (
	StatusRunning Status = "running"
	StatusStopped Status = "stopped" // exists but its init is gone
	// StatusPaused: stopped by a Pause (a Pauser's), and Resume runs it
	// again. The node keeps it paused, or learns that it is (a node that
	// died between a Pause and recording it). A backend that cannot tell
	// a paused sandbox from a running one says running.
	StatusPaused Status = "paused"
)

// Backend creates and destroys sandboxes of one kind.
//
// Create must leave nothing behind when it fails (no mount, cgroup, process).
// Delete must be idempotent: deleting a sandbox that is already (partly) gone
// succeeds. A sandbox must keep running when the node process exits; Recover
// re-attaches to it after a node restart. Implementations are safe for
// concurrent use on different sandboxes.
type Backend interface {
	Name() string
	Capabilities() Capabilities
	Create(ctx context.Context, spec Spec) (Handle, error)
	Recover(ctx context.Context, h Handle) (Status, error)
	Delete(ctx context.Context, h Handle) error
}

// Closer is implemented by backends that hold node-wide resources besides
// their sandboxes (the container backend's warm pool of pre-started
// containers). The node calls Close when it stops: the backend releases
// those resources and leaves every sandbox running. ctx bounds the call.
// No Create may follow.
type Closer interface {
	Close(ctx context.Context) error
}

// Prober is implemented by backends that can tell cheaply (without running
// anything) whether a sandbox's init still lives. The node calls Alive for
// every running sandbox every few seconds and marks the dead ones as in
// error, so that nobody waits on a sandbox whose guest agent is gone.
type Prober interface {
	Alive(h Handle) (bool, error)
}

// Freezer is implemented by backends that can stop every process of a
// sandbox in place and let them go on later (the cgroup freezer): the node
// freezes a sandbox while it copies its writable layer (a commit), so that
// the copy is a consistent snapshot and nothing in the sandbox acts
// meanwhile. Freeze returns once every task is frozen (or fails, leaving
// the sandbox thawed); ErrUnsupported if the host cannot freeze it. Thaw
// lets them run again; thawing a sandbox that is not frozen, or gone, is
// not an error. Calls for one sandbox are serialized by the caller.
type Freezer interface {
	Freeze(ctx context.Context, h Handle) error
	Thaw(ctx context.Context, h Handle) error
}

// DiskLimiter is implemented by backends that can bound the size of a
// sandbox's writable layer (Resources.DiskBytes). DiskLimits says whether
// this one can on this host, and how, or why not: a backend that cannot
// refuses a non-zero DiskBytes with ErrUnsupported.
type DiskLimiter interface {
	DiskLimits() (ok bool, how string)
}

// Pauser is implemented by backends that can pause a sandbox: stop every
// process in place and give back (most of) its memory, so that an idle
// sandbox costs little, and later resume it where it stopped. Its
// processes, their memory, its files and its open connections (inside the
// sandbox) are as they were after Resume; only time has passed.
//
// Pause returns once the sandbox is stopped; what it reclaimed is reported
// in the PauseStats, and a sandbox whose memory could not be reclaimed is
// still paused (Pause fails only when the sandbox could not be stopped, and
// then leaves it running). Resume returns once the sandbox runs again and
// its guest agent can be reached through the handle it returns, which may
// differ from h (a VM restored from a snapshot is a new process; the node
// persists the new handle). Resume of a sandbox that is not paused
// succeeds. Calls for one sandbox are serialized by the caller, and never
// overlap a Freezer call.
type Pauser interface {
	Pause(ctx context.Context, h Handle) (PauseStats, error)
	Resume(ctx context.Context, h Handle) (Handle, error)
}

// Resetter is implemented by backends that can bring a running sandbox
// back to its start in place: every process but its guest agent ends, its
// writable layer is replaced by an empty one over the same layers (spec's,
// as at its Create), its shared memory, SysV IPC objects and sockets go,
// and it keeps its ID, agent socket, limits and network. Reset returns the
// new handle (the node persists it) once the agent serves on the new root.
// A failed Reset may leave the sandbox without its processes, or unusable
// (failed during the root switch): the caller reports the failure and
// keeps the old handle. Calls for one sandbox are
// serialized by the caller with Pause, Resume and Freezer calls; the
// sandbox is running (not paused) when Reset is called.
type Resetter interface {
	Reset(ctx context.Context, h Handle, spec Spec) (Handle, error)
}

// ProcessEnder is implemented by backends that can end every process of a
// running sandbox but its guest agent, leaving its file system as it is:
// the node's file-system-only pause (E2B's keepMemory: false) ends them
// before its Pauser pauses what is left, so that the resumed sandbox has
// its files and none of its processes. Called like Reset.
type ProcessEnder interface {
	EndProcesses(ctx context.Context, h Handle) error
}

// Evicter is implemented by Pausers whose pause may leave a paused
// sandbox's memory on the host (a VM paused in place: compressed in
// swap): Evict moves it off the host (a VM's snapshot to a file, its QEMU
// ended) without running the sandbox, for the node's memory pressure.
// evicted says whether there was anything to move; the sandbox stays
// paused either way, and Resume runs it as always. Calls are serialized
// with Pause and Resume by the caller.
type Evicter interface {
	Evict(ctx context.Context, h Handle) (stats PauseStats, evicted bool, err error)
}

// PauseStats says what a Pause did. Memory figures are the sandbox's
// resident memory as its backend counts it (a container's memory cgroup
// usage), -1 when unknown.
type PauseStats struct {
	MemoryBefore int64         `json:"memory_before"`
	MemoryAfter  int64         `json:"memory_after"`
	SwappedOut   int64         `json:"swapped_out,omitempty"` // bytes written to swap, if known
	Method       string        `json:"method,omitempty"`      // how memory was reclaimed ("process_madvise", "memory.reclaim", "none: ...")
	FreezeTook   time.Duration `json:"freeze_took"`
	ReclaimTook  time.Duration `json:"reclaim_took"`
	// FilePagesOnly: the pause reclaimed into swap, but the host had none
	// (serve could not set up zram, or --zram-size 0): only file pages
	// went, anonymous memory stayed resident.
	FilePagesOnly bool `json:"file_pages_only,omitempty"`
}

// Timeouts used by backends when the caller's context has none.
const DefaultStartTimeout = 30 * time.Second

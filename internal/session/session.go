// Package session is Shoal's session layer on a node: commands as durable
// server-side objects with output logs addressed by byte offset, stdin and
// signals, and trajectories that replay recorded steps instead of running
// them again.
//
// A command runs in a sandbox as a durable command of the guest agent (see
// internal/agent/durable.go). For each running command, a pump goroutine
// attaches to the agent, appends every output record to the command's log
// file (DATA/sandboxes/<id>/logs/<command>.log, in the agent's record
// format, so agent offsets and file offsets are the same numbers),
// acknowledges it, and finally records the exit status. Clients never talk
// to the agent: they read the log from any offset and wait for more, so a
// client can go away and come back, and `shoal serve` can restart, without
// the command noticing or a byte being lost or repeated.
package session

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base32"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"go.etcd.io/bbolt"
	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/boltgroup"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/limits"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// ackEvery is how much log the pump writes between acknowledgements (the
// agent holds up to 1 MiB unacknowledged per command).
const ackEvery = 256 << 10

// DefaultLogCap bounds each command's output log.
const DefaultLogCap = 64 << 20

// Sandboxes is what the session layer needs of the node's sandbox manager.
type Sandboxes interface {
	// Agent returns a running sandbox's agent client (counts as activity).
	Agent(id string) (*agent.Client, error)
	// SandboxDir is the sandbox's private directory on the host.
	SandboxDir(id string) (string, error)
	// Hold marks the sandbox busy (never idle) until release is called.
	Hold(id string) (release func(), err error)
	// Deleting reports whether the sandbox is being deleted, or is gone.
	Deleting(id string) bool
	// Client returns the agent client of a running or paused sandbox
	// without resuming it or counting activity (pumps and recovery: a
	// paused sandbox stays paused).
	Client(id string) (*agent.Client, error)
	// Paused reports whether the sandbox is paused (or being paused or
	// resumed): its agent does not answer until it is resumed.
	Paused(id string) bool
}

// CommandDefaults is what a Sandboxes may also offer: the working
// directory and user of a sandbox's commands that name none (those of
// the image it was made from), "" for none.
type CommandDefaults interface {
	CommandDefaults(id string) (cwd, user string)
}

// pausedPoll is how often a pump whose sandbox is paused looks whether it
// was resumed.
const pausedPoll = 50 * time.Millisecond

// Config configures a Manager.
type Config struct {
	LogCap int64 // per command; 0 = DefaultLogCap
	// LogBudget bounds the bytes of command logs a sandbox keeps on the
	// host when the node names no budget of its own for it (LogBudgeter);
	// 0 = none but LogCap per command. See budget.go.
	LogBudget int64
	// Retention: what the node keeps of a sandbox's ended commands (their
	// records and output logs). Running commands, trajectory steps and the
	// commands of shell sessions are kept as long as their sandbox lives;
	// of the others, the KeepEnded most recently ended ones, none ended
	// longer ago than KeepFor. A pruned command's ID answers NotFound
	// ("command X was pruned by the retention policy").
	KeepEnded int           // 0 = DefaultKeepEnded; -1 = no count limit
	KeepFor   time.Duration // 0 = no age limit
}

// DefaultKeepEnded is how many ended commands of each sandbox the node keeps
// by default (besides trajectory steps and shells).
const DefaultKeepEnded = 1000

// State of a command.
type State string

const (
	StateRunning State = "running"
	StateExited  State = "exited"
	StateLost    State = "lost" // its agent no longer knows it (the sandbox restarted or died)
)

// record is what is persisted about a command.
type record struct {
	ID         string            `json:"id"`
	SandboxID  string            `json:"sandbox"`
	AgentID    string            `json:"agent_id"`
	Args       []string          `json:"args"`
	Cwd        string            `json:"cwd,omitempty"`
	User       string            `json:"user,omitempty"`
	PTY        bool              `json:"pty,omitempty"`
	Pid        int               `json:"pid"`
	State      State             `json:"state"`
	Exit       *agent.ExitStatus `json:"exit,omitempty"`
	Started    time.Time         `json:"started"`
	Ended      time.Time         `json:"ended,omitzero"`
	Trajectory string            `json:"trajectory,omitempty"`
	Step       int64             `json:"step,omitempty"`
	Digest     string            `json:"digest,omitempty"`
	LogBytes   int64             `json:"log_bytes,omitempty"`  // at exit
	LogPruned  int64             `json:"log_pruned,omitempty"` // its log's bytes before this offset are pruned (budget.go)
	Killed     bool              `json:"killed,omitempty"`     // lost because its sandbox was deleted
	Reset      bool              `json:"reset,omitempty"`      // closed by a reset of its sandbox
	Extra      map[string]string `json:"extra,omitempty"`
}

// Command is a command in a sandbox. Its exported view is Info.
type Command struct {
	logPath string

	mu      sync.Mutex    // guards the fields below
	rec     record        // persisted fields
	size    int64         // bytes in the log file
	pruned  int64         // bytes before this offset are pruned (punched out of the file)
	marks   []int64       // record boundaries past pruned, about every markEvery bytes (budget.go)
	changed chan struct{} // closed and replaced when size or state changes
	cancel  context.CancelFunc
	release func()
}

// Info is a snapshot of a command.
type Info struct {
	ID, SandboxID string
	Args          []string
	Cwd           string
	User          string // the sandbox user it runs as ("" = root)
	PTY           bool
	Pid           int
	State         State
	Exit          *agent.ExitStatus
	Started       time.Time
	Ended         time.Time
	LogBytes      int64
	// LogPruned: the log's bytes before this offset were pruned to keep
	// the sandbox within its log budget (budget.go); reading starts here.
	LogPruned  int64
	Trajectory string
	Step       int64
	Digest     string
	// Killed: the command is lost because its sandbox was deleted (killed)
	// while it ran.
	Killed bool
	// Reset: the command was closed (its process killed) by a reset of
	// its sandbox.
	Reset bool
}

// Info returns a snapshot of the command.
func (c *Command) Info() Info {
	c.mu.Lock()
	defer c.mu.Unlock()
	r := c.rec
	return Info{
		ID: r.ID, SandboxID: r.SandboxID, Args: r.Args, Cwd: r.Cwd, User: r.User, PTY: r.PTY, Pid: r.Pid,
		State: r.State, Exit: r.Exit, Started: r.Started, Ended: r.Ended, LogBytes: c.size, LogPruned: c.pruned,
		Trajectory: r.Trajectory, Step: r.Step, Digest: r.Digest, Killed: r.Killed, Reset: r.Reset,
	}
}

// killedError is what a reader of a command killed with its sandbox gets.
func killedError(sandboxID, id string) error {
	return errdefs.New(errdefs.ErrSandboxKilled, "sandbox %s was killed (deleted) while command %s ran: the command did not exit", sandboxID, id)
}

// resetError is what a reader of a command closed by a reset gets.
func resetError(sandboxID, id string) error {
	return fmt.Errorf("command %s was closed by a reset of sandbox %s: %w", id, sandboxID, errdefs.ErrSandboxReset)
}

func (c *Command) notifyLocked() {
	close(c.changed)
	c.changed = make(chan struct{})
}

var (
	bucketCommands     = []byte("session.commands")
	bucketTrajectories = []byte("session.trajectories")
	bucketPruned       = []byte("session.pruned") // sandboxID/commandID → prunedRecord
)

// prunedRecord is what is left of a command the retention policy pruned.
type prunedRecord struct {
	Ended  time.Time `json:"ended"`
	Pruned time.Time `json:"pruned"`
}

// Manager holds the commands of one node. It is safe for concurrent use.
type Manager struct {
	cfg Config
	log *slog.Logger
	db  *bbolt.DB
	sb  Sandboxes

	ctx    context.Context // ends pumps on Close
	cancel context.CancelFunc

	mu     sync.Mutex            // guards cmds, shells and ended
	cmds   map[string]*Command   // key: sandboxID/commandID
	shells map[string]*Shell     // key: sandboxID/name
	ended  map[string]*endedList // by sandbox: prunable ended commands, in the order they ended

	onPrune []func(sandboxID string, commandIDs []string) // set before serving

	// orphans: after a restart, the sandboxes whose agents may hold
	// commands the node never recorded, until reapOrphans has looked
	// (guarded by mu). Each one's mutex orders the search with the
	// commands started there meanwhile: a start holds it from before it
	// asks the agent until the command is registered, and the search holds
	// it from its listing of the agent's commands until it has reaped what
	// it found, so a command just started is never taken for an orphan.
	orphans map[string]*sync.Mutex

	trajLocks keyedMutex // serializes the steps of one trajectory

	// logMu guards logUsed (each sandbox's bytes of command logs on the
	// host, less what is pruned) and serializes the pruning of logs
	// (budget.go). Taken after no other lock; it takes mu and Command.mu.
	logMu   sync.Mutex
	logUsed map[string]int64
}

// New returns a manager; call Recover once the node has recovered its
// sandboxes.
func New(cfg Config, db *bbolt.DB, sb Sandboxes, log *slog.Logger) (*Manager, error) {
	if cfg.LogCap == 0 {
		cfg.LogCap = DefaultLogCap
	}
	if cfg.LogCap < 4096 {
		return nil, fmt.Errorf("session config: log cap %d is below 4096 bytes", cfg.LogCap)
	}
	if cfg.LogBudget != 0 && cfg.LogBudget < MinLogBudget {
		return nil, fmt.Errorf("session config: log budget %d bytes is below the minimum of %d", cfg.LogBudget, MinLogBudget)
	}
	switch {
	case cfg.KeepEnded == 0:
		cfg.KeepEnded = DefaultKeepEnded
	case cfg.KeepEnded < -1:
		return nil, fmt.Errorf("session config: keep %d ended commands: want at least 1, or -1 for no limit", cfg.KeepEnded)
	}
	if cfg.KeepFor < 0 {
		return nil, fmt.Errorf("session config: keep ended commands for %s: want a positive duration, or 0 for no limit", cfg.KeepFor)
	}
	if err := db.Update(func(tx *bbolt.Tx) error {
		for _, b := range [][]byte{bucketCommands, bucketTrajectories, bucketPruned} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		return nil, fmt.Errorf("open session store: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	m := &Manager{cfg: cfg, log: log, db: db, sb: sb, ctx: ctx, cancel: cancel,
		cmds: map[string]*Command{}, shells: map[string]*Shell{}, ended: map[string]*endedList{},
		orphans: map[string]*sync.Mutex{}, logUsed: map[string]int64{}}
	if err := m.shellsInit(); err != nil {
		return nil, fmt.Errorf("open session store: %w", err)
	}
	if cfg.KeepFor > 0 {
		go m.pruneByAge()
	}
	return m, nil
}

// keyedMutex is a set of mutexes by key, created on demand and dropped
// when unused.
type keyedMutex struct {
	mu sync.Mutex
	m  map[string]*keyedEntry
}

type keyedEntry struct {
	mu sync.Mutex
	n  int // holders and waiters
}

func (k *keyedMutex) lock(key string) (unlock func()) {
	k.mu.Lock()
	if k.m == nil {
		k.m = map[string]*keyedEntry{}
	}
	e := k.m[key]
	if e == nil {
		e = &keyedEntry{}
		k.m[key] = e
	}
	e.n++
	k.mu.Unlock()
	e.mu.Lock()
	return func() {
		e.mu.Unlock()
		k.mu.Lock()
		if e.n--; e.n == 0 {
			delete(k.m, key)
		}
		k.mu.Unlock()
	}
}

// Close stops the pumps (the commands go on; Recover re-attaches).
func (m *Manager) Close() { m.cancel() }

func key(sandboxID, id string) string { return sandboxID + "/" + id }

func newCommandID() string {
	var b [10]byte
	rand.Read(b[:])
	return strings.ToLower(base32.StdEncoding.WithPadding(base32.NoPadding).EncodeToString(b[:]))
}

// StartRequest asks for a command.
type StartRequest struct {
	Args      []string
	Env       []string // KEY=VALUE
	Cwd       string
	Stdin     []byte // written first
	StdinOpen bool   // keep stdin open for SendStdin
	Timeout   time.Duration
	PTY       *agent.Winsize
	// User: the sandbox user (its /etc/passwd) to run as, with its ids,
	// groups, HOME, USER, LOGNAME and, without Cwd, in its home; "" = root.
	User string
	// Trajectory step (both set, or neither).
	Trajectory string
	Step       int64
}

// digest fingerprints what defines a trajectory step.
func (r *StartRequest) digest() string {
	h := sha256.New()
	enc := json.NewEncoder(h)
	env := append([]string(nil), r.Env...)
	sort.Strings(env)
	fields := []any{r.Args, env, r.Cwd, r.Stdin, r.StdinOpen, r.Timeout, r.PTY}
	if r.User != "" { // steps recorded before users keep their digest
		fields = append(fields, r.User)
	}
	enc.Encode(fields)
	return "sha256:" + hex.EncodeToString(h.Sum(nil))
}

func trajKey(sandboxID, traj string, step int64) []byte {
	return []byte(fmt.Sprintf("%s/%s/%020d", sandboxID, traj, step))
}

type trajStep struct {
	Command string   `json:"command"`
	Digest  string   `json:"digest"`
	Args    []string `json:"args"`
}

// Start starts a command, or, for a trajectory step that is already
// recorded with the same request, returns the recorded command with
// replayed set (it is not run again). A recorded step with a different
// request is refused (errdefs.ErrFailedPrecondition).
func (m *Manager) Start(ctx context.Context, sandboxID string, req StartRequest) (c *Command, replayed bool, err error) {
	if len(req.Args) == 0 || req.Args[0] == "" {
		return nil, false, errdefs.New(errdefs.ErrInvalidArgument, "a command is required")
	}
	if err := checkStart(&req); err != nil {
		return nil, false, err
	}
	if (req.Trajectory == "") != (req.Step == 0) {
		return nil, false, errdefs.New(errdefs.ErrInvalidArgument, "a trajectory step needs both trajectory_id and step (step >= 1)")
	}
	if req.Step < 0 {
		return nil, false, errdefs.New(errdefs.ErrInvalidArgument, "step must be >= 1, got %d", req.Step)
	}
	if req.Trajectory != "" {
		if len(req.Trajectory) > 256 || strings.ContainsAny(req.Trajectory, "/\x00") {
			return nil, false, errdefs.New(errdefs.ErrInvalidArgument, "trajectory_id %q must be 1-256 characters without '/'", req.Trajectory)
		}
		unlock := m.trajLocks.lock(sandboxID + "/" + req.Trajectory)
		defer unlock()
		digest := req.digest()
		var st trajStep
		var found bool
		m.db.View(func(tx *bbolt.Tx) error {
			if v := tx.Bucket(bucketTrajectories).Get(trajKey(sandboxID, req.Trajectory, req.Step)); v != nil {
				found = json.Unmarshal(v, &st) == nil
			}
			return nil
		})
		if found {
			if st.Digest != digest {
				return nil, false, errdefs.New(errdefs.ErrFailedPrecondition,
					"trajectory %s step %d diverged: it was recorded as %s and is now %s; a replay must send the same request (start a new trajectory ID to branch)",
					req.Trajectory, req.Step, quoteArgs(st.Args), quoteArgs(req.Args))
			}
			c, err := m.Get(sandboxID, st.Command)
			if err != nil {
				return nil, false, fmt.Errorf("trajectory %s step %d: %w", req.Trajectory, req.Step, err)
			}
			return c, true, nil
		}
	}
	c, err = m.start(ctx, sandboxID, req)
	return c, false, err
}

// checkStart checks a start's sizes and timeout against limits, whatever
// face it came through.
func checkStart(req *StartRequest) error {
	if err := limits.Argv(req.Args, req.Env); err != nil {
		return err
	}
	for _, e := range req.Env {
		if k, _, ok := strings.Cut(e, "="); !ok || k == "" {
			return errdefs.New(errdefs.ErrInvalidArgument, "environment entry %.64q is not KEY=VALUE", e)
		}
	}
	if err := limits.Path("cwd", req.Cwd); err != nil {
		return err
	}
	if err := limits.User("user", req.User); err != nil {
		return err
	}
	if err := limits.Bytes("stdin", len(req.Stdin), limits.StdinBytes); err != nil {
		return err
	}
	return limits.Duration("timeout", req.Timeout, 0, limits.CommandTimeout)
}

func quoteArgs(args []string) string {
	b, _ := json.Marshal(args)
	return string(b)
}

func (m *Manager) start(ctx context.Context, sandboxID string, req StartRequest) (*Command, error) {
	ph := sandbox.StartPhases()
	defer func() { m.log.Debug("command started", "sandbox_id", sandboxID, "phases", ph.String()) }()
	ag, err := m.sb.Agent(sandboxID)
	if err != nil {
		return nil, err
	}
	dir, err := m.sb.SandboxDir(sandboxID)
	if err != nil {
		return nil, err
	}
	release, err := m.sb.Hold(sandboxID)
	if err != nil {
		return nil, err
	}
	id := newCommandID()
	logDir := filepath.Join(dir, "logs")
	if err := os.MkdirAll(logDir, 0o700); err != nil {
		release()
		return nil, fmt.Errorf("create log dir: %w", err)
	}
	c := &Command{logPath: filepath.Join(logDir, id+".log"), changed: make(chan struct{}), release: release}
	f, err := os.OpenFile(c.logPath, os.O_CREATE|os.O_EXCL|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		release()
		return nil, fmt.Errorf("create command log: %w", err)
	}
	ph.Mark("prep")
	// While orphans are looked for in this sandbox (after a restart), a
	// command started here must be registered before the next listing of
	// the agent's commands, or it would be taken for one.
	defer m.holdOrphanGate(sandboxID)()
	if d, ok := m.sb.(CommandDefaults); ok && (req.Cwd == "" || req.User == "") {
		cwd, user := d.CommandDefaults(sandboxID)
		if req.Cwd == "" {
			req.Cwd = cwd
		}
		if req.User == "" {
			req.User = user
		}
	}
	sreq := agent.StartRequest{
		ExecRequest: agent.ExecRequest{
			Args: req.Args, Env: req.Env, Cwd: req.Cwd, Timeout: req.Timeout,
			Stdin: req.StdinOpen || len(req.Stdin) > 0, User: req.User,
		},
		LogCap: m.cfg.LogCap,
		PTY:    req.PTY,
	}
	// The attachment belongs to the pump, not to the request: a streamed
	// Exec returns as soon as its client has the exit, and if that closed
	// the attachment before the pump acknowledged the command's end, the
	// agent would keep the command for ever. The request bounds the start
	// only.
	pctx, cancel := context.WithCancel(m.ctx)
	stop := context.AfterFunc(ctx, cancel)
	att, err := ag.Start(pctx, sreq)
	ph.Mark("agent")
	var agentID string
	var pid int
	if err == nil {
		agentID, pid = att.ID(), att.Pid()
		if !stop() {
			// The request ended during the start, which closes the
			// attachment; the command runs: the pump attaches again.
			att.Close()
			att = nil
			pctx, cancel = context.WithCancel(m.ctx)
		}
	}
	if err != nil {
		cancel()
		f.Close()
		os.Remove(c.logPath)
		release()
		return nil, fmt.Errorf("start %s in sandbox %s: %w", quoteArgs(req.Args), sandboxID, err)
	}
	c.rec = record{
		ID: id, SandboxID: sandboxID, AgentID: agentID, Args: req.Args, Cwd: req.Cwd, User: req.User, PTY: req.PTY != nil,
		Pid: pid, State: StateRunning, Started: time.Now().UTC(),
		Trajectory: req.Trajectory, Step: req.Step,
	}
	if req.Trajectory != "" {
		c.rec.Digest = req.digest()
	}
	err = boltgroup.Update(m.db, func(tx *bbolt.Tx) error {
		if err := putRecord(tx, &c.rec); err != nil {
			return err
		}
		if req.Trajectory == "" {
			return nil
		}
		b, _ := json.Marshal(trajStep{Command: id, Digest: c.rec.Digest, Args: req.Args})
		return tx.Bucket(bucketTrajectories).Put(trajKey(sandboxID, req.Trajectory, req.Step), b)
	})
	if err != nil {
		ag.SignalCommand(context.Background(), agentID, int(syscall.SIGKILL))
		if att != nil {
			att.Close()
		}
		cancel()
		f.Close()
		os.Remove(c.logPath)
		release()
		return nil, fmt.Errorf("persist command: %w", err)
	}
	ph.Mark("persist")
	m.mu.Lock()
	m.cmds[key(sandboxID, id)] = c
	m.mu.Unlock()
	c.cancel = cancel
	go m.pump(pctx, c, ag, att, f)
	if len(req.Stdin) > 0 || (sreq.Stdin && !req.StdinOpen) {
		if err := ag.SendStdin(ctx, agentID, req.Stdin, !req.StdinOpen); err != nil {
			m.log.Warn("write stdin", "sandbox_id", sandboxID, "command", id, "err", err)
		}
	}
	return c, nil
}

func putRecord(tx *bbolt.Tx, r *record) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	return tx.Bucket(bucketCommands).Put([]byte(key(r.SandboxID, r.ID)), b)
}

// pump copies the agent's records of c into its log until the exit, and
// re-attaches when the connection breaks.
func (m *Manager) pump(ctx context.Context, c *Command, ag *agent.Client, att *agent.Attachment, f *os.File) {
	defer f.Close()
	log := m.log.With("sandbox_id", c.rec.SandboxID, "command", c.rec.ID)
	var acked int64
	for attempt := 0; ; {
		if att == nil {
			c.mu.Lock()
			from := c.size
			c.mu.Unlock()
			var err error
			att, err = ag.Attach(ctx, c.rec.AgentID, from)
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				if errors.Is(err, fs.ErrNotExist) {
					m.finish(c, nil, "the sandbox's agent no longer knows the command")
					return
				}
				if m.sb.Deleting(c.rec.SandboxID) {
					m.finish(c, nil, whyDeleted)
					return
				}
				if m.sb.Paused(c.rec.SandboxID) {
					// Its agent answers after the resume: wait for it,
					// however long the pause.
					attempt = 0
					select {
					case <-ctx.Done():
						return
					case <-time.After(pausedPoll):
					}
					continue
				}
				attempt++
				if attempt > 50 {
					m.finish(c, nil, "cannot re-attach: "+err.Error())
					return
				}
				select {
				case <-ctx.Done():
					return
				case <-time.After(time.Duration(min(attempt, 10)) * 100 * time.Millisecond):
				}
				continue
			}
		}
		r, err := att.Recv()
		if err != nil {
			att.Close()
			att = nil
			if ctx.Err() != nil {
				return
			}
			log.Debug("attachment lost, re-attaching", "err", err)
			continue
		}
		attempt = 0
		if r.Exit != nil {
			if r.Exit.Signal == "SIGKILL" && m.sb.Deleting(c.rec.SandboxID) {
				// Killed with its sandbox (the agent saw it die first).
				m.finish(c, nil, whyDeleted)
				return
			}
			m.finish(c, r.Exit, "")
			m.acknowledgeEnd(ctx, c, ag, att)
			return
		}
		var hdr [agent.LogRecordHeader]byte
		hdr[0] = byte(r.Kind)
		binary.BigEndian.PutUint32(hdr[1:], uint32(len(r.Data)))
		if err := m.writeRecord(ctx, c, f, hdr[:], r.Data); err != nil {
			if ctx.Err() != nil {
				att.Close()
				return
			}
			log.Error("write command log", "err", err)
			m.finish(c, nil, "writing its log failed: "+err.Error())
			ag.SignalCommand(context.Background(), c.rec.AgentID, int(syscall.SIGKILL))
			att.Close()
			return
		}
		m.logged(c, r.End)
		if r.End-acked >= ackEvery {
			att.Ack(r.End)
			acked = r.End
		}
	}
}

// writeRecord appends one record to a command's log. When the host's disk
// is full (ENOSPC, EDQUOT, or a short write) it takes back what it wrote of
// the record and
// tries again, with back-off, until there is room, the node stops, or the
// sandbox is deleted: meanwhile nothing more is received, so the agent
// keeps the command's output (it holds what is not acknowledged, and past
// its bound the command waits on its pipe), and nothing is lost. Any other
// error is returned.
func (m *Manager) writeRecord(ctx context.Context, c *Command, f *os.File, hdr, data []byte) error {
	start, err := f.Seek(0, io.SeekCurrent)
	if err != nil {
		return err
	}
	logged := false
	for wait := 50 * time.Millisecond; ; wait = min(2*wait, 2*time.Second) {
		n, err := unix.Writev(int(f.Fd()), [][]byte{hdr, data})
		if err == nil && n < len(hdr)+len(data) {
			// A short write: the disk filled in the middle of the record
			// (the next write would say ENOSPC).
			err = syscall.ENOSPC
		}
		if err == nil {
			if logged {
				m.log.Info("command log: room again on the host's disk", "sandbox_id", c.rec.SandboxID, "command", c.rec.ID)
			}
			return nil
		}
		if !errors.Is(err, syscall.ENOSPC) && !errors.Is(err, syscall.EDQUOT) {
			return err
		}
		// A part of the record may be written: take it back.
		if terr := f.Truncate(start); terr != nil {
			return errors.Join(err, terr)
		}
		if _, serr := f.Seek(start, io.SeekStart); serr != nil {
			return errors.Join(err, serr)
		}
		if !logged {
			m.log.Error("command log: the host's disk is full; the command's output waits in its sandbox until there is room",
				"sandbox_id", c.rec.SandboxID, "command", c.rec.ID, "err", err)
			logged = true
		}
		if m.sb.Deleting(c.rec.SandboxID) {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(wait):
		}
	}
}

// acknowledgeEnd tells the agent that c's end is recorded, so that it
// forgets the command; it returns once the agent confirmed. A connection
// that breaks first is opened again, a few times: an agent never told keeps
// the command until its own limit on such commands pushes it out.
func (m *Manager) acknowledgeEnd(ctx context.Context, c *Command, ag *agent.Client, att *agent.Attachment) {
	err := att.Done()
	att.Close()
	for attempt := 1; err != nil && attempt <= 3 && ctx.Err() == nil; attempt++ {
		c.mu.Lock()
		from := c.size
		c.mu.Unlock()
		a, aerr := ag.Attach(ctx, c.rec.AgentID, from)
		if aerr != nil {
			if errors.Is(aerr, fs.ErrNotExist) {
				return // it forgot it after all
			}
			err = aerr
			continue
		}
		for {
			r, rerr := a.Recv()
			if rerr != nil {
				err = rerr
				break
			}
			if r.Exit != nil {
				err = a.Done()
				break
			}
		}
		a.Close()
	}
	if err != nil && ctx.Err() == nil {
		m.log.Warn("could not tell the agent that a command's end is recorded: it keeps the command until its limit pushes it out",
			"sandbox_id", c.rec.SandboxID, "command", c.rec.ID, "err", err)
	}
}

// whyDeleted is why the commands of a deleted sandbox are lost.
const whyDeleted = "the sandbox was deleted"

// whyReset is why the commands of a reset sandbox are lost.
const whyReset = "reset"

// whyFSPause is why the commands of a sandbox paused without its memory
// (its processes) are lost.
const whyFSPause = "paused without memory"

// finish records how a command ended: its exit status, or lost (exit nil);
// lost while its sandbox is being deleted is killed.
func (m *Manager) finish(c *Command, exit *agent.ExitStatus, why string) {
	killed := exit == nil && (why == whyDeleted || m.sb.Deleting(c.rec.SandboxID))
	c.mu.Lock()
	if c.rec.State != StateRunning {
		c.mu.Unlock()
		return
	}
	if exit != nil {
		c.rec.State = StateExited
		c.rec.Exit = exit
	} else {
		c.rec.State = StateLost
		c.rec.Killed = killed
		c.rec.Reset = why == whyReset
		if killed {
			why = whyDeleted
		}
		if c.rec.Extra == nil {
			c.rec.Extra = map[string]string{}
		}
		c.rec.Extra["lost"] = why
	}
	c.rec.Ended = time.Now().UTC()
	c.rec.LogBytes = c.size
	c.marks = nil // an ended command's log is pruned whole (budget.go)
	rec := c.rec
	release := c.release
	c.release = nil
	// Readers learn of the exit before it is persisted: if the node dies in
	// between, the agent still holds the command (the pump tells it to
	// forget only after this returns), and Recover records the same exit.
	c.notifyLocked()
	c.mu.Unlock()
	if err := boltgroup.Update(m.db, func(tx *bbolt.Tx) error {
		if tx.Bucket(bucketCommands).Get([]byte(key(rec.SandboxID, rec.ID))) == nil {
			return nil // the sandbox was deleted meanwhile
		}
		return putRecord(tx, &rec)
	}); err != nil {
		m.log.Error("persist command exit", "sandbox_id", rec.SandboxID, "command", rec.ID, "err", err)
	}
	if release != nil {
		release()
	}
	m.ended1(c)
}

// Get finds a command.
func (m *Manager) Get(sandboxID, id string) (*Command, error) {
	m.mu.Lock()
	c, ok := m.cmds[key(sandboxID, id)]
	m.mu.Unlock()
	if ok {
		return c, nil
	}
	if p, ok := m.prunedRecord(sandboxID, id); ok {
		return nil, errdefs.New(errdefs.ErrNotFound, "command %s was pruned by the retention policy: it ended %s ago, and the node keeps %s",
			id, time.Since(p.Ended).Round(time.Second), m.policy())
	}
	return nil, errdefs.New(errdefs.ErrNotFound, "no command %q in sandbox %s", id, sandboxID)
}

// List returns a sandbox's commands, oldest first.
func (m *Manager) List(sandboxID string) []Info {
	m.mu.Lock()
	var cs []*Command
	for _, c := range m.cmds {
		if c.rec.SandboxID == sandboxID {
			cs = append(cs, c)
		}
	}
	m.mu.Unlock()
	out := make([]Info, 0, len(cs))
	for _, c := range cs {
		out = append(out, c.Info())
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Started.Before(out[j].Started) })
	return out
}

// EventKind says what an Event carries.
type EventKind int

const (
	EventStdout EventKind = iota + 1
	EventStderr
	EventDropped // output past the log cap was dropped from here on
	EventExit
	EventLost
	EventKeepAlive
)

// Event is one item of a command's output as read from its log.
type Event struct {
	Kind    EventKind
	Data    []byte
	Offset  int64 // log offset just past this event
	Exit    *agent.ExitStatus
	Dropped int64
}

// Events calls fn with the command's events from log offset from: output
// records, then the exit (or lost) event. It waits for more output while the
// command runs; every keepAlive of silence it sends EventKeepAlive (0: none).
// It returns fn's error, ctx's error, or nil after the last event; for a
// command killed with its sandbox, after its output, an error of kind
// errdefs.ErrSandboxKilled instead of an end event.
func (m *Manager) Events(ctx context.Context, c *Command, from int64, keepAlive time.Duration, fn func(Event) error) error {
	c.mu.Lock()
	size, pruned := c.size, c.pruned
	c.mu.Unlock()
	if from < 0 || from > size {
		return errdefs.New(errdefs.ErrInvalidArgument, "offset %d is outside the command's log [0, %d]", from, size)
	}
	if from < pruned {
		return m.prunedError(c, from, pruned)
	}
	f, err := os.Open(c.logPath)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			if _, gone := m.Get(c.rec.SandboxID, c.rec.ID); gone != nil {
				return gone // pruned, or its sandbox deleted, meanwhile
			}
		}
		return fmt.Errorf("open command log: %w", err)
	}
	defer f.Close()
	if from > pruned && from < size {
		if ok, err := recordBoundary(f, pruned, from); err != nil {
			return err
		} else if !ok {
			return errdefs.New(errdefs.ErrInvalidArgument, "offset %d is not the end of an event of this command: re-connect with an offset the server sent", from)
		}
	}
	pos := from
	var ka <-chan time.Time
	// Small logs (most commands) need a small block; a pooled full-size one
	// serves the rest without a 1 MiB allocation per call.
	var block []byte
	if size-from < eventBlock {
		block = make([]byte, max(size-from, agent.LogRecordHeader))
	} else {
		bp := blockPool.Get().(*[]byte)
		defer blockPool.Put(bp)
		block = *bp
	}
	for {
		c.mu.Lock()
		size, state, exit, changed, killed, reset := c.size, c.rec.State, c.rec.Exit, c.changed, c.rec.Killed, c.rec.Reset
		c.mu.Unlock()
		for pos < size {
			// Read a block of whole records and merge runs of the same
			// stream into one event: far fewer messages than records.
			if int64(len(block)) < min(size-pos, eventBlock) {
				block = make([]byte, min(size-pos, eventBlock)) // the log grew
			}
			n, err := f.ReadAt(block[:min(int64(len(block)), size-pos)], pos)
			if err != nil && !errors.Is(err, io.EOF) {
				return fmt.Errorf("read command log: %w", err)
			}
			// Pruned meanwhile (this reader fell behind): what was read
			// may be the hole's zeros.
			c.mu.Lock()
			pruned = c.pruned
			c.mu.Unlock()
			if pos < pruned {
				return m.prunedError(c, pos, pruned)
			}
			evs, used, err := parseRecords(block[:n], pos)
			if err != nil {
				return err
			}
			if used == 0 { // one record larger than the block: read it alone
				hdrLen := int64(binary.BigEndian.Uint32(block[1:agent.LogRecordHeader]))
				big := make([]byte, agent.LogRecordHeader+hdrLen)
				if _, err := f.ReadAt(big, pos); err != nil {
					return fmt.Errorf("read command log: %w", err)
				}
				if evs, used, err = parseRecords(big, pos); err != nil || used == 0 {
					return fmt.Errorf("command log: bad record at offset %d", pos)
				}
			}
			pos += used
			for _, ev := range evs {
				if err := fn(ev); err != nil {
					return err
				}
			}
		}
		switch state {
		case StateExited:
			return fn(Event{Kind: EventExit, Exit: exit, Offset: pos})
		case StateLost:
			if killed {
				return killedError(c.rec.SandboxID, c.rec.ID)
			}
			if reset {
				return resetError(c.rec.SandboxID, c.rec.ID)
			}
			return fn(Event{Kind: EventLost, Offset: pos})
		}
		if keepAlive > 0 && ka == nil {
			ka = time.After(keepAlive)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-changed:
		case <-ka:
			ka = nil
			if err := fn(Event{Kind: EventKeepAlive, Offset: pos}); err != nil {
				return err
			}
		}
	}
}

// eventBlock is how much of a log Events reads at a time (and so the
// largest event it merges).
const eventBlock = 1 << 20

var blockPool = sync.Pool{New: func() any { b := make([]byte, eventBlock); return &b }}

// parseRecords turns the whole records at the start of b (which starts at
// log offset base) into events, merging consecutive records of the same
// stream; it returns the bytes used.
func parseRecords(b []byte, base int64) ([]Event, int64, error) {
	var evs []Event
	var used int64
	for len(b[used:]) >= agent.LogRecordHeader {
		h := b[used:]
		n := int64(binary.BigEndian.Uint32(h[1:agent.LogRecordHeader]))
		if int64(len(h)) < agent.LogRecordHeader+n {
			break
		}
		data := h[agent.LogRecordHeader : agent.LogRecordHeader+n]
		used += agent.LogRecordHeader + n
		var kind EventKind
		switch agent.RecordKind(h[0]) {
		case agent.RecordStdout:
			kind = EventStdout
		case agent.RecordStderr:
			kind = EventStderr
		case agent.RecordTruncated:
			ev := Event{Kind: EventDropped, Offset: base + used}
			if n == 8 {
				ev.Dropped = int64(binary.BigEndian.Uint64(data))
			}
			evs = append(evs, ev)
			continue
		default:
			return nil, 0, fmt.Errorf("command log: bad record type %q at offset %d", h[0], base+used-agent.LogRecordHeader-n)
		}
		if k := len(evs); k > 0 && evs[k-1].Kind == kind {
			evs[k-1].Data = append(evs[k-1].Data, data...)
			evs[k-1].Offset = base + used
			continue
		}
		evs = append(evs, Event{Kind: kind, Data: append([]byte(nil), data...), Offset: base + used})
	}
	return evs, used, nil
}

// recordBoundary reports whether off is where a record starts in the log,
// whose records start at from (0, or where its pruned bytes end).
func recordBoundary(f *os.File, from, off int64) (bool, error) {
	var hdr [agent.LogRecordHeader]byte
	for pos := from; pos <= off; {
		if pos == off {
			return true, nil
		}
		if _, err := f.ReadAt(hdr[:], pos); err != nil {
			return false, fmt.Errorf("read command log: %w", err)
		}
		pos += agent.LogRecordHeader + int64(binary.BigEndian.Uint32(hdr[1:]))
	}
	return false, nil
}

// Wait waits until the command ends (or ctx ends) and returns its info;
// for a command killed with its sandbox, an error of kind
// errdefs.ErrSandboxKilled too.
func (m *Manager) Wait(ctx context.Context, c *Command) (Info, error) {
	for {
		c.mu.Lock()
		state, changed, killed, reset := c.rec.State, c.changed, c.rec.Killed, c.rec.Reset
		c.mu.Unlock()
		if killed {
			return c.Info(), killedError(c.rec.SandboxID, c.rec.ID)
		}
		if reset {
			return c.Info(), resetError(c.rec.SandboxID, c.rec.ID)
		}
		if state != StateRunning {
			return c.Info(), nil
		}
		select {
		case <-ctx.Done():
			return c.Info(), ctx.Err()
		case <-changed:
		}
	}
}

func (m *Manager) running(c *Command) (*agent.Client, string, error) {
	c.mu.Lock()
	state, sandboxID, agentID := c.rec.State, c.rec.SandboxID, c.rec.AgentID
	c.mu.Unlock()
	if state != StateRunning {
		return nil, "", errdefs.New(errdefs.ErrFailedPrecondition, "command %s has %s", c.rec.ID, state)
	}
	ag, err := m.sb.Agent(sandboxID)
	return ag, agentID, err
}

// SendStdin writes to a running command's stdin, closing it if close.
func (m *Manager) SendStdin(ctx context.Context, c *Command, data []byte, close bool) error {
	if err := limits.Bytes("stdin data", len(data), limits.StdinBytes); err != nil {
		return err
	}
	ag, agentID, err := m.running(c)
	if err != nil {
		return err
	}
	return ag.SendStdin(ctx, agentID, data, close)
}

// Signal sends sig to a running command's process group.
func (m *Manager) Signal(ctx context.Context, c *Command, sig syscall.Signal) error {
	ag, agentID, err := m.running(c)
	if err != nil {
		return err
	}
	return ag.SignalCommand(ctx, agentID, int(sig))
}

// Resize sets the window size of a running command's pty.
func (m *Manager) Resize(ctx context.Context, c *Command, size agent.Winsize) error {
	ag, agentID, err := m.running(c)
	if err != nil {
		return err
	}
	return ag.Resize(ctx, agentID, size)
}

// ResetSandbox closes every running command of a sandbox about to be
// reset, and its shell sessions: each command ends as lost with the reason
// "reset" (Info.Reset; its readers get errdefs.ErrSandboxReset), and a
// shell's name is free again. The node calls it before the backend's reset
// kills their processes; their logs and trajectories stay.
func (m *Manager) ResetSandbox(sandboxID string) { m.closeSandbox(sandboxID, whyReset) }

// PauseSandboxFSOnly closes every running command and shell of a sandbox
// whose processes a file-system-only pause is about to end: each command
// ends as lost with the reason "paused without memory".
func (m *Manager) PauseSandboxFSOnly(sandboxID string) { m.closeSandbox(sandboxID, whyFSPause) }

// closeSandbox closes the running commands and the shells of a sandbox
// whose processes are about to end, for why.
func (m *Manager) closeSandbox(sandboxID, why string) {
	prefix := sandboxID + "/"
	m.mu.Lock()
	var cs []*Command
	for k, c := range m.cmds {
		if strings.HasPrefix(k, prefix) {
			cs = append(cs, c)
		}
	}
	var shells [][]byte
	for k := range m.shells {
		if strings.HasPrefix(k, prefix) {
			delete(m.shells, k)
			shells = append(shells, []byte(k))
		}
	}
	m.mu.Unlock()
	for _, c := range cs {
		c.mu.Lock()
		running, cancel := c.rec.State == StateRunning, c.cancel
		c.mu.Unlock()
		if !running {
			continue
		}
		if cancel != nil {
			cancel()
		}
		m.finish(c, nil, why)
	}
	if len(shells) == 0 {
		return
	}
	if err := boltgroup.Update(m.db, func(tx *bbolt.Tx) error {
		for _, k := range shells {
			if err := tx.Bucket(bucketShells).Delete(k); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		m.log.Error("forget the shells of a reset sandbox", "sandbox_id", sandboxID, "err", err)
	}
}

// DropSandbox forgets every command and trajectory of a deleted sandbox
// (their logs went with the sandbox's directory).
func (m *Manager) DropSandbox(sandboxID string) {
	prefix := sandboxID + "/"
	m.mu.Lock()
	var cs []*Command
	for k, c := range m.cmds {
		if strings.HasPrefix(k, prefix) {
			cs = append(cs, c)
			delete(m.cmds, k)
		}
	}
	for k := range m.shells {
		if strings.HasPrefix(k, prefix) {
			delete(m.shells, k)
		}
	}
	m.mu.Unlock()
	for _, c := range cs {
		if c.cancel != nil {
			c.cancel()
		}
		m.finish(c, nil, whyDeleted)
	}
	m.mu.Lock()
	delete(m.ended, sandboxID)
	m.mu.Unlock()
	m.logMu.Lock()
	delete(m.logUsed, sandboxID)
	m.logMu.Unlock()
	buckets := [][]byte{bucketCommands, bucketTrajectories, bucketShells, bucketPruned}
	// A write only when there is something to delete (a read commits
	// nothing), and in a group commit (boltgroup: one fsync with the
	// writes of other requests in flight).
	found := false
	m.db.View(func(tx *bbolt.Tx) error {
		for _, b := range buckets {
			if k, _ := tx.Bucket(b).Cursor().Seek([]byte(prefix)); k != nil && strings.HasPrefix(string(k), prefix) {
				found = true
				break
			}
		}
		return nil
	})
	if !found {
		return
	}
	err := boltgroup.Update(m.db, func(tx *bbolt.Tx) error {
		for _, b := range buckets {
			cur := tx.Bucket(b).Cursor()
			for k, _ := cur.Seek([]byte(prefix)); k != nil && strings.HasPrefix(string(k), prefix); k, _ = cur.Next() {
				if err := cur.Delete(); err != nil {
					return err
				}
			}
		}
		return nil
	})
	if err != nil {
		m.log.Error("forget sandbox commands", "sandbox_id", sandboxID, "err", err)
	}
}

// Recover loads the persisted commands after a restart and re-attaches to
// the running ones, from the end of their logs. It makes no call to an
// agent itself: pumps re-attach, and orphans are reaped, in the background.
func (m *Manager) Recover(ctx context.Context) error {
	var recs []record
	err := m.db.View(func(tx *bbolt.Tx) error {
		return tx.Bucket(bucketCommands).ForEach(func(k, v []byte) error {
			var r record
			if err := json.Unmarshal(v, &r); err != nil {
				return fmt.Errorf("decode command %s: %w", k, err)
			}
			recs = append(recs, r)
			return nil
		})
	})
	if err != nil {
		return err
	}
	// Shells first: their commands are kept whatever the retention policy.
	if err := m.recoverShells(); err != nil {
		return err
	}
	// Ended commands join their sandbox's retention list in the order they
	// ended, and before the running ones, which may end during recovery.
	sort.SliceStable(recs, func(i, j int) bool {
		if (recs[i].State == StateRunning) != (recs[j].State == StateRunning) {
			return recs[j].State == StateRunning
		}
		return recs[i].Ended.Before(recs[j].Ended)
	})
	withRunning := map[string]bool{} // sandboxes whose agents hold commands we track
	for _, r := range recs {
		dir, err := m.sb.SandboxDir(r.SandboxID)
		if err != nil {
			// The sandbox is gone: its commands go too.
			m.DropSandbox(r.SandboxID)
			continue
		}
		c := &Command{logPath: filepath.Join(dir, "logs", r.ID+".log"), rec: r, changed: make(chan struct{})}
		size, err := repairLog(c.logPath)
		if err != nil {
			m.log.Warn("command log", "sandbox_id", r.SandboxID, "command", r.ID, "err", err)
		}
		c.size = size
		c.pruned = min(r.LogPruned, size)
		m.logMu.Lock()
		m.logUsed[r.SandboxID] += size - c.pruned
		m.logMu.Unlock()
		m.mu.Lock()
		m.cmds[key(r.SandboxID, r.ID)] = c
		m.mu.Unlock()
		if r.State != StateRunning {
			m.ended1(c)
			continue
		}
		withRunning[r.SandboxID] = true
		ag, err := m.sb.Client(r.SandboxID) // a paused sandbox stays paused
		if err != nil {
			m.finish(c, nil, "its sandbox is not running: "+err.Error())
			continue
		}
		release, err := m.sb.Hold(r.SandboxID)
		if err == nil {
			c.release = release
		}
		f, err := os.OpenFile(c.logPath, os.O_WRONLY|os.O_APPEND, 0o600)
		if err != nil {
			m.finish(c, nil, "cannot open its log: "+err.Error())
			continue
		}
		pctx, cancel := context.WithCancel(m.ctx)
		c.cancel = cancel
		go m.pump(pctx, c, ag, nil, f)
	}

	// Commands the agents hold that we never recorded (a crash between
	// starting one and persisting it): kill them and let the agent forget.
	// In the background: an agent that does not answer (stopped, traced,
	// wedged, paused) must not keep the node from serving.
	for sandboxID := range withRunning {
		ag, err := m.sb.Client(sandboxID)
		if err != nil {
			continue
		}
		g := &sync.Mutex{}
		m.mu.Lock()
		m.orphans[sandboxID] = g
		m.mu.Unlock()
		go m.reapOrphans(sandboxID, ag, g)
	}
	return nil
}

// holdOrphanGate holds the sandbox's orphan gate (Manager.orphans), if a
// search is pending, and returns what releases it.
func (m *Manager) holdOrphanGate(sandboxID string) func() {
	m.mu.Lock()
	g := m.orphans[sandboxID]
	m.mu.Unlock()
	if g == nil {
		return func() {}
	}
	g.Lock()
	return g.Unlock
}

// trackedAgentIDs is the agent IDs of a sandbox's commands the session
// layer knows (recovered, or started since).
func (m *Manager) trackedAgentIDs(sandboxID string) map[string]bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	prefix := sandboxID + "/"
	ids := map[string]bool{}
	for k, c := range m.cmds {
		if strings.HasPrefix(k, prefix) {
			ids[c.rec.AgentID] = true
		}
	}
	return ids
}

// orphanSearchPending reports whether orphans are still to be looked for
// in a sandbox (tests).
func (m *Manager) orphanSearchPending(sandboxID string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.orphans[sandboxID] != nil
}

// Bounds of the calls reapOrphans makes to an agent.
const (
	orphanListTimeout = 5 * time.Second  // listing its commands
	orphanReapTimeout = 30 * time.Second // killing one and draining it
	orphanRetryMax    = 30 * time.Second // between two tries
)

// reapOrphans kills and drains the commands the agent of a sandbox holds
// but the session layer never recorded. Every call is bounded; an agent
// that does not answer is asked again, less and less often, until it does,
// the sandbox is gone, or Close. While the sandbox is paused its agent is
// not asked (it cannot answer); commands started after its resume are
// registered before the next listing (Manager.orphans).
func (m *Manager) reapOrphans(sandboxID string, ag *agent.Client, g *sync.Mutex) {
	defer func() {
		m.mu.Lock()
		if m.orphans[sandboxID] == g {
			delete(m.orphans, sandboxID)
		}
		m.mu.Unlock()
	}()
	delay := time.Second
	for {
		if _, err := m.sb.SandboxDir(sandboxID); err != nil {
			return // the sandbox is gone
		}
		err := errors.New("the sandbox is paused")
		if !m.sb.Paused(sandboxID) {
			g.Lock()
			ctx, cancel := context.WithTimeout(m.ctx, orphanListTimeout)
			var infos []agent.CommandInfo
			infos, err = ag.Commands(ctx)
			cancel()
			if err == nil {
				tracked := m.trackedAgentIDs(sandboxID)
				for _, in := range infos {
					if !tracked[in.ID] {
						m.log.Warn("killing a command the node never recorded", "sandbox_id", sandboxID, "agent_command", in.ID, "pid", in.Pid)
						m.reapOrphan(ag, in)
					}
				}
			}
			g.Unlock()
			if err == nil {
				return
			}
		}
		m.log.Debug("list a sandbox's commands after the restart", "sandbox_id", sandboxID, "err", err, "retry_in", delay)
		select {
		case <-m.ctx.Done():
			return
		case <-time.After(delay):
		}
		delay = min(2*delay, orphanRetryMax)
	}
}

func (m *Manager) reapOrphan(ag *agent.Client, in agent.CommandInfo) {
	ctx, cancel := context.WithTimeout(m.ctx, orphanReapTimeout)
	defer cancel()
	ag.SignalCommand(ctx, in.ID, int(syscall.SIGKILL))
	att, err := ag.Attach(ctx, in.ID, in.Base)
	if err != nil {
		return
	}
	defer att.Close()
	for {
		r, err := att.Recv()
		if err != nil {
			return
		}
		if r.Exit != nil {
			att.Done()
			return
		}
		att.Ack(r.End)
	}
}

// repairLog returns the size of the complete records in a command log,
// truncating a record that a crash left half written.
func repairLog(path string) (int64, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return 0, err
	}
	var hdr [agent.LogRecordHeader]byte
	pos := int64(0)
	for pos < fi.Size() {
		if _, err := f.ReadAt(hdr[:], pos); err != nil {
			break
		}
		next := pos + agent.LogRecordHeader + int64(binary.BigEndian.Uint32(hdr[1:]))
		if next > fi.Size() {
			break
		}
		pos = next
	}
	if pos != fi.Size() {
		return pos, f.Truncate(pos)
	}
	return pos, nil
}

// Trajectory is the recorded steps of one trajectory.
type Trajectory struct {
	ID    string
	Steps []Step
}

// Step is one recorded step.
type Step struct {
	Step    int64
	Command string
	Digest  string
	Args    []string
}

// Trajectories lists a sandbox's trajectories with their steps.
func (m *Manager) Trajectories(sandboxID string) ([]Trajectory, error) {
	prefix := []byte(sandboxID + "/")
	byID := map[string]*Trajectory{}
	var order []string
	err := m.db.View(func(tx *bbolt.Tx) error {
		cur := tx.Bucket(bucketTrajectories).Cursor()
		for k, v := cur.Seek(prefix); k != nil && strings.HasPrefix(string(k), string(prefix)); k, v = cur.Next() {
			rest := strings.TrimPrefix(string(k), string(prefix))
			i := strings.LastIndexByte(rest, '/')
			if i < 0 {
				continue
			}
			tid := rest[:i]
			var step int64
			fmt.Sscanf(rest[i+1:], "%d", &step)
			var st trajStep
			if json.Unmarshal(v, &st) != nil {
				continue
			}
			t := byID[tid]
			if t == nil {
				t = &Trajectory{ID: tid}
				byID[tid] = t
				order = append(order, tid)
			}
			t.Steps = append(t.Steps, Step{Step: step, Command: st.Command, Digest: st.Digest, Args: st.Args})
		}
		return nil
	})
	out := make([]Trajectory, 0, len(order))
	for _, id := range order {
		out = append(out, *byID[id])
	}
	return out, err
}

// Retention of ended commands (Config.KeepEnded, Config.KeepFor).

// endedList is a sandbox's prunable ended commands, oldest first.
type endedList struct {
	cs   []*Command
	head int
}

func (l *endedList) len() int { return len(l.cs) - l.head }

func (l *endedList) pop() *Command {
	c := l.cs[l.head]
	l.cs[l.head] = nil
	l.head++
	if l.head > 64 && l.head*2 > len(l.cs) {
		l.cs = append([]*Command(nil), l.cs[l.head:]...)
		l.head = 0
	}
	return c
}

// OnPrune registers fn to be called with the commands the retention policy
// pruned (after their records and logs are gone). Call it before serving.
func (m *Manager) OnPrune(fn func(sandboxID string, commandIDs []string)) {
	m.onPrune = append(m.onPrune, fn)
}

// ended1 puts an ended command under the retention policy (unless it is
// kept for the sandbox's life) and prunes its sandbox's commands.
func (m *Manager) ended1(c *Command) {
	c.mu.Lock()
	sandboxID, id, traj := c.rec.SandboxID, c.rec.ID, c.rec.Trajectory
	c.mu.Unlock()
	m.mu.Lock()
	if m.cmds[key(sandboxID, id)] != c || traj != "" || m.isShellLocked(sandboxID, id) {
		// Gone with its sandbox, or kept as long as the sandbox lives.
		m.mu.Unlock()
		return
	}
	l := m.ended[sandboxID]
	if l == nil {
		l = &endedList{}
		m.ended[sandboxID] = l
	}
	l.cs = append(l.cs, c)
	m.mu.Unlock()
	m.prune(sandboxID, time.Now())
}

func (m *Manager) isShellLocked(sandboxID, id string) bool {
	for _, sh := range m.shells {
		if sh.CommandID == id && sh.SandboxID == sandboxID {
			return true
		}
	}
	return false
}

// prune drops a sandbox's ended commands beyond the retention policy:
// records, logs, and the in-memory state; a tombstone remains, so that the
// command's ID answers "pruned" rather than "no such command".
func (m *Manager) prune(sandboxID string, now time.Time) {
	var gone []*Command
	var ended []time.Time
	m.mu.Lock()
	l := m.ended[sandboxID]
	for l != nil && l.len() > 0 {
		c := l.cs[l.head]
		c.mu.Lock()
		e := c.rec.Ended
		c.mu.Unlock()
		overCount := m.cfg.KeepEnded >= 0 && l.len() > m.cfg.KeepEnded
		tooOld := m.cfg.KeepFor > 0 && now.Sub(e) > m.cfg.KeepFor
		if !overCount && !tooOld {
			break
		}
		l.pop()
		k := key(sandboxID, c.rec.ID)
		if m.cmds[k] == c {
			delete(m.cmds, k)
			gone = append(gone, c)
			ended = append(ended, e)
		}
	}
	if l != nil && l.len() == 0 {
		delete(m.ended, sandboxID)
	}
	m.mu.Unlock()
	if len(gone) == 0 {
		return
	}
	ids := make([]string, len(gone))
	for i, c := range gone {
		ids[i] = c.rec.ID
	}
	err := boltgroup.Update(m.db, func(tx *bbolt.Tx) error {
		for i, id := range ids {
			k := []byte(key(sandboxID, id))
			if tx.Bucket(bucketCommands).Get(k) == nil {
				continue // its sandbox was deleted meanwhile
			}
			if err := tx.Bucket(bucketCommands).Delete(k); err != nil {
				return err
			}
			b, _ := json.Marshal(prunedRecord{Ended: ended[i], Pruned: now.UTC()})
			if err := tx.Bucket(bucketPruned).Put(k, b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		m.log.Error("prune ended commands", "sandbox_id", sandboxID, "err", err)
	}
	for _, c := range gone {
		m.uncount(c)
		if err := os.Remove(c.logPath); err != nil && !errors.Is(err, fs.ErrNotExist) {
			m.log.Warn("remove pruned command's log", "sandbox_id", sandboxID, "command", c.rec.ID, "err", err)
		}
	}
	m.log.Debug("pruned ended commands", "sandbox_id", sandboxID, "count", len(gone), "policy", m.policy())
	for _, fn := range m.onPrune {
		fn(sandboxID, ids)
	}
}

// pruneByAge applies Config.KeepFor to every sandbox, periodically.
func (m *Manager) pruneByAge() {
	every := min(max(m.cfg.KeepFor/4, time.Second), time.Minute)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-m.ctx.Done():
			return
		case now := <-t.C:
			m.mu.Lock()
			ids := make([]string, 0, len(m.ended))
			for id := range m.ended {
				ids = append(ids, id)
			}
			m.mu.Unlock()
			for _, id := range ids {
				m.prune(id, now)
			}
		}
	}
}

// prunedRecord returns the tombstone of a pruned command.
func (m *Manager) prunedRecord(sandboxID, id string) (prunedRecord, bool) {
	var p prunedRecord
	var ok bool
	m.db.View(func(tx *bbolt.Tx) error {
		if v := tx.Bucket(bucketPruned).Get([]byte(key(sandboxID, id))); v != nil {
			ok = json.Unmarshal(v, &p) == nil
		}
		return nil
	})
	return p, ok
}

// policy describes the retention policy.
func (m *Manager) policy() string {
	var s string
	if m.cfg.KeepEnded >= 0 {
		s = fmt.Sprintf("the %d most recently ended commands of a sandbox", m.cfg.KeepEnded)
	} else {
		s = "every ended command of a sandbox"
	}
	if m.cfg.KeepFor > 0 {
		s += fmt.Sprintf(" for at most %s", m.cfg.KeepFor)
	}
	return s + " (and its trajectory steps and shells as long as it lives)"
}

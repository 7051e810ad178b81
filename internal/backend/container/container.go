// Package container is the sandbox backend that runs each sandbox as an OCI
// container through runc: namespaces (pid, mount, ipc, uts, a private network
// namespace with loopback only) and cgroup v1/v2 limits, with the sandbox's
// layers composed by overlayfs on the host and the guest agent as PID 1.
//
// Lifecycle of one sandbox:
//
//   - Create mounts the overlay root (layers + a private upper under
//     Spec.Dir), opens the agent's listening unix socket on the host, writes an
//     OCI bundle and runs `runc run --detach`, handing the listening socket to
//     the agent as fd 3. When Create returns the socket already accepts
//     connections (they queue in the backlog until the agent accepts).
//   - There is no shim: once runc exits the container's init is reparented,
//     so sandboxes keep running when the node process dies; Recover asks runc
//     for the state of a container described by a persisted Handle.
//   - Delete SIGKILLs every task of the container's cgroup, waits for them to
//     exit (pidfd), lets runc delete its state, unmounts the root and checks
//     that no cgroup directory is left. It is idempotent.
//
// A Backend holds no mutable state: it is safe for concurrent use, and two
// calls for different sandboxes never contend. Calls for the same sandbox
// must be serialized by the caller (the node's sandbox manager).
package container

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// Name is the backend name, as stored in sandbox.Handle.Backend.
const Name = "container"

// Defaults for Config and for a zero sandbox.Resources.
const (
	DefaultRuntime      = "runc"
	DefaultStateDir     = "/run/shoal/runc"
	DefaultCgroupParent = "shoal"
	DefaultMemoryBytes  = 512 << 20
	DefaultPids         = 1024
)

// Paths inside Spec.Dir, and the agent's place in the container.
const (
	rootfsDir    = "rootfs"
	upperDir     = "upper"
	workDir      = "work"
	bundleDir    = "bundle"
	socketName   = "agent.sock"
	agentLogName = "agent.log"
	pidFileName  = "init.pid"
	agentPath    = "/.shoal/agent"
)

// Config configures a Backend. The zero value is usable.
type Config struct {
	// Runtime is the OCI runtime binary (a name looked up in PATH, or a
	// path); runc's command line is assumed. Default "runc".
	Runtime string
	// StateDir is the runtime's state directory (runc --root). Default
	// /run/shoal/runc. It must outlive the node process (not a temp dir
	// removed on exit) for Recover to work.
	StateDir string
	// CgroupParent is the cgroup under which every sandbox gets its own
	// "<CgroupParent>/<id>", taken from the root of every hierarchy (like
	// docker's --cgroup-parent), not from the node's own cgroup: a service
	// manager stopping the node must not kill its sandboxes. Default "shoal".
	CgroupParent string
	// Log receives the backend's logs; nil discards them.
	Log *slog.Logger
}

// Validate checks the configuration without touching the system.
func (c Config) Validate() error {
	if c.StateDir != "" && !filepath.IsAbs(c.StateDir) {
		return fmt.Errorf("container backend: state dir %q must be an absolute path", c.StateDir)
	}
	p := strings.Trim(c.CgroupParent, "/")
	for _, part := range strings.Split(p, "/") {
		if part == "." || part == ".." {
			return fmt.Errorf("container backend: cgroup parent %q has a \".\" or \"..\" element", c.CgroupParent)
		}
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.Runtime == "" {
		c.Runtime = DefaultRuntime
	}
	if c.StateDir == "" {
		c.StateDir = DefaultStateDir
	}
	if strings.Trim(c.CgroupParent, "/") == "" {
		c.CgroupParent = DefaultCgroupParent
	}
	c.CgroupParent = strings.Trim(filepath.Clean("/"+c.CgroupParent), "/")
	if c.Log == nil {
		c.Log = slog.New(slog.DiscardHandler)
	}
	return c
}

// Backend runs sandboxes as runc containers. Create one with New.
type Backend struct {
	runtime      string // absolute path of the runtime binary
	stateDir     string
	cgroupParent string // relative to each hierarchy's root, no leading or trailing slash
	log          *slog.Logger
}

var _ sandbox.Backend = (*Backend)(nil)

// New checks that the runtime answers `--version`, creates the state
// directory and returns a Backend.
func New(cfg Config) (*Backend, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	bin, err := exec.LookPath(cfg.Runtime)
	if err != nil {
		return nil, fmt.Errorf("container backend: find runtime %q: %w", cfg.Runtime, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, bin, "--version").CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("container backend: %s --version: %w: %s", bin, err, bytes.TrimSpace(out))
	}
	if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
		return nil, fmt.Errorf("container backend: create state dir: %w", err)
	}
	version, _, _ := strings.Cut(string(out), "\n")
	cfg.Log.Debug("container backend ready", "runtime", bin, "version", version, "state_dir", cfg.StateDir)
	return &Backend{runtime: bin, stateDir: cfg.StateDir, cgroupParent: cfg.CgroupParent, log: cfg.Log}, nil
}

// Name returns "container".
func (b *Backend) Name() string { return Name }

// Capabilities: layers must be mounted on the host (they become overlay lowers).
func (b *Backend) Capabilities() sandbox.Capabilities {
	return sandbox.Capabilities{HostLayerMounts: true}
}

// runc's container IDs are [\w+-.]+; we also require a leading alphanumeric
// so that an ID is never "." or ".." in a path.
var validID = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}$`)

func checkID(id string) error {
	if !validID.MatchString(id) {
		return fmt.Errorf("container backend: invalid sandbox id %q (want 1-128 of [A-Za-z0-9_.+-], starting alphanumeric)", id)
	}
	return nil
}

func checkSpec(spec sandbox.Spec) error {
	if err := checkID(spec.ID); err != nil {
		return err
	}
	if spec.Dir == "" {
		return errors.New("container backend: spec has no state dir")
	}
	if len(spec.Layers) == 0 {
		return errors.New("container backend: spec has no layers")
	}
	for i, l := range spec.Layers {
		if l.MountPath == "" {
			return fmt.Errorf("container backend: layer %d (%s) is not mounted on the host", i, l.Digest)
		}
		if !filepath.IsAbs(l.MountPath) {
			return fmt.Errorf("container backend: layer %d mount path %q is not absolute", i, l.MountPath)
		}
		if strings.ContainsAny(l.MountPath, ",:\x00") {
			// Not needed with lowerdir+, but such paths break every other tool.
			return fmt.Errorf("container backend: layer %d mount path %q contains ',' or ':'", i, l.MountPath)
		}
	}
	if spec.AgentBinary == "" {
		return errors.New("container backend: spec has no agent binary")
	}
	if spec.Network {
		return fmt.Errorf("container backend: network access: %w", sandbox.ErrUnsupported)
	}
	for _, kv := range spec.Env {
		if k, _, ok := strings.Cut(kv, "="); !ok || k == "" || strings.ContainsRune(kv, 0) {
			return fmt.Errorf("container backend: env entry %q is not KEY=value", kv)
		}
	}
	return nil
}

// Create starts a sandbox; see the package comment. On failure every step
// already done is undone, in reverse order. ctx bounds only the creation;
// without a deadline sandbox.DefaultStartTimeout applies.
func (b *Backend) Create(ctx context.Context, spec sandbox.Spec) (h sandbox.Handle, err error) {
	if err := checkSpec(spec); err != nil {
		return h, err
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, sandbox.DefaultStartTimeout)
		defer cancel()
	}
	dir, err := filepath.Abs(spec.Dir)
	if err != nil {
		return h, fmt.Errorf("container backend: %w", err)
	}
	log := b.log.With("sandbox_id", spec.ID)
	rootfs := filepath.Join(dir, rootfsDir)
	// Refuse before doing anything that the undo steps would tear down: an
	// existing sandbox of that ID or that root must survive a repeated Create.
	if b.hasState(spec.ID) {
		return h, fmt.Errorf("create sandbox %s: a container with this id exists", spec.ID)
	}
	if mounted, err := isOverlayMount(rootfs); err != nil {
		return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
	} else if mounted {
		return h, fmt.Errorf("create sandbox %s: %s is already mounted", spec.ID, rootfs)
	}
	var undo undoStack
	defer func() {
		if err != nil {
			undo.run(log)
		}
	}()

	upper := filepath.Join(dir, upperDir)
	work := filepath.Join(dir, workDir)
	bundle := filepath.Join(dir, bundleDir)
	for _, d := range []string{rootfs, upper, work, bundle} {
		if err := os.Mkdir(d, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
		}
	}

	// 1. The root: overlay of the layers and the private upper.
	lowers := make([]string, len(spec.Layers))
	for i, l := range spec.Layers {
		lowers[i] = l.MountPath
	}
	if err := layer.Compose(rootfs, lowers, upper, work, true); err != nil {
		return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
	}
	undo.push("unmount rootfs", func() error { return layer.Unmount(rootfs) })
	if err := ensureTmp(rootfs); err != nil {
		return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
	}

	// 2. The agent's socket, listening before the agent exists.
	sock := filepath.Join(dir, socketName)
	lnFile, err := listenAgent(sock)
	if err != nil {
		return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
	}
	defer lnFile.Close() // the host's copy; the agent keeps its own
	undo.push("remove agent socket", func() error { return removeIfExists(sock) })

	// 3. The OCI bundle.
	cfg, err := b.ociSpec(spec, rootfs)
	if err != nil {
		return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
	}
	if err := writeJSON(filepath.Join(bundle, "config.json"), cfg); err != nil {
		return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
	}

	// 4. runc run --detach. The container's stdio is runc's stdio.
	devNull, err := os.Open(os.DevNull)
	if err != nil {
		return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
	}
	defer devNull.Close()
	agentLog, err := os.OpenFile(filepath.Join(dir, agentLogName), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o640)
	if err != nil {
		return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
	}
	defer agentLog.Close()
	logStart, _ := agentLog.Seek(0, io.SeekEnd)

	// runc may leave a half-created container behind when it fails or is
	// killed: undo by the same path as Delete, with its own time budget.
	undo.push("destroy container", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		return b.destroy(ctx, spec.ID)
	})
	cmd := b.runc(ctx, "run", "--detach", "--bundle", bundle, "--preserve-fds", "1",
		"--pid-file", filepath.Join(dir, pidFileName), spec.ID)
	cmd.Stdin = devNull
	cmd.Stdout = agentLog
	cmd.Stderr = agentLog
	cmd.ExtraFiles = []*os.File{lnFile} // fd 3 in runc, preserved for the agent
	if err := cmd.Run(); err != nil {
		return h, fmt.Errorf("create sandbox %s: runc run: %w: %s", spec.ID, err, tail(agentLog.Name(), logStart))
	}

	log.Debug("sandbox created", "rootfs", rootfs)
	return sandbox.Handle{
		ID:          spec.ID,
		Backend:     Name,
		AgentSocket: sock,
		Data:        map[string]string{"rootfs": rootfs, "bundle": bundle, "dir": dir},
	}, nil
}

// Recover reports whether the container of h still runs: StatusRunning
// (running or paused), StatusStopped (its init is gone, it never started, or
// its overlay root is no longer mounted on the host), or sandbox.ErrNotFound
// when the runtime has no such container.
func (b *Backend) Recover(ctx context.Context, h sandbox.Handle) (sandbox.Status, error) {
	if err := checkID(h.ID); err != nil {
		return "", err
	}
	if !b.hasState(h.ID) {
		return "", fmt.Errorf("recover sandbox %s: %w", h.ID, sandbox.ErrNotFound)
	}
	var stdout, stderr bytes.Buffer
	cmd := b.runc(ctx, "state", h.ID)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		if !b.hasState(h.ID) {
			return "", fmt.Errorf("recover sandbox %s: %w", h.ID, sandbox.ErrNotFound)
		}
		return "", fmt.Errorf("recover sandbox %s: runc state: %w: %s", h.ID, err, bytes.TrimSpace(stderr.Bytes()))
	}
	var st struct {
		Status string `json:"status"`
	}
	if err := json.Unmarshal(stdout.Bytes(), &st); err != nil {
		return "", fmt.Errorf("recover sandbox %s: parse runc state: %w", h.ID, err)
	}
	switch st.Status {
	case "running", "paused":
	case "created", "stopped":
		return sandbox.StatusStopped, nil
	default:
		return "", fmt.Errorf("recover sandbox %s: unknown runc status %q", h.ID, st.Status)
	}
	if rootfs := h.Data["rootfs"]; rootfs != "" {
		mounted, err := isOverlayMount(rootfs)
		if err != nil {
			return "", fmt.Errorf("recover sandbox %s: %w", h.ID, err)
		}
		if !mounted {
			b.log.Warn("sandbox runs but its root is not mounted on the host", "sandbox_id", h.ID, "rootfs", rootfs)
			return sandbox.StatusStopped, nil
		}
	}
	return sandbox.StatusRunning, nil
}

// Delete kills the sandbox's processes and removes its container, root
// mount, cgroups and socket. A sandbox that is already (partly) gone is not
// an error. ctx bounds the wait for the processes to exit.
func (b *Backend) Delete(ctx context.Context, h sandbox.Handle) error {
	if err := checkID(h.ID); err != nil {
		return err
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, sandbox.DefaultStartTimeout)
		defer cancel()
	}
	var errs []error
	if err := b.destroy(ctx, h.ID); err != nil {
		errs = append(errs, err)
	}
	rootfs := h.Data["rootfs"]
	if rootfs == "" && h.Data["dir"] != "" {
		rootfs = filepath.Join(h.Data["dir"], rootfsDir)
	}
	if rootfs != "" {
		if err := layer.Unmount(rootfs); err != nil {
			errs = append(errs, err)
		}
	}
	if h.AgentSocket != "" {
		if err := removeIfExists(h.AgentSocket); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("delete sandbox %s: %w", h.ID, err)
	}
	b.log.Debug("sandbox deleted", "sandbox_id", h.ID)
	return nil
}

// destroy kills the container's tasks, deletes its runtime state and checks
// its cgroups are gone.
func (b *Backend) destroy(ctx context.Context, id string) error {
	if err := b.killCgroup(ctx, id); err != nil {
		// Fall back on the runtime, which freezes, signals and waits itself.
		b.log.Warn("kill via cgroup", "sandbox_id", id, "err", err)
	}
	if b.hasState(id) {
		var stderr bytes.Buffer
		cmd := b.runc(ctx, "delete", "--force", id)
		cmd.Stderr = &stderr
		if err := cmd.Run(); err != nil && b.hasState(id) {
			return fmt.Errorf("runc delete: %w: %s", err, bytes.TrimSpace(stderr.Bytes()))
		}
	}
	return b.removeCgroups(id)
}

// hasState reports whether the runtime has state for id.
func (b *Backend) hasState(id string) bool {
	_, err := os.Stat(filepath.Join(b.stateDir, id, "state.json"))
	return err == nil
}

// runc returns a runtime command in its own process group (a Ctrl-C of the
// node must not reach it, nor the container it starts) with no stdio of ours.
func (b *Backend) runc(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, b.runtime, append([]string{"--root", b.stateDir}, args...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

// listenAgent binds a listening unix socket at path and returns it as a file
// (for the agent); the listener itself is closed without unlinking the path.
func listenAgent(path string) (*os.File, error) {
	if len(path) > len(unix.RawSockaddrUnix{}.Path)-1 {
		return nil, fmt.Errorf("agent socket path %s is longer than %d bytes: use a shorter sandbox dir", path, len(unix.RawSockaddrUnix{}.Path)-1)
	}
	if err := removeIfExists(path); err != nil {
		return nil, err
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("listen on agent socket: %w", err)
	}
	ln.SetUnlinkOnClose(false)
	f, err := ln.File()
	ln.Close()
	if err != nil {
		os.Remove(path)
		return nil, fmt.Errorf("listen on agent socket: %w", err)
	}
	return f, nil
}

// ensureTmp gives the root a world-writable /tmp in its upper layer when no
// layer has one.
func ensureTmp(rootfs string) error {
	p := filepath.Join(rootfs, "tmp")
	if _, err := os.Lstat(p); err == nil {
		return nil
	}
	if err := os.Mkdir(p, 0o755); err != nil {
		return fmt.Errorf("create /tmp: %w", err)
	}
	if err := os.Chmod(p, 0o777|os.ModeSticky); err != nil {
		return fmt.Errorf("create /tmp: %w", err)
	}
	return nil
}

func writeJSON(path string, v any) error {
	data, err := json.MarshalIndent(v, "", "\t")
	if err != nil {
		return fmt.Errorf("encode %s: %w", filepath.Base(path), err)
	}
	if err := os.WriteFile(path, data, 0o600); err != nil {
		return fmt.Errorf("write %s: %w", filepath.Base(path), err)
	}
	return nil
}

func removeIfExists(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// tail returns what was appended to the file at path since offset (at most
// 4 KiB of its end), for error messages.
func tail(path string, offset int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return ""
	}
	const max = 4 << 10
	if fi.Size()-offset > max {
		offset = fi.Size() - max
	}
	b, _ := io.ReadAll(io.NewSectionReader(f, offset, fi.Size()-offset))
	return strings.TrimSpace(string(b))
}

// undoStack holds the undo steps of a creation.
type undoStack struct {
	steps []undoStep
}

type undoStep struct {
	what string
	fn   func() error
}

func (u *undoStack) push(what string, fn func() error) {
	u.steps = append(u.steps, undoStep{what, fn})
}

// run runs the steps in reverse order, logging (and skipping past) failures.
func (u *undoStack) run(log *slog.Logger) {
	for i := len(u.steps) - 1; i >= 0; i-- {
		if err := u.steps[i].fn(); err != nil {
			log.Error("undo failed create", "step", u.steps[i].what, "err", err)
		}
	}
	u.steps = nil
}

package microvm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/procfs"
	"github.com/shoal-sandbox/shoal/internal/reclaim"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// Pause and resume: a paused VM is a snapshot and no process. Pause stops
// the guest, has QEMU write its whole state (memory and devices) to
// stateFile in the sandbox's directory (a migration to a file descriptor
// passed over QMP: QEMU may not spawn, so no exec: URIs) and kills QEMU.
// Resume starts a new QEMU with the same command line waiting for an
// incoming migration, feeds it the file, continues the guest and waits for
// its agent; the new QEMU is another process, so it returns a new handle.
// The agent channel's FIFOs are the same: the host's next session begins
// with a handshake, which ends the one the guest had before the pause.
//
// A sandbox is paused when its QEMU is gone and its stateFile exists. The
// snapshot is written to stateFile+".tmp" and renamed when complete: a
// node that dies in the middle leaves the VM running (Recover continues a
// guest whose snapshot was complete but whose QEMU was not yet killed).

//
// Paused in place (Config.Pause PauseInPlace), a VM keeps its QEMU: Pause
// stops its vCPUs (QMP stop) and pages QEMU's private memory (the guest's
// RAM, QEMU's own heap and its TCG translation cache) out to swap, which
// zram keeps compressed (internal/reclaim); Resume continues it (QMP
// cont). No QEMU start, no restore, no translation again: a resume costs
// the page faults that bring back what the guest touches. The host keeps
// the compressed memory (without swap, all of it). The mark stoppedFile,
// made before the stop and removed after the cont, tells such a VM from a
// running one (Recover: StatusPaused).

var (
	_ sandbox.Pauser  = (*Backend)(nil)
	_ sandbox.Evicter = (*Backend)(nil)
)

const (
	stateFile   = "vm.state"
	stoppedFile = "vm.stopped"
)

// How a VM is paused (Config.Pause).
const (
	PauseSnapshot = "snapshot" // its state to a file, QEMU ended
	PauseInPlace  = "in-place" // QEMU stopped, its memory paged out
)

// maxPrefetch bounds the working set a resume in place reads back before
// the guest runs: past it, the pause found most of the guest's memory in
// use (its first after a boot) and the resume faults in what it touches.
const maxPrefetch = 96 << 20

// migrateBandwidth lifts QEMU's default migration limit (32 MiB/s): the
// stream goes to a local file.
const migrateBandwidth = 64 << 30

// Pause implements sandbox.Pauser.
func (b *Backend) Pause(ctx context.Context, h sandbox.Handle) (sandbox.PauseStats, error) {
	stats := sandbox.PauseStats{MemoryBefore: -1, MemoryAfter: 0, Method: "snapshot"}
	dir := h.Data["dir"]
	state := filepath.Join(dir, stateFile)
	pid := process(h)
	if pid == 0 {
		if paused(h) {
			return stats, nil // paused already
		}
		return stats, fmt.Errorf("%s backend: sandbox %s: its QEMU is not running", b.cfg.Name, h.ID)
	}
	if stoppedInPlace(h) {
		stats.Method = "in place"
		return stats, nil // paused already
	}
	if b.cfg.Pause == PauseInPlace {
		return b.pauseInPlace(ctx, h, pid)
	}
	// Resumable: its handle says how to start it again (not so for a VM
	// created by a node before pause existed).
	if _, err := b.qemuArgs(h); err != nil {
		return stats, fmt.Errorf("%w: %w", err, sandbox.ErrUnsupported)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, 3*time.Minute)
		defer cancel()
	}
	stats.MemoryBefore = rss(pid)
	start := time.Now()
	q, err := dialQMP(ctx, filepath.Join(dir, "qmp.sock"))
	if err != nil {
		return stats, err
	}
	defer q.Close()
	if err := q.run("stop", nil, nil); err != nil {
		return stats, err
	}
	stats.FreezeTook = time.Since(start)
	start = time.Now()
	if err := b.snapshot(ctx, q, state, h.Data["pmem"] != ""); err != nil {
		// Running again as it was; the partial file goes.
		q.c.SetDeadline(time.Now().Add(5 * time.Second))
		if cerr := q.run("cont", nil, nil); cerr != nil {
			b.log.Error("continue a VM after a failed snapshot", "sandbox_id", h.ID, "err", cerr)
		}
		os.Remove(state + ".tmp")
		return stats, fmt.Errorf("%s backend: snapshot of sandbox %s: %w", b.cfg.Name, h.ID, err)
	}
	b.endSnapshotted(ctx, h, pid, state, start, &stats)
	return stats, nil
}

// endSnapshotted ends the QEMU pid of h once its state is in the snapshot
// file state, and completes stats of the pause (or eviction) that began
// at start.
func (b *Backend) endSnapshotted(ctx context.Context, h sandbox.Handle, pid int, state string, start time.Time, stats *sandbox.PauseStats) {
	if err := kill(ctx, pid); err != nil {
		// Paused in the file; the stopped QEMU goes with the next Delete
		// or Resume (which kills what the pidfile names).
		b.log.Warn("kill a snapshotted VM", "sandbox_id", h.ID, "err", err)
	}
	// After the kill: a handshake in flight on the stopped guest holds
	// the channel's lock until its read fails, which QEMU's end makes it.
	b.dropMux(h.ID)
	stats.ReclaimTook = time.Since(start)
	// What left memory went to the node's disk: the snapshot's size.
	if fi, err := os.Stat(state); err == nil {
		stats.SwappedOut = fi.Size()
	}
}

// snapshot writes the stopped VM's state to path (through path.tmp);
// shared leaves its shared file-backed memory (pmem layers) out.
func (b *Backend) snapshot(ctx context.Context, q *qmpConn, path string, shared bool) error {
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := q.run("migrate-set-parameters", map[string]any{"max-bandwidth": migrateBandwidth}, nil); err != nil {
		return err
	}
	if err := ignoreShared(q, shared); err != nil {
		return err
	}
	if err := q.runFD("getfd", map[string]any{"fdname": "state"}, f, nil); err != nil {
		return err
	}
	if err := q.run("migrate", map[string]any{"uri": "fd:state"}, nil); err != nil {
		return err
	}
	for {
		var mi struct {
			Status    string `json:"status"`
			ErrorDesc string `json:"error-desc"`
		}
		if err := q.run("query-migrate", nil, &mi); err != nil {
			return err
		}
		switch mi.Status {
		case "completed":
			if err := f.Sync(); err != nil {
				return err
			}
			return os.Rename(tmp, path)
		case "failed", "cancelled":
			return fmt.Errorf("migration %s: %s", mi.Status, mi.ErrorDesc)
		}
		select {
		case <-ctx.Done():
			q.c.SetDeadline(time.Now().Add(5 * time.Second))
			q.run("migrate_cancel", nil, nil)
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// Resume implements sandbox.Pauser.
func (b *Backend) Resume(ctx context.Context, h sandbox.Handle) (sandbox.Handle, error) {
	if process(h) != 0 {
		if stoppedInPlace(h) {
			return b.resumeInPlace(ctx, h)
		}
		return h, nil
	}
	dir := h.Data["dir"]
	if dir == "" {
		return h, fmt.Errorf("%s backend: sandbox %s: its handle does not describe a VM", b.cfg.Name, h.ID)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, 3*time.Minute)
		defer cancel()
	}
	state := filepath.Join(dir, stateFile)
	f, err := os.OpenFile(state, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errors.Is(err, os.ErrNotExist) {
		// A resume that ended (the snapshot is gone) before the node
		// persisted its handle: the QEMU it started is the VM.
		if pid := pidfileProcess(dir); pid != 0 {
			nh := withPid(h, pid)
			if err := b.waitAgent(ctx, nh, nil); err != nil {
				return h, fmt.Errorf("%s backend: resume sandbox %s: %w", b.cfg.Name, h.ID, err)
			}
			return nh, nil
		}
	}
	if err != nil {
		return h, fmt.Errorf("%s backend: resume sandbox %s: no snapshot: %w", b.cfg.Name, h.ID, err)
	}
	defer f.Close()
	if pad := h.Data["pmem_pad"]; pad != "" {
		// Its pmem layers' pad, as it was (made again if it went).
		if _, err := makePad(filepath.Dir(pad)); err != nil {
			return h, fmt.Errorf("%s backend: resume sandbox %s: %w", b.cfg.Name, h.ID, err)
		}
	}
	b.dropMux(h.ID)
	// A QEMU a resume started before the node died.
	if err := kill(ctx, pidfileProcess(dir)); err != nil {
		return h, err
	}
	start := time.Now()
	nh, err := b.startFrom(ctx, h, f)
	if err != nil {
		return h, fmt.Errorf("%s backend: resume sandbox %s: %w", b.cfg.Name, h.ID, err)
	}
	if err := os.Remove(state); err != nil {
		b.log.Warn("remove a resumed VM's snapshot", "sandbox_id", h.ID, "err", err)
	}
	b.log.Debug("vm resumed", "sandbox_id", h.ID, "took", time.Since(start))
	return nh, nil
}

// startFrom starts a QEMU of h that restores the snapshot f (a pause's
// or a template's), continues the guest and waits for its agent. On
// failure the QEMU is ended and the error quotes its console.
func (b *Backend) startFrom(ctx context.Context, h sandbox.Handle, f *os.File) (sandbox.Handle, error) {
	nh, exited, err := b.start(h, "-incoming", "defer")
	if err != nil {
		return h, err
	}
	if err := b.restore(ctx, nh, f, exited); err != nil {
		dir := h.Data["dir"]
		err = fmt.Errorf("%w%s", err, b.console(filepath.Join(dir, "qmp.sock"), dir, exited, ""))
		if kerr := kill(context.Background(), process(nh)); kerr != nil {
			b.log.Error("kill a VM whose restore failed", "sandbox_id", h.ID, "err", kerr)
		}
		b.dropMux(h.ID)
		return h, err
	}
	return nh, nil
}

// restore feeds the snapshot f to the new QEMU of h, continues the guest
// and waits for its agent.
func (b *Backend) restore(ctx context.Context, h sandbox.Handle, f *os.File, exited <-chan struct{}) error {
	t0 := time.Now()
	var qmpUp, loaded time.Duration
	defer func() {
		b.log.Debug("vm restore", "sandbox_id", h.ID, "qmp_up", qmpUp, "state_loaded", loaded, "total", time.Since(t0))
	}()
	sock := filepath.Join(h.Data["dir"], "qmp.sock")
	var q *qmpConn
	for {
		// The old QEMU's socket file is there until the new one replaces it.
		var err error
		if q, err = dialQMP(ctx, sock); err == nil {
			break
		}
		select {
		case <-exited:
			return errors.New("qemu exited")
		case <-ctx.Done():
			return fmt.Errorf("qmp: %w", ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
	defer q.Close()
	qmpUp = time.Since(t0)
	if err := q.runFD("getfd", map[string]any{"fdname": "state"}, f, nil); err != nil {
		return err
	}
	if err := ignoreShared(q, h.Data["pmem"] != ""); err != nil {
		return err
	}
	if err := q.run("migrate-incoming", map[string]any{"uri": "fd:state"}, nil); err != nil {
		return err
	}
	for {
		var st struct {
			Status string `json:"status"`
		}
		if err := q.run("query-status", nil, &st); err != nil {
			return err // a failed restore ends QEMU
		}
		if st.Status == "running" {
			break
		}
		if st.Status != "inmigrate" {
			if err := q.run("cont", nil, nil); err != nil {
				return err
			}
			break
		}
		select {
		case <-exited:
			return errors.New("qemu exited while restoring the snapshot")
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	loaded = time.Since(t0)
	return b.waitAgent(ctx, h, exited)
}

// ignoreShared sets the x-ignore-shared migration capability when on: the
// layers mapped as pmem (shared, read-only file memory) stay out of a
// snapshot, and a restore maps the same files again (pmem.go). Both ends
// must agree: the stream's layout depends on it.
func ignoreShared(q *qmpConn, on bool) error {
	if !on {
		return nil
	}
	return q.run("migrate-set-capabilities", map[string]any{"capabilities": []map[string]any{
		{"capability": "x-ignore-shared", "state": true}}}, nil)
}

// pauseInPlace stops the guest of the QEMU pid and pages its memory out.
func (b *Backend) pauseInPlace(ctx context.Context, h sandbox.Handle, pid int) (sandbox.PauseStats, error) {
	stats := sandbox.PauseStats{MemoryBefore: rss(pid), MemoryAfter: -1, Method: "in place: process_madvise"}
	dir := h.Data["dir"]
	mark := filepath.Join(dir, stoppedFile)
	// The mark first: a node that dies once the guest is stopped finds it.
	f, err := os.OpenFile(mark, os.O_CREATE|os.O_WRONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return stats, fmt.Errorf("%s backend: pause sandbox %s: %w", b.cfg.Name, h.ID, err)
	}
	f.Close()
	start := time.Now()
	if err := qmp(ctx, filepath.Join(dir, "qmp.sock"), "stop", nil, nil); err != nil {
		os.Remove(mark)
		return stats, fmt.Errorf("%s backend: pause sandbox %s: %w", b.cfg.Name, h.ID, err)
	}
	stats.FreezeTook = time.Since(start)
	start = time.Now()
	// What the guest touched since the last pause (or its boot): the
	// resume reads it back before the guest runs.
	ws, err := reclaim.Resident(pid, maxPrefetch)
	if err != nil {
		b.log.Warn("read the working set of a VM paused in place", "sandbox_id", h.ID, "err", err)
	}
	b.mu.Lock()
	b.working[h.ID] = ws
	b.mu.Unlock()
	// Failing to page out leaves it paused, its memory where it was. The
	// TCG translation cache stays if the guest ran since the pause before
	// (its working set is known): what is in memory of it then is what
	// the guest ran since, and what a resume runs first. On the first
	// pause after a boot (or a restart of the node), it holds the boot's
	// code: out it goes, with the rest.
	stats.FilePagesOnly = reclaim.FilePagesOnly()
	if ws.Bytes() > 0 {
		_, err = reclaim.PageOutKeepingJIT(pid)
	} else {
		_, err = reclaim.Process(pid, reclaim.PageOut)
	}
	if err != nil {
		stats.Method += ": " + err.Error()
		b.log.Warn("page out the memory of a VM paused in place", "sandbox_id", h.ID, "err", err)
	}
	stats.ReclaimTook = time.Since(start)
	stats.MemoryAfter = rss(pid)
	stats.SwappedOut = procStatusBytes(pid, "VmSwap:")
	return stats, nil
}

// Evict implements sandbox.Evicter: a VM paused in place is snapshotted
// as Pause would have (its stopped guest's state to stateFile) and its
// QEMU ended, so that its memory leaves the host: memory pressure. The
// snapshot reads the guest's RAM back from swap first (QEMU's RSS grows
// for the time it takes). A VM paused by a snapshot has nothing to move.
func (b *Backend) Evict(ctx context.Context, h sandbox.Handle) (sandbox.PauseStats, bool, error) {
	stats := sandbox.PauseStats{MemoryBefore: -1, MemoryAfter: 0, Method: "snapshot"}
	pid := process(h)
	if pid == 0 || !stoppedInPlace(h) {
		return stats, false, nil
	}
	if _, err := b.qemuArgs(h); err != nil {
		// Its handle does not say how to start it again: a snapshot
		// could not be resumed. It stays paused in place.
		return stats, false, nil
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, 3*time.Minute)
		defer cancel()
	}
	stats.MemoryBefore = rss(pid)
	dir := h.Data["dir"]
	q, err := dialQMP(ctx, filepath.Join(dir, "qmp.sock"))
	if err != nil {
		return stats, false, err
	}
	defer q.Close()
	start := time.Now()
	state := filepath.Join(dir, stateFile)
	if err := b.snapshot(ctx, q, state, h.Data["pmem"] != ""); err != nil {
		os.Remove(state + ".tmp")
		return stats, false, fmt.Errorf("%s backend: snapshot of sandbox %s paused in place: %w", b.cfg.Name, h.ID, err)
	}
	// Paused by a snapshot now. The mark goes before the kill: a node that
	// dies in between finds a QEMU with a complete snapshot, as after a
	// pause's, and continues it (Recover).
	if err := os.Remove(filepath.Join(dir, stoppedFile)); err != nil && !errors.Is(err, os.ErrNotExist) {
		os.Remove(state) // still paused in place only
		return stats, false, fmt.Errorf("%s backend: evict sandbox %s: %w", b.cfg.Name, h.ID, err)
	}
	b.mu.Lock()
	delete(b.working, h.ID) // its new QEMU has another
	b.mu.Unlock()
	b.endSnapshotted(ctx, h, pid, state, start, &stats)
	return stats, true, nil
}

// resumeInPlace continues a guest paused in place and waits for its agent.
func (b *Backend) resumeInPlace(ctx context.Context, h sandbox.Handle) (sandbox.Handle, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, time.Minute)
		defer cancel()
	}
	start := time.Now()
	b.mu.Lock()
	ws := b.working[h.ID]
	delete(b.working, h.ID)
	b.mu.Unlock()
	// The working set comes back from swap on the other CPUs while the
	// guest starts: what it touches before is read then, as without.
	prefetched := make(chan time.Duration, 1)
	go func() {
		if _, err := reclaim.Prefetch(process(h), ws); err != nil {
			b.log.Warn("prefetch the working set of a VM paused in place", "sandbox_id", h.ID, "err", err)
		}
		prefetched <- time.Since(start)
	}()
	dir := h.Data["dir"]
	if err := qmp(ctx, filepath.Join(dir, "qmp.sock"), "cont", nil, nil); err != nil {
		<-prefetched
		return h, fmt.Errorf("%s backend: resume sandbox %s: %w", b.cfg.Name, h.ID, err)
	}
	if err := os.Remove(filepath.Join(dir, stoppedFile)); err != nil && !errors.Is(err, os.ErrNotExist) {
		b.log.Warn("remove the mark of a VM paused in place", "sandbox_id", h.ID, "err", err)
	}
	err := b.waitAgent(ctx, h, nil)
	took := <-prefetched
	if err != nil {
		return h, fmt.Errorf("%s backend: resume sandbox %s: %w", b.cfg.Name, h.ID, err)
	}
	b.log.Debug("vm resumed in place", "sandbox_id", h.ID, "took", time.Since(start), "prefetched", ws.Bytes(), "prefetch_took", took)
	return h, nil
}

// stoppedInPlace tells whether h was paused in place (its mark is there;
// its QEMU, if it still runs, is stopped).
func stoppedInPlace(h sandbox.Handle) bool {
	if h.Data["dir"] == "" {
		return false
	}
	_, err := os.Lstat(filepath.Join(h.Data["dir"], stoppedFile))
	return err == nil
}

// paused tells whether h has a snapshot (if its QEMU is gone too, it is
// paused).
func paused(h sandbox.Handle) bool {
	if h.Data["dir"] == "" {
		return false
	}
	_, err := os.Lstat(filepath.Join(h.Data["dir"], stateFile))
	return err == nil
}

// dropMux ends the host's session on a sandbox's agent channel: the next
// request begins a new one (with a new QEMU).
func (b *Backend) dropMux(id string) {
	b.mu.Lock()
	m := b.muxes[id]
	b.mu.Unlock()
	if m != nil {
		m.close()
	}
}

// rss is the resident memory of a process in bytes (-1 if unknown).
func rss(pid int) int64 { return procStatusBytes(pid, "VmRSS:") }

// procStatusBytes is a size field (key "VmRSS:", "VmSwap:") of a process's
// /proc/PID/status in bytes (-1 if unknown).
func procStatusBytes(pid int, key string) int64 {
	kib, ok := procfs.KiB("/proc/"+strconv.Itoa(pid)+"/status", key)
	if !ok {
		return -1
	}
	return kib << 10
}

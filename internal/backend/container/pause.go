package container

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/cgroups"
	"github.com/shoal-sandbox/shoal/internal/reclaim"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// Pause freezes the sandbox's cgroup (see Freeze) and then reclaims its
// memory while it is frozen: with cgroup v2's memory.reclaim where the
// sandbox has a v2 memory controller, else (cgroup v1) by
// process_madvise(MADV_PAGEOUT) over the private mappings of each of its
// processes, which the kernel pages out to swap (anonymous pages) or drops
// (clean file pages) as far as it can: pages shared with other processes,
// such as the guest agent's binary, stay. Without swap only file pages
// go. A reclaim that fails is logged and reported in the stats; the
// sandbox stays paused.
func (b *Backend) Pause(ctx context.Context, h sandbox.Handle) (sandbox.PauseStats, error) {
	st := sandbox.PauseStats{MemoryBefore: -1, MemoryAfter: -1}
	id, err := b.runcID(h)
	if err != nil {
		return st, err
	}
	mem := b.memoryCgroup(id)
	st.MemoryBefore = mem.usage()
	t := time.Now()
	if err := b.Freeze(ctx, h); err != nil {
		return st, err
	}
	st.FreezeTook = time.Since(t)
	t = time.Now()
	st.FilePagesOnly = reclaim.FilePagesOnly()
	method, err := b.reclaim(ctx, id, mem)
	st.ReclaimTook = time.Since(t)
	st.Method = method
	if err != nil {
		st.Method = method + ": " + err.Error()
		b.log.Warn("reclaim the memory of a paused sandbox", "sandbox_id", h.ID, "err", err)
	}
	st.MemoryAfter = mem.usage()
	st.SwappedOut = mem.swap()
	return st, nil
}

// Resume thaws the sandbox; with Config.ResumePrefetch, it first asks the
// kernel to read its swapped-out pages back (MADV_WILLNEED). The handle
// does not change.
func (b *Backend) Resume(ctx context.Context, h sandbox.Handle) (sandbox.Handle, error) {
	id, err := b.runcID(h)
	if err != nil {
		return h, err
	}
	if b.prefetch {
		if _, err := b.adviseCgroup(ctx, id, reclaim.WillNeed); err != nil {
			b.log.Warn("prefetch the memory of a paused sandbox", "sandbox_id", h.ID, "err", err)
		}
	}
	if err := b.Thaw(ctx, h); err != nil {
		return h, err
	}
	if mem := b.memoryCgroup(id); mem.v2 {
		// Swap was opened for the pause only (reclaim); what is swapped
		// out stays until touched, nothing more goes.
		writeIfExists(filepath.Join(mem.dir, "memory.swap.max"), "0")
	}
	return h, nil
}

// memCgroup is a sandbox's memory cgroup directory ("" if none).
type memCgroup struct {
	dir string
	v2  bool
}

func (b *Backend) memoryCgroup(runcID string) memCgroup {
	mounts, err := b.cgroupMounts()
	if err != nil {
		return memCgroup{}
	}
	for _, m := range mounts {
		dir := filepath.Join(m.dir, b.cgroupParent, runcID)
		if !m.v2 && slices.Contains(m.options, "memory") {
			return memCgroup{dir: dir}
		}
		if m.v2 && exists(filepath.Join(dir, "memory.current")) {
			return memCgroup{dir: dir, v2: true}
		}
	}
	return memCgroup{}
}

var readInt = cgroups.ReadInt

// usage is the cgroup's charged memory (page cache included), -1 if unknown.
func (c memCgroup) usage() int64 {
	switch {
	case c.dir == "":
		return -1
	case c.v2:
		return readInt(filepath.Join(c.dir, "memory.current"))
	}
	return readInt(filepath.Join(c.dir, "memory.usage_in_bytes"))
}

// swap is the cgroup's swapped-out memory, -1 if unknown.
func (c memCgroup) swap() int64 {
	switch {
	case c.dir == "":
		return -1
	case c.v2:
		return readInt(filepath.Join(c.dir, "memory.swap.current"))
	}
	sw := readInt(filepath.Join(c.dir, "memory.memsw.usage_in_bytes"))
	if sw < 0 {
		return -1
	}
	return sw - c.usage()
}

// reclaim reclaims the memory of the frozen sandbox runcID, one sandbox at
// a time (reclaimSlot): a reclaim already advises its ranges from several
// threads (splitRanges), and reclaims at once contend instead of adding up (`shoal bench pause -n 50 --mib 32 --pausers 2`:
// each pause 156–183 ms instead of 53–57, 1.86–1.90 s of wall time per GiB
// against 1.24–1.35 s one at a time, on 2 cores with zram); a pause
// waiting for its turn is frozen already.
func (b *Backend) reclaim(ctx context.Context, runcID string, mem memCgroup) (method string, err error) {
	select {
	case b.reclaimSlot <- struct{}{}:
		defer func() { <-b.reclaimSlot }()
	case <-ctx.Done():
		return "none", fmt.Errorf("waiting for another sandbox's reclaim: %w", ctx.Err())
	}
	if mem.v2 && exists(filepath.Join(mem.dir, "memory.reclaim")) {
		// The sandbox has no swap (memory.swap.max 0, see setLimits):
		// open it up to its memory limit for the pause, so that anonymous
		// pages can go too; Resume closes it again.
		if max, err := os.ReadFile(filepath.Join(mem.dir, "memory.max")); err == nil {
			writeIfExists(filepath.Join(mem.dir, "memory.swap.max"), strings.TrimSpace(string(max)))
		}
		u := mem.usage()
		if u <= 0 {
			return "memory.reclaim", nil
		}
		// The kernel gives up with EAGAIN when it reclaimed less than
		// asked: that is the end, not an error.
		if err := writeCgroup(filepath.Join(mem.dir, "memory.reclaim"), strconv.FormatInt(u, 10)); err != nil && !errors.Is(err, syscall.EAGAIN) {
			return "memory.reclaim", err
		}
		return "memory.reclaim", nil
	}
	_, err = b.adviseCgroup(ctx, runcID, reclaim.PageOut)
	if err != nil || mem.dir == "" || mem.v2 {
		return "process_madvise", err
	}
	// PAGEOUT skips pages mapped by more than one process (a shell and
	// the subshell it forked share their memory until written): cgroup
	// v1's memory.force_empty reclaims what is left through the cgroup's
	// LRU, shared pages and page cache too, stopping when nothing more
	// goes (kernel memory stays). Only what process_madvise left is
	// scanned, so it costs little when that was everything.
	if f := filepath.Join(mem.dir, "memory.force_empty"); exists(f) {
		if err := writeCgroup(f, "0"); err != nil {
			return "process_madvise", fmt.Errorf("memory.force_empty: %w", err)
		}
		return "process_madvise+force_empty", nil
	}
	return "process_madvise", nil
}

// cgroupPids lists the processes (thread group leaders) of the sandbox.
func (b *Backend) cgroupPids(runcID string) ([]int, error) {
	dirs, err := b.cgroupDirs(runcID)
	if err != nil {
		return nil, err
	}
	for _, dir := range dirs {
		data, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
		if err != nil {
			continue
		}
		var pids []int
		for _, f := range strings.Fields(string(data)) {
			if pid, err := strconv.Atoi(f); err == nil {
				pids = append(pids, pid)
			}
		}
		return pids, nil
	}
	return nil, fmt.Errorf("no cgroup.procs for container %s: %w", runcID, sandbox.ErrNotFound)
}

// adviseCgroup gives advice (MADV_PAGEOUT, MADV_WILLNEED) on the private
// mappings of every process of the sandbox, through pidfds (a pid reused
// meanwhile is not advised: the pidfd of the process read from the
// cgroup is checked to still be in it). It returns the bytes advised.
func (b *Backend) adviseCgroup(ctx context.Context, runcID string, advice int) (int64, error) {
	pids, err := b.cgroupPids(runcID)
	if err != nil {
		return 0, err
	}
	var total int64
	var errs []error
	for _, pid := range pids {
		if ctx.Err() != nil {
			return total, ctx.Err()
		}
		n, err := reclaim.Process(pid, advice)
		total += n
		if err != nil && !errors.Is(err, unix.ESRCH) {
			errs = append(errs, fmt.Errorf("pid %d: %w", pid, err))
		}
	}
	return total, errors.Join(errs...)
}

package node

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// Memory pressure.
//
// Auto-pause waits for each sandbox's own idle time; when the host's
// memory runs low that is too slow. Each second (Run), when the host's
// MemAvailable is below Pressure.Below, the node pauses (and so reclaims)
// running sandboxes with no running command, the longest idle first, one
// at a time, re-reading MemAvailable after each, until it is back above
// Below plus a quarter (so that it does not pause one sandbox per second
// around the threshold) or no sandbox idle for at least Pressure.MinIdle
// is left. Still short, it moves the memory of paused sandboxes that keep
// it on the host (a VM paused in place: sandbox.Evicter) off it, the
// longest paused first, the same way. A paused sandbox resumes on its
// next request, as always.
//
// MemAvailable can look fine while tasks already stall on memory (a host
// swapping to zram, or reclaiming page cache that is in use): the kernel's
// pressure stall information says so. When the share of time some task
// waited on memory over the last 10 s (/proc/pressure/memory, "some
// avg10") reaches Pressure.PSI, the node pauses up to psiBatch idle
// sandboxes, the longest idle first, then waits psiCooldown (the
// average's own window) before it judges again, so that one episode does
// not pause a sandbox a second while the average decays.

// Pressure configures the memory-pressure reclaim; the zero value is off.
type Pressure struct {
	// Below: reclaim while the host's MemAvailable is below this many
	// bytes; 0: never.
	Below int64
	// MinIdle: only sandboxes idle (no request, no running command) at
	// least this long are paused; 0: DefaultPressureMinIdle.
	MinIdle time.Duration
	// Available reads the host's MemAvailable (bytes); nil: /proc/meminfo.
	Available func() (int64, error)
	// PSI: reclaim also while the host's memory pressure (percent of the
	// last 10 s some task stalled on memory) is at least this; 0: never.
	PSI float64
	// Stall reads that pressure; nil: /proc/pressure/memory (no file: no
	// PSI on this kernel, never).
	Stall func() (float64, error)
}

const (
	psiBatch    = 4                // sandboxes paused per PSI round
	psiCooldown = 10 * time.Second // between PSI rounds (avg10's window)
)

// memoryStall reads "some avg10" of /proc/pressure/memory.
func memoryStall() (float64, error) {
	b, err := os.ReadFile("/proc/pressure/memory")
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || f[0] != "some" {
			continue
		}
		if v, ok := strings.CutPrefix(f[1], "avg10="); ok {
			return strconv.ParseFloat(v, 64)
		}
	}
	return 0, fmt.Errorf("/proc/pressure/memory: no some avg10 in %q", b)
}

// DefaultPressureMinIdle is Pressure.MinIdle when none is given.
const DefaultPressureMinIdle = time.Minute

func (p *Pressure) validate() error {
	if p.Below < 0 || p.MinIdle < 0 || p.PSI < 0 || p.PSI > 100 {
		return errors.New("node config: negative memory-pressure threshold or idle time, or a stall share outside 0-100%")
	}
	if p.MinIdle == 0 {
		p.MinIdle = DefaultPressureMinIdle
	}
	if p.Available == nil {
		p.Available = func() (int64, error) {
			_, avail, _, err := HostCapacity()
			return avail, err
		}
	}
	if p.Stall == nil {
		p.Stall = memoryStall
	}
	return nil
}

// checkPressure starts a reclaim round when the host's memory is low and
// none is running.
func (m *Manager) checkPressure() {
	p := m.cfg.Pressure
	low := false
	if p.Below > 0 {
		avail, err := p.Available()
		low = err == nil && avail < p.Below
	}
	stalled := 0.0
	if !low && p.PSI > 0 && p.Stall != nil && time.Since(time.Unix(0, m.lastStallRound.Load())) >= psiCooldown {
		if v, err := p.Stall(); err == nil && v >= p.PSI {
			stalled = v
		}
	}
	if !low && stalled == 0 {
		return
	}
	if !m.reclaiming.CompareAndSwap(false, true) {
		return
	}
	go func() {
		defer m.reclaiming.Store(false)
		if low {
			m.relievePressure(context.Background())
			return
		}
		m.lastStallRound.Store(time.Now().UnixNano())
		m.relieveStall(context.Background(), stalled)
	}()
}

// relieveStall pauses up to psiBatch idle sandboxes, the longest idle
// first, for a host whose tasks stall on memory, and evicts paused ones
// (see longestPaused) for the rest of the batch. It returns how many it
// paused or evicted.
func (m *Manager) relieveStall(ctx context.Context, stalled float64) int {
	paused := each(m.longestIdle(time.Now(), m.cfg.Pressure.MinIdle),
		func(done int) bool { return done == psiBatch },
		func(id string) bool { return m.pauseForPressure(ctx, id) })
	if paused > 0 {
		m.log.Info(fmt.Sprintf("memory pressure: paused %d idle sandboxes, longest idle first, tasks stalling on memory", paused),
			"stall_some_avg10", stalled, "psi", m.cfg.Pressure.PSI)
	}
	// The rest of the batch: paused sandboxes whose memory stays on the
	// host move it off (see relievePressure).
	evicted := each(m.longestPaused(),
		func(done int) bool { return paused+done == psiBatch },
		func(id string) bool { return m.evictForPressure(ctx, id) })
	if evicted > 0 {
		m.log.Info(fmt.Sprintf("memory pressure: moved the memory of %d paused sandboxes off the host, longest paused first, tasks stalling on memory", evicted),
			"stall_some_avg10", stalled, "psi", m.cfg.Pressure.PSI)
	}
	return paused + evicted
}

// relievePressure pauses idle sandboxes, longest idle first, until the
// host has Below + Below/4 available or no candidate is left; then, if
// still short, evicts paused ones (see longestPaused). It returns how
// many it paused or evicted.
func (m *Manager) relievePressure(ctx context.Context) int {
	p := m.cfg.Pressure
	target := p.Below + p.Below/4
	enough := func(int) bool {
		avail, err := p.Available()
		return err != nil || avail >= target
	}
	before, _ := p.Available()
	paused := each(m.longestIdle(time.Now(), p.MinIdle), enough,
		func(id string) bool { return m.pauseForPressure(ctx, id) })
	if paused > 0 {
		avail, _ := p.Available()
		m.log.Info(fmt.Sprintf("memory pressure: paused %d idle sandboxes, longest idle first", paused),
			"available_before", before, "available_after", avail, "below", p.Below)
	}
	// Still short: paused sandboxes whose memory stays on the host (a VM
	// paused in place) move it off, the longest paused first.
	evicted := each(m.longestPaused(), enough,
		func(id string) bool { return m.evictForPressure(ctx, id) })
	if evicted > 0 {
		avail, _ := p.Available()
		m.log.Info(fmt.Sprintf("memory pressure: moved the memory of %d paused sandboxes off the host, longest paused first", evicted),
			"available_after", avail, "below", p.Below)
	}
	return paused + evicted
}

// each calls act on ids in order until stop says enough (given how many
// act did so far) and returns how many act did.
func each(ids []string, stop func(done int) bool, act func(id string) bool) int {
	done := 0
	for _, id := range ids {
		if stop(done) {
			break
		}
		if act(id) {
			done++
		}
	}
	return done
}

// pauseForPressure pauses sandbox id for memory pressure and tells
// whether it did (one gone meanwhile is not an error).
func (m *Manager) pauseForPressure(ctx context.Context, id string) bool {
	_, ok, err := m.pause(ctx, id, pausePressure)
	if err != nil && !errors.Is(err, ErrNotFound) {
		m.log.Warn("memory pressure: pause", "sandbox_id", id, "err", err)
		return false
	}
	return ok
}

// evictForPressure evicts paused sandbox id for memory pressure and tells
// whether it did (one gone meanwhile is not an error).
func (m *Manager) evictForPressure(ctx context.Context, id string) bool {
	ok, err := m.evict(ctx, id)
	if err != nil && !errors.Is(err, ErrNotFound) {
		m.log.Warn("memory pressure: evict", "sandbox_id", id, "err", err)
	}
	return ok
}

// longestIdle lists the running sandboxes that can pause, have no command
// running and have been idle at least minIdle, the longest idle first.
func (m *Manager) longestIdle(now time.Time, minIdle time.Duration) []string {
	return m.earliestFirst(func(e *entry) (time.Time, bool) {
		if e.rec.State != StateRunning || e.unresponsive || e.deleted != nil || e.trans != nil || e.running > 0 ||
			now.Sub(e.lastActive) < minIdle {
			return time.Time{}, false
		}
		_, ok := m.backends[e.rec.Backend].(sandbox.Pauser)
		return e.lastActive, ok
	})
}

// longestPaused lists the paused sandboxes whose backend can evict them
// and which are not evicted yet, the longest paused first.
func (m *Manager) longestPaused() []string {
	return m.earliestFirst(func(e *entry) (time.Time, bool) {
		if e.rec.State != StatePaused || e.deleted != nil || e.trans != nil || e.rec.Pause == nil || e.rec.Pause.Evicted {
			return time.Time{}, false
		}
		_, ok := m.backends[e.rec.Backend].(sandbox.Evicter)
		return e.rec.Pause.At, ok
	})
}

// earliestFirst lists the sandboxes pick takes (under m.mu), by the time
// it gives each, the earliest first.
func (m *Manager) earliestFirst(pick func(e *entry) (time.Time, bool)) []string {
	type cand struct {
		id string
		at time.Time
	}
	var cands []cand
	m.mu.Lock()
	for id, e := range m.sandboxes {
		if at, ok := pick(e); ok {
			cands = append(cands, cand{id, at})
		}
	}
	m.mu.Unlock()
	sort.Slice(cands, func(i, j int) bool { return cands[i].at.Before(cands[j].at) })
	ids := make([]string, len(cands))
	for i, c := range cands {
		ids[i] = c.id
	}
	return ids
}

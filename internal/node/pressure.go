package node

import (
	"context"
	"errors"
	"fmt"
	"sort"
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
// is left. A paused sandbox resumes on its next request, as always.

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
}

// DefaultPressureMinIdle is Pressure.MinIdle when none is given.
const DefaultPressureMinIdle = time.Minute

func (p *Pressure) validate() error {
	if p.Below < 0 || p.MinIdle < 0 {
		return errors.New("node config: negative memory-pressure threshold or idle time")
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
	return nil
}

// checkPressure starts a reclaim round when the host's memory is low and
// none is running.
func (m *Manager) checkPressure() {
	p := m.cfg.Pressure
	if p.Below <= 0 {
		return
	}
	avail, err := p.Available()
	if err != nil || avail >= p.Below {
		return
	}
	if !m.reclaiming.CompareAndSwap(false, true) {
		return
	}
	go func() {
		defer m.reclaiming.Store(false)
		m.relievePressure(context.Background())
	}()
}

// relievePressure pauses idle sandboxes, longest idle first, until the
// host has Below + Below/4 available or no candidate is left. It returns
// how many it paused.
func (m *Manager) relievePressure(ctx context.Context) int {
	p := m.cfg.Pressure
	target := p.Below + p.Below/4
	paused := 0
	var first int64 = -1
	for _, id := range m.longestIdle(time.Now(), p.MinIdle) {
		avail, err := p.Available()
		if err != nil {
			break
		}
		if first < 0 {
			first = avail
		}
		if avail >= target {
			break
		}
		_, ok, err := m.pause(ctx, id, pausePressure)
		switch {
		case err != nil && !errors.Is(err, ErrNotFound):
			m.log.Warn("memory pressure: pause", "sandbox_id", id, "err", err)
		case ok:
			paused++
		}
	}
	if paused > 0 {
		avail, _ := p.Available()
		m.log.Info(fmt.Sprintf("memory pressure: paused %d idle sandboxes, longest idle first", paused),
			"available_before", first, "available_after", avail, "below", p.Below)
	}
	return paused
}

// longestIdle lists the running sandboxes that can pause, have no command
// running and have been idle at least minIdle, the longest idle first.
func (m *Manager) longestIdle(now time.Time, minIdle time.Duration) []string {
	type cand struct {
		id   string
		idle time.Time
	}
	var cands []cand
	m.mu.Lock()
	for id, e := range m.sandboxes {
		if e.rec.State != StateRunning || e.unresponsive || e.deleted != nil || e.trans != nil || e.running > 0 {
			continue
		}
		if now.Sub(e.lastActive) < minIdle {
			continue
		}
		if _, ok := m.backends[e.rec.Backend].(sandbox.Pauser); ok {
			cands = append(cands, cand{id, e.lastActive})
		}
	}
	m.mu.Unlock()
	sort.Slice(cands, func(i, j int) bool { return cands[i].idle.Before(cands[j].idle) })
	ids := make([]string, len(cands))
	for i, c := range cands {
		ids[i] = c.id
	}
	return ids
}

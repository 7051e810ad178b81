package node

import (
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// SandboxUsage is a sandbox's record with what it uses now.
type SandboxUsage struct {
	Record
	sandbox.Usage
	Idle    time.Duration // since its last request or command activity
	Running int           // commands in flight
}

// Usage returns every sandbox, oldest first, with its memory and CPU
// counters (read from the backend without waking a paused sandbox or
// asking its agent) and its idle time.
func (m *Manager) Usage() []SandboxUsage {
	now := time.Now()
	m.mu.Lock()
	out := make([]SandboxUsage, 0, len(m.sandboxes))
	for _, e := range m.sandboxes {
		idle := time.Duration(0)
		if e.running == 0 && !e.lastActive.IsZero() {
			idle = now.Sub(e.lastActive)
		}
		out = append(out, SandboxUsage{Record: e.rec, Idle: idle, Running: e.running})
	}
	m.mu.Unlock()
	sort.Slice(out, func(i, j int) bool {
		if !out[i].Created.Equal(out[j].Created) {
			return out[i].Created.Before(out[j].Created)
		}
		return out[i].ID < out[j].ID
	})
	for i := range out {
		out[i].Usage = sandbox.Usage{MemoryBytes: -1, CPUUsec: -1}
		if out[i].State == StateCreating || out[i].State == StateDeleting {
			continue
		}
		if r, ok := m.backends[out[i].Backend].(sandbox.UsageReader); ok {
			out[i].Usage = r.Usage(out[i].Handle)
		}
	}
	return out
}

// HostLoad reads the load averages (/proc/loadavg) and the host's busy CPU
// time since boot in microseconds (/proc/stat: all but idle and iowait).
func HostLoad() (load [3]float64, cpuUsec int64) {
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		f := strings.Fields(string(b))
		for i := 0; i < 3 && i < len(f); i++ {
			load[i], _ = strconv.ParseFloat(f[i], 64)
		}
	}
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return load, -1
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 5 || f[0] != "cpu" {
		return load, -1
	}
	var ticks int64
	for i, v := range f[1:] {
		if i == 3 || i == 4 { // idle, iowait
			continue
		}
		if i >= 7 { // guest and guest_nice are counted in user and nice
			break
		}
		n, _ := strconv.ParseInt(v, 10, 64)
		ticks += n
	}
	return load, ticks * 1e6 / 100 // USER_HZ is 100 on Linux
}

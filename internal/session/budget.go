package session

import (
	"encoding/json"
	"sort"
	"time"

	"go.etcd.io/bbolt"
	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/boltgroup"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/limits"
)

// Log budgets. The output logs of a sandbox's commands (trajectory steps
// and shell transcripts among them) live on the host, outside the
// sandbox's disk; together they stay within the sandbox's log budget
// (LogBudgeter, else Config.LogBudget). Past it, the sandbox loses its own
// oldest output: first the logs of its ended commands, oldest ended first,
// whole; then the heads of its running commands' logs, oldest started
// first, up to a record boundary. A pruned log keeps its offsets (the
// bytes are punched out of the file: FALLOC_FL_PUNCH_HOLE), its record and
// exit status; reading it from before its first kept offset answers
// errdefs.ErrLogPruned, which names that offset. The node bounds the sum
// of its sandboxes' budgets (admission), so that a sandbox at its budget
// never costs another sandbox or the host anything.

// LogBudgeter is what the node tells the session layer of a sandbox's log
// budget (an optional interface of Sandboxes).
type LogBudgeter interface {
	// LogBudget returns the bytes of command logs the sandbox may keep on
	// the host; 0 = Config.LogBudget.
	LogBudget(id string) int64
}

// MinLogBudget is the smallest log budget of a sandbox.
const MinLogBudget = 1 << 20

// markEvery is how often (bytes of log) a running command's log notes a
// record boundary: where pruning its head may stop.
const markEvery = 64 << 10

// budget is the log budget of a sandbox; 0 = none.
func (m *Manager) budget(sandboxID string) int64 {
	if lb, ok := m.sb.(LogBudgeter); ok {
		if b := lb.LogBudget(sandboxID); b > 0 {
			return b
		}
	}
	return m.cfg.LogBudget
}

// prunedError is what a reader of c's log from before its first kept
// offset gets.
func (m *Manager) prunedError(c *Command, from, kept int64) error {
	return errdefs.New(errdefs.ErrLogPruned,
		"the output of command %s before offset %d was pruned to keep sandbox %s within its log budget of %s (its oldest output goes first): offset %d is gone; re-attach from offset %d",
		c.rec.ID, kept, c.rec.SandboxID, limits.Size(m.budget(c.rec.SandboxID)), from, kept)
}

// logged counts the record c's pump just appended, which ends at end, and
// prunes c's sandbox's logs if they are over its budget.
func (m *Manager) logged(c *Command, end int64) {
	c.mu.Lock()
	grown := end - c.size
	c.size = end
	last := c.pruned
	if n := len(c.marks); n > 0 {
		last = c.marks[n-1]
	}
	if end-last >= markEvery {
		c.marks = append(c.marks, end)
	}
	c.notifyLocked()
	sandboxID := c.rec.SandboxID
	c.mu.Unlock()
	m.logMu.Lock()
	defer m.logMu.Unlock()
	m.logUsed[sandboxID] += grown
	if b := m.budget(sandboxID); b > 0 && m.logUsed[sandboxID] > b {
		m.pruneLogsLocked(sandboxID, b)
	}
}

// uncount takes a command whose log file goes away out of its sandbox's
// used bytes.
func (m *Manager) uncount(c *Command) {
	c.mu.Lock()
	n, sandboxID := c.size-c.pruned, c.rec.SandboxID
	c.pruned = c.size
	c.mu.Unlock()
	m.logMu.Lock()
	m.logUsed[sandboxID] -= n
	m.logMu.Unlock()
}

// pruneLogsLocked drops the oldest output of sandboxID's commands until its
// logs fit in budget (see the top of the file). Called with logMu held.
func (m *Manager) pruneLogsLocked(sandboxID string, budget int64) {
	type cand struct {
		c       *Command
		running bool
		at      time.Time
	}
	var cs []cand
	m.mu.Lock()
	for _, c := range m.cmds {
		if c.rec.SandboxID != sandboxID {
			continue
		}
		c.mu.Lock()
		if c.size > c.pruned {
			running := c.rec.State == StateRunning
			at := c.rec.Ended
			if running {
				at = c.rec.Started
			}
			cs = append(cs, cand{c, running, at})
		}
		c.mu.Unlock()
	}
	m.mu.Unlock()
	// Ended ones first, in the order they ended; then running ones, in the
	// order they started.
	sort.Slice(cs, func(i, j int) bool {
		if cs[i].running != cs[j].running {
			return !cs[i].running
		}
		return cs[i].at.Before(cs[j].at)
	})
	var changed []record
	for _, x := range cs {
		over := m.logUsed[sandboxID] - budget
		if over <= 0 {
			break
		}
		c := x.c
		c.mu.Lock()
		from, to := c.pruned, c.size
		if x.running || c.rec.State == StateRunning {
			// Up to the first noted boundary that frees enough, else the
			// last one there is.
			to = from
			for _, mk := range c.marks {
				to = mk
				if mk-from >= over {
					break
				}
			}
		}
		c.mu.Unlock()
		if to <= from {
			continue
		}
		// Whole blocks: the bytes before from are gone already, and a
		// whole log's last block goes too (a partial block is only
		// zeroed, and its neighbour's punch would leave it allocated).
		pfrom, pto := from&^(punchAlign-1), to
		if to == c.size && !x.running {
			pto = (to + punchAlign - 1) &^ (punchAlign - 1)
		}
		if err := punch(c.logPath, pfrom, pto); err != nil {
			m.log.Error("prune command log", "sandbox_id", sandboxID, "command", c.rec.ID, "err", err)
			continue
		}
		c.mu.Lock()
		c.pruned = to
		k := 0
		for _, mk := range c.marks {
			if mk > to {
				c.marks[k] = mk
				k++
			}
		}
		c.marks = c.marks[:k]
		c.rec.LogPruned = to
		changed = append(changed, c.rec)
		c.notifyLocked()
		c.mu.Unlock()
		m.logUsed[sandboxID] -= to - from
		m.log.Debug("pruned command log", "sandbox_id", sandboxID, "command", c.rec.ID, "bytes", to-from, "kept_from", to)
	}
	if len(changed) == 0 {
		return
	}
	// Persisted in the background: the pump that called this must not
	// wait for a commit per record. A crash before it lands leaves the
	// offsets unrecorded; Recover then finds the holes (pruned reads zeros,
	// which fail as bad records) only if a reader asks for them.
	go func() {
		err := boltgroup.Update(m.db, func(tx *bbolt.Tx) error {
			b := tx.Bucket(bucketCommands)
			for i := range changed {
				k := []byte(key(changed[i].SandboxID, changed[i].ID))
				v := b.Get(k)
				if v == nil {
					continue // pruned by the retention policy, or its sandbox deleted
				}
				var cur record
				if json.Unmarshal(v, &cur) == nil && cur.LogPruned < changed[i].LogPruned {
					cur.LogPruned = changed[i].LogPruned
					if err := putRecord(tx, &cur); err != nil {
						return err
					}
				}
			}
			return nil
		})
		if err != nil {
			m.log.Error("persist pruned command logs", "sandbox_id", sandboxID, "err", err)
		}
	}()
}

// punchAlign is the block size pruning rounds to (a page: file systems'
// blocks are at most that, and punching frees only whole ones).
const punchAlign = 4096

// punch frees bytes [from, to) of a log file, keeping its size and
// offsets.
func punch(path string, from, to int64) error {
	fd, err := unix.Open(path, unix.O_WRONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, from, to-from)
}

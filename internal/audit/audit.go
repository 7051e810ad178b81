// Package audit is the node's audit log: who (key name, tenant) did what
// (create, delete, exec, file write, commit, layer and key changes, quota
// changes) to which object, when, and with what result.
//
// Entries are appended as JSON lines to one file (DATA/audit.log). When the
// file would grow past its bound it is renamed to audit.log.1 (replacing
// the previous one) and a new file is started: at most twice the bound is
// kept.
//
// Writes are off the request path: Record queues an entry and returns; one
// goroutine writes the queue out to the file each time the queue runs empty
// (so a node that dies loses at most what was still queued) and syncs the
// file to its disk then, or SyncEvery after its last sync (so a host that
// crashes loses at most that much more). A full
// queue drops the entry, never silently: the drop is counted (the onDrop
// callback: the shoal_audit_dropped_total metric), logged, and Dropped
// reports the count.
package audit

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Entry is one audited action.
type Entry struct {
	Time   time.Time `json:"time"`
	Key    string    `json:"key"`              // the key's name ("admin": DATA/admin.key)
	Tenant string    `json:"tenant,omitempty"` // the key's tenant
	Action string    `json:"action"`           // e.g. sandbox.create, command.start, file.write
	Object string    `json:"object,omitempty"` // sandbox ID, layer ref, key name, tenant
	Detail string    `json:"detail,omitempty"` // argv (truncated), a path, a quota
	Result string    `json:"result"`           // "ok" or the error's code
}

// Defaults.
const (
	DefaultMaxBytes = 64 << 20
	QueueLen        = 4096
	// DetailBytes bounds an entry's detail (argv, paths).
	DetailBytes = 512
	// MaxTail bounds what Read returns.
	MaxTail = 10000
)

// Log appends entries to a file. Its methods are safe for concurrent use.
type Log struct {
	path    string
	max     int64
	log     *slog.Logger
	onDrop  func()
	ch      chan Entry
	done    chan struct{}
	dropped atomic.Uint64
	syncs   atomic.Uint64 // fsyncs of the file (tests)
	closing sync.Once
	mu      sync.RWMutex // held for reading by Record, for writing by Close
	closed  bool         // guarded by mu
}

// Open opens (or creates) the log at path, bounded at maxBytes (0:
// DefaultMaxBytes) before rotation; onDrop is called for each entry dropped
// because the queue was full (nil: none).
func Open(path string, maxBytes int64, log *slog.Logger, onDrop func()) (*Log, error) {
	if maxBytes <= 0 {
		maxBytes = DefaultMaxBytes
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open audit log: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	l := &Log{path: path, max: maxBytes, log: log, onDrop: onDrop, ch: make(chan Entry, QueueLen), done: make(chan struct{})}
	go l.run(f, st.Size())
	return l, nil
}

// Truncate shortens s to at most n bytes, marking the cut.
func Truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return strings.ToValidUTF8(s[:n], "") + "…"
}

// Record queues e (Time is set when zero). It never blocks: a full queue
// drops e and counts the drop.
func (l *Log) Record(e Entry) {
	if l == nil {
		return
	}
	if e.Time.IsZero() {
		e.Time = time.Now().UTC()
	}
	e.Detail = Truncate(e.Detail, DetailBytes)
	e.Object = Truncate(e.Object, DetailBytes)
	l.mu.RLock()
	defer l.mu.RUnlock()
	if l.closed {
		l.drop(e, "closed")
		return
	}
	select {
	case l.ch <- e:
	default:
		l.drop(e, "queue full")
	}
}

func (l *Log) drop(e Entry, why string) {
	n := l.dropped.Add(1)
	if l.onDrop != nil {
		l.onDrop()
	}
	if n&(n-1) == 0 { // 1, 2, 4, 8...: logged, not flooded
		l.log.Error("audit log: entry dropped", "why", why, "dropped_total", n, "action", e.Action, "key", e.Key, "object", e.Object)
	}
}

// Dropped is how many entries were dropped since Open.
func (l *Log) Dropped() uint64 { return l.dropped.Load() }

// Close writes out what is queued, syncs and closes the file.
func (l *Log) Close() {
	l.closing.Do(func() {
		l.mu.Lock()
		l.closed = true
		close(l.ch)
		l.mu.Unlock()
		<-l.done
	})
}

func (l *Log) run(f *os.File, size int64) {
	defer close(l.done)
	w := bufio.NewWriterSize(f, 64<<10)
	flush := func() {
		if err := w.Flush(); err != nil {
			l.log.Error("audit log: write", "err", err)
		}
	}
	var lastSync time.Time
	sync := func() {
		flush()
		if err := f.Sync(); err != nil {
			l.log.Error("audit log: fsync", "err", err)
		}
		l.syncs.Add(1)
		lastSync = time.Now()
	}
	// A sync waits for the earlier one to be SyncEvery old (syncLater).
	syncLater := time.NewTimer(time.Hour)
	syncLater.Stop()
	pending := false
	for {
		var e Entry
		var ok bool
		select {
		case e, ok = <-l.ch:
		case <-syncLater.C:
			pending = false
			sync()
			continue
		}
		if !ok {
			break
		}
		line, err := json.Marshal(e)
		if err != nil {
			continue
		}
		line = append(line, '\n')
		if size > 0 && size+int64(len(line)) > l.max {
			sync()
			f.Close()
			if err := os.Rename(l.path, l.path+".1"); err != nil {
				l.log.Error("audit log: rotate", "err", err)
			}
			nf, err := os.OpenFile(l.path, os.O_WRONLY|os.O_CREATE|os.O_APPEND|os.O_TRUNC, 0o600)
			if err != nil {
				// Nowhere to write: count what is lost from now on.
				l.log.Error("audit log: reopen after rotation", "err", err)
				l.drop(e, "cannot reopen")
				for e := range l.ch {
					l.drop(e, "cannot reopen")
				}
				return
			}
			f, size = nf, 0
			w.Reset(f)
		}
		w.Write(line)
		size += int64(len(line))
		if len(l.ch) > 0 {
			continue
		}
		// The queue ran empty: into the file now (readable, and kept if
		// the node dies), to the disk now or SyncEvery after the last sync.
		flush()
		if since := time.Since(lastSync); since >= SyncEvery {
			if pending {
				// The timer is due too: one sync for both. (Stop
				// guarantees no stale fire is received after it.)
				syncLater.Stop()
				pending = false
			}
			sync()
		} else if !pending {
			pending = true
			syncLater.Reset(SyncEvery - since)
		}
	}
	syncLater.Stop()
	sync()
	f.Close()
}

// SyncEvery bounds how often the log is synced to its disk: a burst of
// creates and deletes synced once per entry (the queue runs empty between
// requests), a tenth of a millisecond of CPU and a disk flush each time.
var SyncEvery = 100 * time.Millisecond

// Read returns the last tail entries (at most MaxTail; 0: MaxTail) of the
// log at path and its rotated predecessor, oldest first, keeping only those
// of tenant when it is not "". Lines that do not parse are skipped.
func Read(path string, tail int, tenant string) ([]Entry, error) {
	if tail <= 0 || tail > MaxTail {
		tail = MaxTail
	}
	ring := make([]Entry, 0, tail)
	start := 0
	for _, p := range []string{path + ".1", path} {
		f, err := os.Open(p)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		err = scan(f, func(e Entry) {
			if tenant != "" && e.Tenant != tenant {
				return
			}
			if len(ring) < tail {
				ring = append(ring, e)
				return
			}
			ring[start] = e
			start = (start + 1) % tail
		})
		f.Close()
		if err != nil {
			return nil, err
		}
	}
	return append(ring[start:len(ring):len(ring)], ring[:start]...), nil
}

func scan(r io.Reader, fn func(Entry)) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var e Entry
		if json.Unmarshal(sc.Bytes(), &e) == nil {
			fn(e)
		}
	}
	return sc.Err()
}

// Path is the log's file.
func (l *Log) Path() string { return l.path }

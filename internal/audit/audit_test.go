package audit

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestLogRotateRead(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.log")
	l, err := Open(path, 4096, slog.Default(), nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 100; i++ {
		l.Record(Entry{Key: "k", Tenant: []string{"a", "b"}[i%2], Action: "sandbox.create", Object: fmt.Sprint(i), Detail: strings.Repeat("x", 2000), Result: "ok"})
	}
	l.Close()
	if l.Dropped() != 0 {
		t.Fatalf("dropped %d", l.Dropped())
	}
	// Bounded: the current file and one rotation, each near the bound.
	for _, p := range []string{path, path + ".1"} {
		st, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if st.Size() > 4096 {
			t.Errorf("%s: %d bytes, over the bound", p, st.Size())
		}
	}
	got, err := Read(path, 3, "")
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 || got[0].Object != "97" || got[2].Object != "99" {
		t.Fatalf("tail 3: %+v", got)
	}
	if len(got[0].Detail) > DetailBytes+len("…") {
		t.Fatalf("detail not truncated: %d bytes", len(got[0].Detail))
	}
	got, _ = Read(path, 2, "a")
	if len(got) != 2 || got[0].Object != "96" || got[1].Object != "98" {
		t.Fatalf("tenant a: %+v", got)
	}
	// Record after Close is counted, not lost silently.
	l.Record(Entry{Action: "late"})
	if l.Dropped() != 1 {
		t.Fatalf("dropped after close: %d", l.Dropped())
	}
}

func TestFullQueueCounts(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.log")
	drops := 0
	// A log whose writer has not started: its queue fills up.
	l := &Log{path: path, log: slog.Default(), onDrop: func() { drops++ }, ch: make(chan Entry, QueueLen)}
	for i := 0; i < QueueLen+10; i++ {
		l.Record(Entry{Action: "fill"})
	}
	if l.Dropped() != 10 || drops != 10 {
		t.Fatalf("dropped %d, callback %d", l.Dropped(), drops)
	}
}

// TestWrittenAtOnceSyncedLater: an entry is in the file as soon as the
// queue runs empty, and entries that trickle in one at a time are synced
// at most every SyncEvery, not once each.
func TestWrittenAtOnceSyncedLater(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.log")
	l, err := Open(path, 0, slog.Default(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	const n = 50
	start := time.Now()
	for i := range n {
		l.Record(Entry{Key: "k", Action: "sandbox.create", Object: fmt.Sprint(i), Result: "ok"})
		// In the file before the next one is queued (no Close).
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
			got, err := Read(path, 1, "")
			if err == nil && len(got) == 1 && got[0].Object == fmt.Sprint(i) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("entry %d not in the file: %v %+v", i, err, got)
			}
		}
	}
	took := time.Since(start)
	// One sync at the start, then at most one per SyncEvery (and one more
	// for the last timer).
	if max := uint64(took/SyncEvery) + 2; l.syncs.Load() > max {
		t.Errorf("%d syncs for %d entries over %s (want at most %d)", l.syncs.Load(), n, took, max)
	}
	before := l.syncs.Load()
	l.Close()
	if l.syncs.Load() <= before {
		t.Errorf("Close did not sync")
	}
}

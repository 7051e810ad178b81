package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// events reads events in the background; next returns the next one or
// fails the test after a timeout.
type eventReader struct {
	ch  chan WatchEvent
	err chan error
}

func readEvents(w *Watcher) *eventReader {
	r := &eventReader{ch: make(chan WatchEvent, 100000), err: make(chan error, 1)}
	go func() {
		for {
			ev, err := w.Next()
			if err != nil {
				r.err <- err
				close(r.ch)
				return
			}
			r.ch <- ev
		}
	}()
	return r
}

func evString(e WatchEvent) string {
	s := e.Op + " " + e.Path
	if e.OldPath != "" {
		s = e.Op + " " + e.OldPath + " -> " + e.Path
	}
	if e.IsDir {
		s += "/"
	}
	return s
}

// waitFor reads events until every wanted one ("op path[/]" or
// "rename old -> new[/]") has been seen, in the given order, and returns
// all events read.
func (r *eventReader) waitFor(t *testing.T, want ...string) []string {
	t.Helper()
	var got []string
	i := 0
	deadline := time.After(5 * time.Second)
	for i < len(want) {
		select {
		case ev, ok := <-r.ch:
			if !ok {
				t.Fatalf("watch ended (%v) waiting for %q; got %q", <-r.err, want[i], got)
			}
			got = append(got, evString(ev))
			if evString(ev) == want[i] {
				i++
			}
		case <-deadline:
			t.Fatalf("timed out waiting for %q; got %q", want[i], got)
		}
	}
	if os.Getenv("WATCH_DEBUG") != "" {
		t.Logf("%q", got)
	}
	return got
}

// quiet returns the events that arrive within d.
func (r *eventReader) quiet(d time.Duration) []string {
	var got []string
	timeout := time.After(d)
	for {
		select {
		case ev, ok := <-r.ch:
			if !ok {
				return got
			}
			got = append(got, evString(ev))
		case <-timeout:
			return got
		}
	}
}

func mustWrite(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestWatchRecursive(t *testing.T) {
	c := startAgent(t)
	dir := tempDir(t)
	outside := tempDir(t)
	os.Mkdir(filepath.Join(dir, "old"), 0o755)
	ctx := context.Background()
	w, err := c.Watch(ctx, dir, true)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	r := readEvents(w)
	p := func(rel string) string { return filepath.Join(dir, rel) }

	// A file: created, written, chmodded, renamed, removed.
	mustWrite(t, p("f"), "hello")
	r.waitFor(t, "create "+p("f"), "write "+p("f"))
	os.Chmod(p("f"), 0o600)
	r.waitFor(t, "chmod "+p("f"))
	os.Rename(p("f"), p("g"))
	r.waitFor(t, "rename "+p("f")+" -> "+p("g"))
	os.Remove(p("g"))
	r.waitFor(t, "remove "+p("g"))

	// In a subdirectory that existed when the watch started.
	mustWrite(t, p("old/x"), "x")
	r.waitFor(t, "create "+p("old/x"), "write "+p("old/x"))

	// A tree made at once: its entries are reported although they were
	// created before the agent could watch the new directories.
	if err := os.MkdirAll(p("a/b/c"), 0o755); err != nil {
		t.Fatal(err)
	}
	mustWrite(t, p("a/b/c/deep"), "deep")
	r.waitFor(t, "create "+p("a")+"/", "create "+p("a/b")+"/", "create "+p("a/b/c")+"/", "create "+p("a/b/c/deep"))
	// New directories are watched: a later change deep inside is seen.
	mustWrite(t, p("a/b/c/later"), "later")
	r.waitFor(t, "create "+p("a/b/c/later"), "write "+p("a/b/c/later"))

	// A renamed directory keeps being watched under its new name.
	os.Rename(p("a"), p("z"))
	r.waitFor(t, "rename "+p("a")+" -> "+p("z")+"/")
	mustWrite(t, p("z/b/c/after"), "after")
	r.waitFor(t, "create "+p("z/b/c/after"), "write "+p("z/b/c/after"))

	// Moved out of the tree: removed; moved in: created.
	os.Rename(p("old/x"), filepath.Join(outside, "x"))
	r.waitFor(t, "remove "+p("old/x"))
	os.Rename(filepath.Join(outside, "x"), p("in"))
	r.waitFor(t, "create "+p("in"))

	// A directory moved out is no longer watched.
	os.Rename(p("z"), filepath.Join(outside, "z"))
	r.waitFor(t, "remove "+p("z")+"/")
	mustWrite(t, filepath.Join(outside, "z/b/c/unseen"), "x")
	mustWrite(t, p("marker"), "m")
	got := r.waitFor(t, "create "+p("marker"))
	for _, e := range got {
		if strings.Contains(e, "unseen") {
			t.Fatalf("event from a directory moved out of the tree: %q", got)
		}
	}

	// Removing a directory tree.
	os.RemoveAll(p("old"))
	r.waitFor(t, "remove "+p("old")+"/")
}

func TestWatchNotRecursive(t *testing.T) {
	c := startAgent(t)
	dir := tempDir(t)
	os.Mkdir(filepath.Join(dir, "sub"), 0o755)
	w, err := c.Watch(context.Background(), dir, false)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	r := readEvents(w)
	mustWrite(t, filepath.Join(dir, "sub", "hidden"), "x")
	mustWrite(t, filepath.Join(dir, "top"), "x")
	got := r.waitFor(t, "create "+filepath.Join(dir, "top"))
	for _, e := range got {
		if strings.Contains(e, "hidden") {
			t.Fatalf("non-recursive watch reported a subdirectory's change: %q", got)
		}
	}
}

// A single file can be watched.
func TestWatchFile(t *testing.T) {
	c := startAgent(t)
	path := filepath.Join(tempDir(t), "f")
	mustWrite(t, path, "1")
	w, err := c.Watch(context.Background(), path, false)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	r := readEvents(w)
	f, _ := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	f.WriteString("2")
	f.Close()
	r.waitFor(t, "write "+path)
	os.Remove(path)
	r.waitFor(t, "remove "+path)
	for range r.ch {
	}
	if err := <-r.err; err != io.EOF {
		t.Fatalf("after the file's removal: %v, want io.EOF", err)
	}
}

// Many small writes of one writer give few events, and the last change is
// always reported: at the writer's close, or at the end of the coalescing
// window if the writer keeps the file open.
func TestWatchWritesCoalesced(t *testing.T) {
	c := startAgent(t)
	dir := tempDir(t)
	path := filepath.Join(dir, "log")
	mustWrite(t, path, "")
	w, err := c.Watch(context.Background(), dir, false)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	r := readEvents(w)
	f, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 1000 {
		f.WriteString(strconv.Itoa(i) + "\n")
	}
	// Still open: the trailing write must come without a close.
	got := r.quiet(300 * time.Millisecond)
	writes := 0
	for _, e := range got {
		if e == "write "+path {
			writes++
		} else {
			t.Fatalf("unexpected event %q", e)
		}
	}
	if writes < 1 || writes > 10 {
		t.Fatalf("1000 writes gave %d write events: %q", writes, got)
	}
	// A write after a quiet period is reported at once; one right after
	// it falls in the coalescing window and is reported at its end, with
	// the file still open; closing after that reports nothing new.
	f.WriteString("after a pause\n")
	r.waitFor(t, "write "+path)
	f.WriteString("right after\n")
	if got := r.quiet(300 * time.Millisecond); len(got) != 1 || got[0] != "write "+path {
		t.Fatalf("a write in the window: %q, want one trailing write event", got)
	}
	f.Close()
	if extra := r.quiet(200 * time.Millisecond); len(extra) != 0 {
		t.Fatalf("close after a reported write gave %q", extra)
	}
	// Opened for writing, nothing written, closed: still a write (the
	// file may have been truncated).
	f, _ = os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0)
	f.Close()
	r.waitFor(t, "write "+path)
}

func TestWatchEndsWhenRootRemoved(t *testing.T) {
	c := startAgent(t)
	dir := tempDir(t)
	w, err := c.Watch(context.Background(), dir, true)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	r := readEvents(w)
	os.Remove(dir)
	r.waitFor(t, "remove "+dir+"/")
	for range r.ch {
	}
	if err := <-r.err; err != io.EOF {
		t.Fatalf("got %v, want io.EOF", err)
	}
}

func inotifyFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skip(err)
	}
	n := 0
	for _, e := range ents {
		if l, _ := os.Readlink("/proc/self/fd/" + e.Name()); l == "anon_inode:inotify" {
			n++
		}
	}
	return n
}

// Closing the watch (or cancelling its ctx) frees the agent's inotify
// instance.
func TestWatchCloseFreesInotify(t *testing.T) {
	c := startAgent(t)
	dir := tempDir(t)
	before := inotifyFDs(t)
	ctx, cancel := context.WithCancel(context.Background())
	w1, err := c.Watch(ctx, dir, true)
	if err != nil {
		t.Fatal(err)
	}
	w2, err := c.Watch(context.Background(), dir, false)
	if err != nil {
		t.Fatal(err)
	}
	if n := inotifyFDs(t); n != before+2 {
		t.Fatalf("%d inotify instances with two watches, %d before", n, before)
	}
	cancel()
	w2.Close()
	if _, err := w2.Next(); err == nil {
		t.Fatal("Next after Close succeeded")
	}
	if _, err := w1.Next(); !errors.Is(err, context.Canceled) {
		t.Fatalf("Next after cancel: %v", err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for inotifyFDs(t) != before {
		if time.Now().After(deadline) {
			t.Fatalf("inotify instances not freed: %d, want %d", inotifyFDs(t), before)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestWatchErrors(t *testing.T) {
	c := startAgent(t)
	dir := tempDir(t)
	mustWrite(t, filepath.Join(dir, "f"), "")
	ctx := context.Background()
	if _, err := c.Watch(ctx, filepath.Join(dir, "missing"), false); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing path: %v", err)
	}
	if _, err := c.Watch(ctx, filepath.Join(dir, "f"), true); !errors.Is(err, fs.ErrInvalid) {
		t.Errorf("recursive watch of a file: %v", err)
	}
	if _, err := c.Watch(ctx, "relative", false); !errors.Is(err, fs.ErrInvalid) {
		t.Errorf("relative path: %v", err)
	}
}

// A client that does not read: the agent holds no queue of its own, the
// kernel's queue overflows, and the client is told with one overflow event
// when it reads again.
func TestWatchOverflow(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	b, err := os.ReadFile("/proc/sys/fs/inotify/max_queued_events")
	if err != nil {
		t.Skip(err)
	}
	limit, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	if limit <= 0 || limit > 100000 {
		t.Skipf("max_queued_events %d", limit)
	}
	c := startAgent(t)
	dir := tempDir(t)
	w, err := c.Watch(context.Background(), dir, false)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	// Each file is two events (create, write); the socket buffers hold a
	// few thousand more.
	for i := range limit + 20000 {
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprint(i)), []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for {
		ev, err := w.Next()
		if err != nil {
			t.Fatal(err)
		}
		if ev.Op == WatchOverflow {
			if ev.Path != dir {
				t.Fatalf("overflow names %q, want %q", ev.Path, dir)
			}
			return
		}
	}
}

func TestWatchTooManyDirs(t *testing.T) {
	// The bound, not its size, is under test: 16k mkdirs cost 16 s here.
	defer func(n int) { maxWatchDirs = n }(maxWatchDirs)
	maxWatchDirs = 200
	c := startAgent(t)
	dir := tempDir(t)
	for i := range maxWatchDirs {
		if err := os.Mkdir(filepath.Join(dir, strconv.Itoa(i)), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	_, err := c.Watch(context.Background(), dir, true)
	var ae *Error
	if !errors.As(err, &ae) || ae.Code != CodeTooMany {
		t.Fatalf("got %v, want a %s error", err, CodeTooMany)
	}
	// One fewer directory fits.
	os.Remove(filepath.Join(dir, "0"))
	w, err := c.Watch(context.Background(), dir, true)
	if err != nil {
		t.Fatal(err)
	}
	w.Close()
}

// Sync: once its answer is read, every change made before it was reported,
// including what the watch holds back otherwise (a move out of the tree,
// a coalesced write), with no waiting on timers.
func TestWatchSync(t *testing.T) {
	c := startAgent(t)
	dir, outside := tempDir(t), tempDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	w, err := c.Watch(ctx, dir, true)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	r := readEvents(w)
	// upTo reads events until the answer to sync n and returns them.
	upTo := func(n uint64) []string {
		t.Helper()
		var got []string
		deadline := time.After(30 * time.Second)
		for {
			select {
			case ev, ok := <-r.ch:
				if !ok {
					t.Fatalf("watch ended (%v) waiting for sync %d; got %q", <-r.err, n, got)
				}
				if ev.Op == WatchSynced {
					if ev.Sync == n {
						return got
					}
					continue
				}
				got = append(got, evString(ev))
			case <-deadline:
				t.Fatalf("no answer to sync %d; got %q", n, got)
			}
		}
	}
	hot, err := os.Create(filepath.Join(dir, "hot"))
	if err != nil {
		t.Fatal(err)
	}
	defer hot.Close()
	for i := uint64(1); i <= 150; i++ {
		var want string
		switch i % 3 {
		case 0:
			p := filepath.Join(dir, fmt.Sprintf("f%d", i))
			mustWrite(t, p, "x")
			want = "create " + p
		case 1:
			// A move out of the tree: reported as a removal.
			p := filepath.Join(dir, fmt.Sprintf("f%d", i-1))
			if i == 1 {
				p = filepath.Join(dir, "f0")
				mustWrite(t, p, "x")
			}
			if err := os.Rename(p, filepath.Join(outside, filepath.Base(p))); err != nil {
				t.Fatal(err)
			}
			want = "remove " + p
		case 2:
			// Two writes to a file kept open, the first one reported:
			// the second is held back for the coalescing window (unless
			// it passed); reported at the sync either way.
			hot.WriteString("a")
			if err := w.Sync(1000 + i); err != nil {
				t.Fatal(err)
			}
			upTo(1000 + i)
			hot.WriteString("b")
			want = "write " + filepath.Join(dir, "hot")
		}
		if err := w.Sync(i); err != nil {
			t.Fatal(err)
		}
		got := upTo(i)
		n := 0
		for _, g := range got {
			if g == want {
				n++
			}
		}
		if n == 0 {
			t.Fatalf("sync %d: no %q before its answer; got %q", i, want, got)
		}
	}
}

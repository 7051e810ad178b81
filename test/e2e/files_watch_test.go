package e2e

import (
	"bufio"
	"context"
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

func inSandbox(t *testing.T, id, script string) {
	t.Helper()
	if out, code := run(nil, "exec", id, "--", "sh", "-c", script); code != 0 {
		t.Fatalf("%s: exit %d: %s", script, code, out)
	}
}

func eventLine(ev *pb.WatchDirEvent) string {
	op := strings.ToLower(strings.TrimPrefix(ev.Op.String(), "OP_"))
	s := op + " " + ev.Path
	if ev.OldPath != "" {
		s = op + " " + ev.OldPath + " -> " + ev.Path
	}
	if ev.IsDir {
		s += "/"
	}
	return s
}

// expectEvents reads events until each wanted line has been seen in order.
func expectEvents(t *testing.T, w *shoal.Watch, want ...string) {
	t.Helper()
	type item struct {
		line string
		err  error
	}
	var got []string
	i := 0
	timeout := time.After(30 * time.Second)
	for i < len(want) {
		ch := make(chan item, 1)
		go func() {
			ev, err := w.Next()
			if err != nil {
				ch <- item{err: err}
				return
			}
			ch <- item{line: eventLine(ev)}
		}()
		select {
		case it := <-ch:
			if it.err != nil {
				t.Fatalf("watch ended (%v) waiting for %q; got %q", it.err, want[i], got)
			}
			got = append(got, it.line)
			if it.line == want[i] {
				i++
			}
		case <-timeout:
			t.Fatalf("timed out waiting for %q; got %q", want[i], got)
		}
	}
}

func TestWatchDir(t *testing.T) {
	need(t)
	id := create(t)
	c := sdk(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	inSandbox(t, id, "mkdir -p /work/old")
	w, err := c.Watch(ctx, id, "/work", true)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()

	inSandbox(t, id, "echo hi > /work/f && chmod 600 /work/f && mv /work/f /work/g && rm /work/g")
	expectEvents(t, w, "create /work/f", "write /work/f", "chmod /work/f", "rename /work/f -> /work/g", "remove /work/g")

	// A tree made in one go, then changes deep inside it.
	inSandbox(t, id, "mkdir -p /work/a/b/c && echo x > /work/a/b/c/deep")
	expectEvents(t, w, "create /work/a/", "create /work/a/b/", "create /work/a/b/c/", "create /work/a/b/c/deep")
	inSandbox(t, id, "echo more >> /work/a/b/c/deep && mv /work/a /work/z && echo y > /work/z/b/new && rm -r /work/old")
	expectEvents(t, w, "write /work/a/b/c/deep", "rename /work/a -> /work/z/", "create /work/z/b/new", "write /work/z/b/new", "remove /work/old/")

	// Errors come from Watch itself.
	if _, err := c.Watch(ctx, id, "/nonexistent", false); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("watch of a missing path: %v", err)
	}
	if _, err := c.Watch(ctx, id, "relative", false); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("watch of a relative path: %v", err)
	}

	// The stream ends when the watched directory goes.
	inSandbox(t, id, "mkdir /tmp/gone")
	w2, err := c.Watch(ctx, id, "/tmp/gone", false)
	if err != nil {
		t.Fatal(err)
	}
	inSandbox(t, id, "rmdir /tmp/gone")
	expectEvents(t, w2, "remove /tmp/gone/")
	if _, err := w2.Next(); !errors.Is(err, shoal.ErrWatchEnded) {
		t.Fatalf("after the watched directory's removal: %v", err)
	}
}

func TestWatchCLI(t *testing.T) {
	need(t)
	id := create(t)
	cmd := exec.Command(filepath.Join(binDir, "shoal"), "watch", "-r", id, "/work")
	cmd.Env = append(cmd.Environ(), "SHOAL_URL="+apiURL, "SHOAL_API_KEY="+apiKey)
	stdout, _ := cmd.StdoutPipe()
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	armed := bufio.NewScanner(stderr)
	if !armed.Scan() || !strings.HasPrefix(armed.Text(), "watching") {
		t.Fatalf("shoal watch did not say it is watching: %q", armed.Text())
	}
	lines := make(chan string, 100)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	var got []string
	expect := func(want ...string) {
		t.Helper()
		timeout := time.After(30 * time.Second)
		for i := 0; i < len(want); {
			select {
			case l, ok := <-lines:
				if !ok {
					t.Fatalf("shoal watch ended; got %q", got)
				}
				got = append(got, l)
				if l == want[i] {
					i++
				}
			case <-timeout:
				t.Fatalf("timed out waiting for %q; got %q", want[i], got)
			}
		}
	}
	// A new directory is watched as soon as its creation is seen; what is
	// created in it before that is reported from a scan. Wait until an
	// entry of it was reported (so its watch is in place) before the
	// events this test is about.
	inSandbox(t, id, "mkdir /work/d && touch /work/d/probe")
	expect("create /work/d/", "create /work/d/probe")
	inSandbox(t, id, "echo 1 > /work/d/one && mv /work/d/one /work/d/two")
	expect("create /work/d/one", "write /work/d/one", "rename /work/d/one -> /work/d/two")
	cmd.Process.Signal(syscall.SIGINT)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("shoal watch after SIGINT: %v", err)
	}
}

func TestListDirDepth(t *testing.T) {
	need(t)
	id := create(t)
	c := sdk(t)
	ctx := context.Background()
	inSandbox(t, id, "mkdir -p /work/t/a/b /work/t/e && touch /work/t/a/b/c /work/t/a/one /work/t/x && ln -s /work/t/a /work/t/link")
	paths := func(depth int) string {
		t.Helper()
		ents, err := c.ListDir(ctx, id, "/work/t", depth)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, e := range ents {
			p := e.Path
			if e.IsDir {
				p += "/"
			}
			if e.Name != filepath.Base(e.Path) {
				t.Errorf("%s: name %q", e.Path, e.Name)
			}
			out = append(out, p)
		}
		return strings.Join(out, " ")
	}
	for depth, want := range map[int]string{
		1: "/work/t/a/ /work/t/e/ /work/t/link /work/t/x",
		2: "/work/t/a/ /work/t/a/b/ /work/t/a/one /work/t/e/ /work/t/link /work/t/x",
		5: "/work/t/a/ /work/t/a/b/ /work/t/a/b/c /work/t/a/one /work/t/e/ /work/t/link /work/t/x",
	} {
		if got := paths(depth); got != want {
			t.Errorf("depth %d:\n got %s\nwant %s", depth, got, want)
		}
	}
	// The CLI.
	out, code := run(nil, "files", "ls", id, "/work/t", "--depth", "3")
	if code != 0 || !strings.Contains(out, "/work/t/a/b/c\n") || !strings.Contains(out, "/work/t/link -> /work/t/a") {
		t.Fatalf("files ls --depth 3: %d\n%s", code, out)
	}
	// Past 10,000 entries: a clear error, not a truncated list.
	inSandbox(t, id, "mkdir /work/many && cd /work/many && seq 1 10001 | xargs touch")
	_, err := c.ListDir(ctx, id, "/work", 3)
	if connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "10000") {
		t.Fatalf("list past the bound: %v", err)
	}
	// Depth 1 too: the host counts what the agent sends.
	if _, err := c.ListDir(ctx, id, "/work/many", 1); connect.CodeOf(err) != connect.CodeResourceExhausted {
		t.Fatalf("depth 1 past the bound: %v", err)
	}
}

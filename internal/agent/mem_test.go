package agent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// runDurable runs n short durable commands on c, workers at a time, each
// driven as the node drives one: read to the exit, acknowledge the output,
// and (done) acknowledge the end with Done, which returns once the agent
// has forgotten the command.
func runDurable(t *testing.T, c *Client, n, workers int, done bool) {
	t.Helper()
	var next atomic.Int64
	var wg sync.WaitGroup
	errc := make(chan error, workers)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(n) {
				if err := runOne(c, done); err != nil {
					errc <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Fatal(err)
	}
}

func runOne(c *Client, done bool) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	a, err := c.Start(ctx, StartRequest{ExecRequest: ExecRequest{Args: []string{"echo", "a line of output"}}})
	if err != nil {
		return err
	}
	defer a.Close()
	for {
		r, err := a.Recv()
		if err != nil {
			return err
		}
		if r.Exit != nil {
			if r.Exit.Code != 0 {
				return fmt.Errorf("exit %+v", r.Exit)
			}
			break
		}
		a.Ack(r.End)
	}
	if done {
		return a.Done()
	}
	return nil
}

// restRSS is the agent's resident memory at rest (after a collection).
func restRSS(t *testing.T, c *Client) int64 {
	t.Helper()
	info, err := c.PingAtRest(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return info.RSSBytes
}

// The agent forgets a command once the node has acknowledged its end, so
// its memory stays flat however many commands a sandbox runs (issue 10:
// 5,000 commands grew it from 3.9 to 12.2 MiB). The real binary, driven as
// the node drives it.
func TestRSSFlatOverManyCommands(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	n := 10000
	if v, err := strconv.Atoi(os.Getenv("SHOAL_RSS_COMMANDS")); err == nil && v > 100 {
		n = v
	}
	_, c := startBinary(t, nil)
	ctx := context.Background()
	runDurable(t, c, 100, 4, true)
	first := restRSS(t, c)
	start := time.Now()
	runDurable(t, c, n-100, 4, true)
	elapsed := time.Since(start)
	last := restRSS(t, c)
	infos, err := c.Commands(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("agent RSS at rest: %d KiB after 100 commands, %d KiB after %d (%+d KiB); %d commands in %v",
		first>>10, last>>10, n, (last-first)>>10, n-100, elapsed.Round(time.Millisecond))
	if len(infos) != 0 {
		t.Errorf("the agent still holds %d commands whose end was acknowledged, e.g. %+v", len(infos), infos[0])
	}
	if d := last - first; d > 1<<20 || d < -(1<<20) {
		t.Errorf("RSS moved by %d KiB over %d commands, want within 1 MiB", d>>10, n)
	}
}

// Commands whose end the node never acknowledges are bounded: past
// MaxExited the oldest is forgotten (with a warning), and attaching to it
// says so.
func TestExitedUnacknowledgedBounded(t *testing.T) {
	logs := &memLogger{}
	srv := NewServer(Config{MaxExited: 3, Logger: logs})
	c := serveOn(t, srv)
	ctx := context.Background()
	var ids []string
	for i := range 5 {
		a, err := c.Start(ctx, StartRequest{ExecRequest: ExecRequest{Args: []string{"echo", strconv.Itoa(i)}}})
		if err != nil {
			t.Fatal(err)
		}
		// Read to the exit without acknowledging the end: the node died.
		for {
			r, err := a.Recv()
			if err != nil {
				t.Fatal(err)
			}
			if r.Exit != nil {
				break
			}
		}
		a.Close()
		ids = append(ids, a.ID())
	}
	infos, err := c.Commands(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var held []string
	for _, in := range infos {
		held = append(held, in.ID)
	}
	want := ids[2:]
	if strings.Join(sorted(held), " ") != strings.Join(sorted(want), " ") {
		t.Fatalf("agent holds %v, want the newest 3 %v", held, want)
	}
	for _, id := range ids[:2] {
		if _, err := c.Attach(ctx, id, 0); !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), "forgotten") {
			t.Errorf("attach to forgotten %s: %v, want not exist (forgotten)", id, err)
		}
		if !logs.has(id) {
			t.Errorf("no warning names the forgotten command %s; log:\n%s", id, logs)
		}
	}
	// The ones kept are whole: re-attach, read, acknowledge, forget.
	for _, id := range want {
		a, err := c.Attach(ctx, id, 0)
		if err != nil {
			t.Fatal(err)
		}
		log, exit, _ := drain(t, a, true, 0)
		if exit == nil || stdoutOf(log) == "" {
			t.Fatalf("%s: %q %+v", id, stdoutOf(log), exit)
		}
		if err := a.Done(); err != nil {
			t.Fatal(err)
		}
		a.Close()
	}
	if infos, _ := c.Commands(ctx); len(infos) != 0 {
		t.Fatalf("after Done the agent still holds %+v", infos)
	}
}

func sorted(s []string) []string {
	out := append([]string(nil), s...)
	for i := range out {
		for j := i + 1; j < len(out); j++ {
			if out[j] < out[i] {
				out[i], out[j] = out[j], out[i]
			}
		}
	}
	return out
}

type memLogger struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (l *memLogger) Warn(msg string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	fmt.Fprintln(&l.buf, append([]any{msg}, args...)...)
}

func (l *memLogger) has(s string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Contains(l.buf.String(), s)
}

func (l *memLogger) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// A short command allocates little in the agent (client and server here,
// in one process): each stream of a durable command is read into a
// buffer that starts small and grows only while the command fills it.
// Reading into a fresh 256 KiB per stream made an exec allocate ~540 KiB,
// every page of it faulted in and zeroed on the way to a resumed
// sandbox's first exec. In a child process: nothing else allocates there.
func TestExecAllocatesLittle(t *testing.T) {
	if !inChildProcess(t, "SHOAL_TEST_EXEC_ALLOCS") {
		return
	}
	c := startAgent(t)
	runDurable(t, c, 20, 1, true)
	before := heapAllocs()
	const n = 100
	runDurable(t, c, n, 1, true)
	per := (heapAllocs() - before) / n
	t.Logf("%d bytes allocated per command (client and server)", per)
	if per > 64<<10 {
		t.Errorf("%d KiB allocated per command, want at most 64", per>>10)
	}
}

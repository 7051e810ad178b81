package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"testing"
	"time"
)

// drain reads an attachment to its exit record, acknowledging as a node
// would, and returns the log bytes (in the node's record format), the exit
// status and the last offset.
func drain(t *testing.T, a *Attachment, ack bool, stopAt int64) (log []byte, exit *ExitStatus, end int64) {
	t.Helper()
	for {
		r, err := a.Recv()
		if err != nil {
			t.Fatalf("Recv: %v", err)
		}
		if r.Exit != nil {
			return log, r.Exit, r.End
		}
		log = append(log, byte(r.Kind), 0, 0, 0, 0)
		n := len(r.Data)
		log[len(log)-4], log[len(log)-3], log[len(log)-2], log[len(log)-1] = byte(n>>24), byte(n>>16), byte(n>>8), byte(n)
		log = append(log, r.Data...)
		if base := r.End - int64(len(log)); base < 0 {
			t.Fatalf("offsets: %d bytes received, record ends at %d", len(log), r.End)
		}
		if ack {
			a.Ack(r.End)
		}
		if stopAt > 0 && r.End >= stopAt {
			return log, nil, r.End
		}
	}
}

// stdoutOf extracts the stdout data from log records.
func stdoutOf(log []byte) string {
	var out bytes.Buffer
	for len(log) >= LogRecordHeader {
		n := int(log[1])<<24 | int(log[2])<<16 | int(log[3])<<8 | int(log[4])
		if RecordKind(log[0]) == RecordStdout {
			out.Write(log[LogRecordHeader : LogRecordHeader+n])
		}
		log = log[LogRecordHeader+n:]
	}
	return out.String()
}

func TestDurableSurvivesDetachAndReattaches(t *testing.T) {
	c := startAgent(t)
	ctx := context.Background()
	a, err := c.Start(ctx, StartRequest{ExecRequest: ExecRequest{
		Args: []string{"sh", "-c", "for i in 1 2 3 4 5 6; do echo line$i; sleep 0.05; done; echo err >&2; exit 7"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	id := a.ID()
	// Read a little, acknowledge it, and go away: the command goes on.
	first, _, end := drain(t, a, true, 1)
	a.Close()
	// The agent takes the acknowledgement in on its own time: wait for it.
	var infos []CommandInfo
	waitFor(t, 10*time.Second, "the acknowledged offset", func() bool {
		infos, err = c.Commands(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, in := range infos {
			if in.ID == id && in.Base == end {
				return true
			}
		}
		return false
	}, func() string { return fmt.Sprintf("command %s, want base %d: %+v", id, end, infos) })
	// Below the acknowledged offset is refused.
	if _, err := c.Attach(ctx, id, 0); !errors.Is(err, fs.ErrInvalid) && end > 0 {
		t.Fatalf("attach below base: %v", err)
	}
	b, err := c.Attach(ctx, id, end)
	if err != nil {
		t.Fatal(err)
	}
	rest, exit, _ := drain(t, b, true, 0)
	if err := b.Done(); err != nil {
		t.Fatalf("Done: %v", err)
	}
	b.Close()
	full := append(first, rest...)
	if got := stdoutOf(full); got != "line1\nline2\nline3\nline4\nline5\nline6\n" {
		t.Fatalf("stdout across the re-attach: %q", got)
	}
	if exit.Code != 7 {
		t.Fatalf("exit %+v", exit)
	}
	// Done returned: the agent forgot it.
	if _, err := c.Attach(ctx, id, 0); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("attach after done: %v", err)
	}
}

func TestDurableBackpressureLosesNothing(t *testing.T) {
	c := startAgent(t)
	ctx := context.Background()
	// 4 MiB of output, far more than maxUnacked, with nobody reading for a while.
	a, err := c.Start(ctx, StartRequest{ExecRequest: ExecRequest{Args: []string{"sh", "-c", "head -c 4194304 /dev/zero | tr '\\0' x"}}})
	if err != nil {
		t.Fatal(err)
	}
	id := a.ID()
	a.Close()
	time.Sleep(300 * time.Millisecond)
	infos, _ := c.Commands(ctx)
	for _, in := range infos {
		if in.ID == id && (in.Exited || in.End > maxUnacked+durableChunk+LogRecordHeader*64) {
			t.Fatalf("no backpressure: %+v", in)
		}
	}
	b, err := c.Attach(ctx, id, 0)
	if err != nil {
		t.Fatal(err)
	}
	log, exit, _ := drain(t, b, true, 0)
	b.Done()
	b.Close()
	if out := stdoutOf(log); len(out) != 4<<20 || strings.Trim(out, "x") != "" || exit.Code != 0 {
		t.Fatalf("got %d bytes, exit %+v", len(out), exit)
	}
}

func TestDurableLogCapReportsDropped(t *testing.T) {
	c := startAgent(t)
	a, err := c.Start(context.Background(), StartRequest{
		ExecRequest: ExecRequest{Args: []string{"sh", "-c", "head -c 1000000 /dev/zero"}},
		LogCap:      100000,
	})
	if err != nil {
		t.Fatal(err)
	}
	var kept int
	truncated := false
	for {
		r, err := a.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if r.Exit != nil {
			if r.Exit.Dropped+int64(kept) != 1000000 || !truncated || r.End > 100000+LogRecordHeader+8 {
				t.Fatalf("kept %d dropped %d truncated %v end %d", kept, r.Exit.Dropped, truncated, r.End)
			}
			break
		}
		a.Ack(r.End)
		switch r.Kind {
		case RecordStdout:
			kept += len(r.Data)
		case RecordTruncated:
			truncated = true
		}
	}
	a.Done()
	a.Close()
}

func TestDurableStdinAndSignal(t *testing.T) {
	c := startAgent(t)
	ctx := context.Background()
	a, err := c.Start(ctx, StartRequest{ExecRequest: ExecRequest{Args: []string{"cat"}, Stdin: true}})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if err := c.SendStdin(ctx, a.ID(), []byte("hello "), false); err != nil {
		t.Fatal(err)
	}
	if err := c.SendStdin(ctx, a.ID(), []byte("world\n"), true); err != nil {
		t.Fatal(err)
	}
	log, exit, _ := drain(t, a, true, 0)
	a.Done()
	if stdoutOf(log) != "hello world\n" || exit.Code != 0 {
		t.Fatalf("cat: %q %+v", stdoutOf(log), exit)
	}

	b, err := c.Start(ctx, StartRequest{ExecRequest: ExecRequest{Args: []string{"sleep", "30"}}})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if err := c.SignalCommand(ctx, b.ID(), 15); err != nil {
		t.Fatal(err)
	}
	_, exit, _ = drain(t, b, true, 0)
	b.Done()
	if exit.Signal != "SIGTERM" || exit.Code != 143 {
		t.Fatalf("signal: %+v", exit)
	}
	if err := c.SendStdin(ctx, "nope", []byte("x"), false); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("stdin to unknown command: %v", err)
	}
}

func TestDurablePTY(t *testing.T) {
	if _, err := os.Stat("/dev/ptmx"); err != nil {
		t.Skip("no /dev/ptmx")
	}
	c := startAgent(t)
	ctx := context.Background()
	a, err := c.Start(ctx, StartRequest{
		ExecRequest: ExecRequest{Args: []string{"sh", "-c", "stty size; read x; stty size; tty >/dev/null && echo is-a-tty"}, Stdin: true},
		PTY:         &Winsize{Rows: 24, Cols: 80},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	// Wait for the first size line, then resize and let it go on.
	var out strings.Builder
	for !strings.Contains(out.String(), "24 80") {
		r, err := a.Recv()
		if err != nil || r.Exit != nil {
			t.Fatalf("before resize: %q %v", out.String(), err)
		}
		out.Write(r.Data)
		a.Ack(r.End)
	}
	if err := c.Resize(ctx, a.ID(), Winsize{Rows: 50, Cols: 132}); err != nil {
		t.Fatal(err)
	}
	if err := c.SendStdin(ctx, a.ID(), []byte("go\n"), false); err != nil {
		t.Fatal(err)
	}
	log, exit, _ := drain(t, a, true, 0)
	a.Done()
	out.WriteString(stdoutOf(log))
	if !strings.Contains(out.String(), "50 132") || !strings.Contains(out.String(), "is-a-tty") || exit.Code != 0 {
		t.Fatalf("pty output %q exit %+v", out.String(), exit)
	}
	if err := c.Resize(ctx, "nope", Winsize{Rows: 1, Cols: 1}); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("resize unknown: %v", err)
	}
}

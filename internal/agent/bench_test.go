package agent

import (
	"context"
	"io"
	"testing"
)

// Exec round trip of /bin/true through the client: dial, start, exit
// status, EOF. Run with: go test -run '^$' -bench . ./internal/agent/
func BenchmarkExecTrue(b *testing.B) {
	benchExecTrue(b, startAgent(b))
}

// The same against the real binary (ReapAll, GC settings of main).
func BenchmarkExecTrueBinary(b *testing.B) {
	_, c := startBinary(b, nil)
	benchExecTrue(b, c)
}

func benchExecTrue(b *testing.B, c *Client) {
	ctx := context.Background()
	for b.Loop() {
		p, err := c.Exec(ctx, ExecRequest{Args: []string{"/bin/true"}})
		if err != nil {
			b.Fatal(err)
		}
		for {
			ev, err := p.Recv()
			if err == io.EOF {
				break
			}
			if err != nil {
				b.Fatal(err)
			}
			if ev.Kind == EventExit && ev.Exit.Code != 0 {
				b.Fatalf("exit %+v", ev.Exit)
			}
		}
		p.Close()
	}
}

func BenchmarkPing(b *testing.B) {
	c := startAgent(b)
	ctx := context.Background()
	for b.Loop() {
		if _, err := c.Ping(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

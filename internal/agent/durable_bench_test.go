package agent

import (
	"context"
	"testing"
)

// BenchmarkDurableStream measures a durable command's output through the
// agent: 48 MiB from head, read and acknowledged as the node does.
func BenchmarkDurableStream(b *testing.B) {
	c := startAgent(b)
	const size = 48 << 20
	b.SetBytes(size)
	for i := 0; i < b.N; i++ {
		a, err := c.Start(context.Background(), StartRequest{ExecRequest: ExecRequest{Args: []string{"head", "-c", "50331648", "/dev/zero"}}})
		if err != nil {
			b.Fatal(err)
		}
		var got, acked int64
		for {
			r, err := a.Recv()
			if err != nil {
				b.Fatal(err)
			}
			if r.Exit != nil {
				break
			}
			got += int64(len(r.Data))
			if r.End-acked >= 256<<10 {
				a.Ack(r.End)
				acked = r.End
			}
		}
		a.Done()
		a.Close()
		if got != size {
			b.Fatalf("got %d bytes", got)
		}
	}
}

package container

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// BenchmarkLifecycle measures, per sandbox: create (Create until the agent
// answers on its socket) and delete (Delete returns), as p50/p90 in ms.
//
//	go test -run '^$' -bench Lifecycle -benchtime 20x ./internal/backend/container/
//
// SHOAL_TEST_USERNS=off measures sandboxes without user namespaces.
func BenchmarkLifecycle(b *testing.B) {
	requireRoot(b)
	be := newBackend(b)
	ctx := context.Background()
	var creates, deletes []time.Duration
	for b.Loop() {
		spec := newSpec(b)
		start := time.Now()
		h, err := be.Create(ctx, spec)
		if err != nil {
			b.Fatal(err)
		}
		a := dial(b, h.AgentSocket)
		if a.ask(b, "pid") != "1" {
			b.Fatal("agent is not pid 1")
		}
		creates = append(creates, time.Since(start))
		start = time.Now()
		if err := be.Delete(ctx, h); err != nil {
			b.Fatal(err)
		}
		deletes = append(deletes, time.Since(start))
	}
	report(b, "create", creates)
	report(b, "delete", deletes)
}

// BenchmarkKill compares ways to stop a running sandbox before its
// resources are released; each iteration times only the stop (the rest of
// Delete, which is then fast, is not timed).
//
//	go test -run '^$' -bench Kill -benchtime 20x ./internal/backend/container/
func BenchmarkKill(b *testing.B) {
	requireRoot(b)
	be := newBackend(b)
	runc := func(args ...string) func(context.Context, sandbox.Handle) error {
		return func(ctx context.Context, h sandbox.Handle) error {
			cmd := be.runc(ctx, append(args, h.ID)...)
			if out, err := cmd.CombinedOutput(); err != nil {
				return fmt.Errorf("%v: %w: %s", cmd.Args, err, out)
			}
			return nil
		}
	}
	for _, m := range []struct {
		name string
		stop func(context.Context, sandbox.Handle) error
	}{
		{"cgroup-sigkill+runc-delete", func(ctx context.Context, h sandbox.Handle) error {
			if err := be.killCgroup(ctx, h.ID); err != nil {
				return err
			}
			return runc("delete", "--force")(ctx, h)
		}},
		{"cgroup-sigkill", func(ctx context.Context, h sandbox.Handle) error { return be.killCgroup(ctx, h.ID) }},
		{"runc-kill-all+runc-delete", func(ctx context.Context, h sandbox.Handle) error {
			if err := runc("kill", "--all")(ctx, h); err != nil {
				return err
			}
			// runc kill does not wait; runc delete (no --force) refuses a
			// running container, so retry until the init is gone.
			for {
				cmd := be.runc(ctx, "delete", h.ID)
				if cmd.Run() == nil {
					return nil
				}
				if ctx.Err() != nil {
					return ctx.Err()
				}
				time.Sleep(time.Millisecond)
			}
		}},
		{"runc-delete-force", runc("delete", "--force")},
	} {
		b.Run(m.name, func(b *testing.B) {
			ctx := context.Background()
			var stops []time.Duration
			for b.Loop() {
				b.StopTimer()
				spec := newSpec(b)
				h, err := be.Create(ctx, spec)
				if err != nil {
					b.Fatal(err)
				}
				a := dial(b, h.AgentSocket)
				a.ask(b, "exec sleep 1000 >/dev/null 2>&1 & echo ok")
				b.StartTimer()
				start := time.Now()
				if err := m.stop(ctx, h); err != nil {
					b.Fatal(err)
				}
				stops = append(stops, time.Since(start))
				b.StopTimer()
				if err := be.Delete(ctx, h); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			report(b, "stop", stops)
		})
	}
}

func report(b *testing.B, what string, ds []time.Duration) {
	if len(ds) == 0 {
		return
	}
	slices.Sort(ds)
	ms := func(q float64) float64 { return float64(ds[int(q*float64(len(ds)-1))].Microseconds()) / 1000 }
	b.ReportMetric(ms(0.5), what+"-p50-ms")
	b.ReportMetric(ms(0.9), what+"-p90-ms")
	b.ReportMetric(0, "ns/op")
}

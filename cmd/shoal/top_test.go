package main

import (
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
)

func TestTopRows(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	sample := func(at time.Time, aCPU, bCPU, creates, hostCPU int64) *pb.Status {
		return &pb.Status{Time: timestamppb.New(at),
			Nodes: []*pb.NodeStatus{{Name: "n", Cpus: 2, CpuUsec: hostCPU, CreatesTotal: creates, MemoryTotalBytes: 8 << 30, MemoryAvailableBytes: 6 << 30,
				SwapTotalBytes: 4 << 30, SwapFreeBytes: 3 << 30, SwapZram: true}},
			Sandboxes: []*pb.SandboxUsage{
				{Id: "a", State: "running", CpuUsec: aCPU, MemoryBytes: 10 << 20, MemoryLimitBytes: 512 << 20, CreatedAt: timestamppb.New(t0), IdleMs: 5000},
				{Id: "b", State: "paused", CpuUsec: bCPU, MemoryBytes: -1, MemoryLimitBytes: 512 << 20, CreatedAt: timestamppb.New(t0)},
			}}
	}
	prev := sample(t0.Add(10*time.Second), 1_000_000, 0, 4, 5_000_000)
	cur := sample(t0.Add(12*time.Second), 1_500_000, 0, 10, 7_000_000) // a: 0.5 s of CPU in 2 s
	v := topRows(prev, cur, "", "cpu")
	if len(v.Sandboxes) != 2 || v.Sandboxes[0].ID != "a" || *v.Sandboxes[0].CPUPercent != 25 || *v.Sandboxes[1].CPUPercent != 0 {
		t.Fatalf("rows: %+v", v.Sandboxes)
	}
	if n := v.Nodes[0]; *n.CPUPercent != 50 || *n.CreatesPerSecond != 3 {
		t.Fatalf("node: cpu %v creates/s %v", *n.CPUPercent, *n.CreatesPerSecond)
	}
	if v := topRows(nil, cur, "paused", "cpu"); len(v.Sandboxes) != 1 || v.Sandboxes[0].ID != "b" || v.Sandboxes[0].CPUPercent != nil {
		t.Fatalf("paused, first sample: %+v", v.Sandboxes)
	}
	// A counter that went back (a restarted sandbox): no rate.
	later := sample(t0.Add(14*time.Second), 200, 0, 10, 9_000_000)
	for _, r := range topRows(cur, later, "", "id").Sandboxes {
		if r.ID == "a" && r.CPUPercent != nil {
			t.Fatalf("a CPU counter that went back gave %v%%", *r.CPUPercent)
		}
	}
	var b strings.Builder
	printTop(&b, v, 1)
	out := b.String()
	for _, want := range []string{"node n  cpus 2  cpu 50.0%", "creates/s 3.0", "2 sandboxes: 1 running, 1 paused", "25.0%", "10.0 MiB", "... 1 more", "mem 2.0 GiB / 8.0 GiB  swap 1.0 GiB / 4.0 GiB zram  sandboxes 0"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
}

// TestTopCluster: through a control replica, a NODE column, and a node
// that is down on a line of its own.
func TestTopCluster(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	st := &pb.Status{Time: timestamppb.New(t0.Add(time.Minute)),
		Nodes: []*pb.NodeStatus{
			{Name: "n1", State: "up", Cpus: 2, MemoryTotalBytes: 8 << 30, HeartbeatAt: timestamppb.New(t0.Add(58 * time.Second))},
			{Name: "n2", State: "down", Sandboxes: 3, HeartbeatAt: timestamppb.New(t0.Add(30 * time.Second))},
		},
		Sandboxes: []*pb.SandboxUsage{
			{Id: "aaaa1", Node: "n1", State: "running", MemoryBytes: 1 << 20, MemoryLimitBytes: 64 << 20, CreatedAt: timestamppb.New(t0)},
			{Id: "bbbb1", Node: "n2", State: "lost", MemoryBytes: -1, CpuUsec: -1, CreatedAt: timestamppb.New(t0)},
		}}
	v := topRows(nil, st, "", "id")
	if v.Sandboxes[1].Node != "n2" || v.Nodes[1].State != "down" || *v.Nodes[1].HeartbeatAgeSeconds != 30 {
		t.Fatalf("view: %+v %+v", v.Sandboxes, v.Nodes)
	}
	var b strings.Builder
	printTop(&b, v, 0)
	out := b.String()
	for _, want := range []string{"node n1  cpus 2", "swap none (pauses reclaim file pages only)", "node n2  DOWN  last heartbeat 30s ago  sandboxes 3", "1 running, 1 lost", "NODE  ID", "n2    bbbb1  lost"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
}

func TestTimeColumn(t *testing.T) {
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.Local)
	if got := timeColumn(timestamppb.New(at)); got != "2026-01-02 03:04:05" {
		t.Errorf("timeColumn: %q", got)
	}
	for _, ts := range []*timestamppb.Timestamp{nil, {}} {
		if got := timeColumn(ts); got != "-" {
			t.Errorf("timeColumn(%v): %q, want -", ts, got)
		}
	}
}

package bench

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// VMOptions configure the VM benchmark.
type VMOptions struct {
	Base      string
	Backend   string // microvm or fullvm
	Boots     int    // sandboxes created one after another
	Execs     int    // `true` round trips in the first one
	MemoryMiB int64
}

// VMResult is the JSON printed by `shoal bench vm`.
type VMResult struct {
	Bench   string `json:"bench"`
	Backend string `json:"backend"`
	Accel   string `json:"accel"`
	// CreateToFirstExec: from the create call to the end of the first
	// `true` in the new sandbox (the boot, its agent's first answer, an
	// exec).
	CreateToFirstExec Dist `json:"create_to_first_exec"`
	// Exec: `true` through the API in a booted VM.
	Exec Dist `json:"exec_api"`
	// IdleRSSKiB: host resident memory of an idle VM's QEMU (VmRSS of its
	// process, when the server runs on this machine), after its boot.
	IdleRSSKiB []int64 `json:"idle_qemu_rss_kib,omitempty"`
	MemoryMiB  int64   `json:"guest_memory_mib"`
}

// VM measures VM sandboxes: boot to first exec, exec round trips, and the
// host memory of an idle VM.
func VM(ctx context.Context, c *shoal.Client, o VMOptions) (*VMResult, error) {
	if o.Boots <= 0 || o.Execs < 0 || o.Boots > 100 || o.Execs > 10000 {
		return nil, fmt.Errorf("--boots must be 1..100 and --execs 0..10000")
	}
	if o.Backend == "" {
		o.Backend = "microvm"
	}
	if o.MemoryMiB == 0 {
		o.MemoryMiB = 256
	}
	res := &VMResult{Bench: "vm", Backend: o.Backend, MemoryMiB: o.MemoryMiB}
	var first, execs []time.Duration
	var ids []string
	defer func() {
		for _, id := range ids {
			c.Delete(context.Background(), id)
		}
	}()
	step := progress(ctx, "boot", o.Boots)
	for i := 0; i < o.Boots; i++ {
		step()
		t0 := time.Now()
		sb, err := c.Create(ctx, &pb.CreateSandboxRequest{Base: o.Base, Backend: o.Backend, MemoryBytes: o.MemoryMiB << 20, TimeoutSeconds: 900})
		if err != nil {
			return nil, fmt.Errorf("create %s sandbox: %w", o.Backend, err)
		}
		ids = append(ids, sb.Id)
		st, err := c.Exec(ctx, sb.Id, shoal.ExecOptions{Args: []string{"true"}})
		if err != nil {
			return nil, err
		}
		if st.Code != 0 {
			return nil, fmt.Errorf("true exited %d", st.Code)
		}
		first = append(first, time.Since(t0))
		res.Accel = sb.Runtime["accel"]
		if rss := rssKiB(sb.Runtime["pid"]); rss > 0 {
			res.IdleRSSKiB = append(res.IdleRSSKiB, rss)
		}
	}
	step = progress(ctx, "exec", o.Execs+3)
	for i := 0; i < o.Execs+3; i++ {
		step()
		t0 := time.Now()
		st, err := c.Exec(ctx, ids[0], shoal.ExecOptions{Args: []string{"true"}})
		if err != nil {
			return nil, err
		}
		if st.Code != 0 {
			return nil, fmt.Errorf("true exited %d", st.Code)
		}
		if i >= 3 { // warm-up
			execs = append(execs, time.Since(t0))
		}
	}
	res.CreateToFirstExec = dist(first)
	res.Exec = dist(execs)
	return res, nil
}

// rssKiB is VmRSS of a local process, 0 when unknown.
func rssKiB(pid string) int64 {
	if _, err := strconv.Atoi(pid); err != nil {
		return 0
	}
	b, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "VmRSS:"); ok {
			n, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return n
		}
	}
	return 0
}

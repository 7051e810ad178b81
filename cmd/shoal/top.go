package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// topRow is one sandbox of `shoal top`, as printed by --json too.
type topRow struct {
	ID               string   `json:"id"`
	Node             string   `json:"node"`
	State            string   `json:"state"`
	Backend          string   `json:"backend"`
	Tenant           string   `json:"tenant"`
	CPUPercent       *float64 `json:"cpu_percent"` // null: no earlier sample, or unknown
	MemoryBytes      int64    `json:"memory_bytes"`
	MemoryLimitBytes int64    `json:"memory_limit_bytes"`
	IdleSeconds      float64  `json:"idle_seconds"`
	AgeSeconds       float64  `json:"age_seconds"`
	CommandsRunning  int32    `json:"commands_running"`
}

// topNode is a node's line of `shoal top`.
type topNode struct {
	Name                 string    `json:"name"`
	State                string    `json:"state"`                 // up; in a cluster also unreachable, down
	HeartbeatAgeSeconds  *float64  `json:"heartbeat_age_seconds"` // in a cluster: since its last report
	CPUs                 int32     `json:"cpus"`
	Load                 []float64 `json:"load"`
	CPUPercent           *float64  `json:"cpu_percent"`
	MemoryTotalBytes     int64     `json:"memory_total_bytes"`
	MemoryAvailableBytes int64     `json:"memory_available_bytes"`
	Sandboxes            int64     `json:"sandboxes"`
	CreatesPerSecond     *float64  `json:"creates_per_second"`
	// The host's swap, where pauses put anonymous memory (none: they
	// reclaim file pages only).
	SwapTotalBytes int64 `json:"swap_total_bytes"`
	SwapFreeBytes  int64 `json:"swap_free_bytes"`
	SwapZram       bool  `json:"swap_zram"`
}

type topView struct {
	Time      time.Time `json:"time"`
	Nodes     []topNode `json:"nodes"`
	Sandboxes []topRow  `json:"sandboxes"`
}

// view turns a sample (and the one before, if any) into rows.
func topRows(prev, cur *pb.Status, state, sortBy string) topView {
	now := cur.Time.AsTime()
	v := topView{Time: now}
	var dt float64
	prevSb := map[string]int64{}
	prevNode := map[string]*pb.NodeStatus{}
	if prev != nil {
		dt = now.Sub(prev.Time.AsTime()).Seconds()
		for _, s := range prev.Sandboxes {
			prevSb[s.Id] = s.CpuUsec
		}
		for _, n := range prev.Nodes {
			prevNode[n.Name] = n
		}
	}
	rate := func(a, b int64, div float64) *float64 {
		if dt <= 0 || a < 0 || b < 0 || b < a {
			return nil
		}
		r := float64(b-a) / dt / div
		return &r
	}
	for _, n := range cur.Nodes {
		tn := topNode{Name: n.Name, State: n.State, CPUs: n.Cpus, Load: []float64{n.Load1, n.Load5, n.Load15},
			MemoryTotalBytes: n.MemoryTotalBytes, MemoryAvailableBytes: n.MemoryAvailableBytes, Sandboxes: n.Sandboxes,
			SwapTotalBytes: n.SwapTotalBytes, SwapFreeBytes: n.SwapFreeBytes, SwapZram: n.SwapZram}
		if tn.State == "" {
			tn.State = "up"
		}
		if n.HeartbeatAt != nil {
			age := now.Sub(n.HeartbeatAt.AsTime()).Seconds()
			tn.HeartbeatAgeSeconds = &age
		}
		if p, ok := prevNode[n.Name]; ok {
			tn.CPUPercent = rate(p.CpuUsec, n.CpuUsec, 1e4*float64(max(n.Cpus, 1)))
			tn.CreatesPerSecond = rate(p.CreatesTotal, n.CreatesTotal, 1)
		}
		v.Nodes = append(v.Nodes, tn)
	}
	for _, s := range cur.Sandboxes {
		if state != "" && s.State != state {
			continue
		}
		r := topRow{ID: s.Id, Node: s.Node, State: s.State, Backend: s.Backend, Tenant: s.Tenant, MemoryBytes: s.MemoryBytes,
			MemoryLimitBytes: s.MemoryLimitBytes, IdleSeconds: float64(s.IdleMs) / 1000,
			AgeSeconds: now.Sub(s.CreatedAt.AsTime()).Seconds(), CommandsRunning: s.CommandsRunning}
		if p, ok := prevSb[s.Id]; ok {
			r.CPUPercent = rate(p, s.CpuUsec, 1e4)
		}
		v.Sandboxes = append(v.Sandboxes, r)
	}
	cpu := func(r topRow) float64 {
		if r.CPUPercent == nil {
			return -1
		}
		return *r.CPUPercent
	}
	sort.SliceStable(v.Sandboxes, func(i, j int) bool {
		a, b := v.Sandboxes[i], v.Sandboxes[j]
		switch sortBy {
		case "mem":
			return a.MemoryBytes > b.MemoryBytes
		case "idle":
			return a.IdleSeconds > b.IdleSeconds
		case "age":
			return a.AgeSeconds > b.AgeSeconds
		case "id":
			return a.ID < b.ID
		}
		return cpu(a) > cpu(b)
	})
	return v
}

func shortDuration(s float64) string {
	d := time.Duration(s * float64(time.Second))
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 24*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	}
	return fmt.Sprintf("%dd%02dh", int(d.Hours())/24, int(d.Hours())%24)
}

// printTop writes the view as a table; rows > 0 cuts the sandboxes to fit.
func printTop(w io.Writer, v topView, rows int) {
	pct := func(p *float64) string {
		if p == nil {
			return "-"
		}
		return fmt.Sprintf("%.1f%%", *p)
	}
	for _, n := range v.Nodes {
		if n.State != "up" {
			hb := ""
			if n.HeartbeatAgeSeconds != nil {
				hb = "  last heartbeat " + shortDuration(*n.HeartbeatAgeSeconds) + " ago"
			}
			fmt.Fprintf(w, "node %s  %s%s  sandboxes %d at its last report\n", n.Name, strings.ToUpper(n.State), hb, n.Sandboxes)
			continue
		}
		cr := "-"
		if n.CreatesPerSecond != nil {
			cr = fmt.Sprintf("%.1f", *n.CreatesPerSecond)
		}
		fmt.Fprintf(w, "node %s  cpus %d  cpu %s  load %.2f %.2f %.2f  mem %s / %s  %s  sandboxes %d  creates/s %s\n",
			n.Name, n.CPUs, pct(n.CPUPercent), n.Load[0], n.Load[1], n.Load[2],
			humanBytes(n.MemoryTotalBytes-n.MemoryAvailableBytes), humanBytes(n.MemoryTotalBytes), swapColumn(n), n.Sandboxes, cr)
	}
	counts := map[string]int{}
	for _, s := range v.Sandboxes {
		counts[s.State]++
	}
	var cs []string
	for _, st := range []string{"running", "paused", "creating", "error", "deleting", "lost"} {
		if counts[st] > 0 {
			cs = append(cs, fmt.Sprintf("%d %s", counts[st], st))
		}
	}
	fmt.Fprintf(w, "%s  %d sandboxes: %s\n\n", v.Time.Local().Format(time.TimeOnly), len(v.Sandboxes), strings.Join(cs, ", "))
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	// A NODE column when there are several (a cluster's control replica).
	multi := len(v.Nodes) > 1
	node := func(s topRow) string {
		if !multi {
			return ""
		}
		if s.Node == "" {
			return "-\t"
		}
		return s.Node + "\t"
	}
	if multi {
		fmt.Fprint(tw, "NODE\t")
	}
	fmt.Fprintln(tw, "ID\tSTATE\tBACKEND\tTENANT\tCPU\tMEM\tLIMIT\tIDLE\tAGE\tCMDS")
	for i, s := range v.Sandboxes {
		if rows > 0 && i >= rows {
			fmt.Fprintf(tw, "... %d more\n", len(v.Sandboxes)-i)
			break
		}
		mem, tn, idle := "?", s.Tenant, shortDuration(s.IdleSeconds)
		if s.MemoryBytes >= 0 {
			mem = humanBytes(s.MemoryBytes)
		}
		if tn == "" {
			tn = "-"
		}
		if s.CommandsRunning > 0 {
			idle = "busy"
		}
		fmt.Fprintf(tw, "%s%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\n", node(s), s.ID, s.State, s.Backend, tn, pct(s.CPUPercent), mem,
			humanBytes(s.MemoryLimitBytes), idle, shortDuration(s.AgeSeconds), s.CommandsRunning)
	}
	tw.Flush()
}

func topCmd() *cobra.Command {
	var (
		once, asJSON bool
		interval     time.Duration
		state, by    string
	)
	cmd := &cobra.Command{
		Use:   "top",
		Short: "Live table of sandboxes (state, CPU, memory, idle time) and the node's load",
		Long: "Live table of sandboxes and the node's load, refreshed in place every --interval until Ctrl-C.\n" +
			"CPU is the share of one core over the last interval. --once prints one table (two samples\n" +
			"--interval apart, for the CPU column) and exits; --json prints that as JSON.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if interval < 100*time.Millisecond || interval > time.Hour {
				return fmt.Errorf("--interval %s: want 100ms to 1h", interval)
			}
			switch by {
			case "cpu", "mem", "idle", "age", "id":
			default:
				return fmt.Errorf("--sort %q: want cpu, mem, idle, age or id", by)
			}
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			if asJSON {
				once = true
			}
			return runTop(ctx, c, once, asJSON, interval, state, by)
		},
	}
	cmd.Flags().BoolVar(&once, "once", false, "print one table and exit (for scripts)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print one sample as JSON and exit")
	cmd.Flags().DurationVar(&interval, "interval", time.Second, "time between samples")
	cmd.Flags().StringVar(&state, "state", "", "show only sandboxes in this state (running, paused, error, ...)")
	cmd.Flags().StringVar(&by, "sort", "cpu", "sort by cpu, mem, idle, age or id")
	return cmd
}

func runTop(ctx context.Context, c *shoal.Client, once, asJSON bool, interval time.Duration, state, by string) error {
	prev, err := c.Status(ctx)
	if err != nil {
		return err
	}
	live := !once && term.IsTerminal(int(os.Stdout.Fd()))
	if live {
		fmt.Print("\x1b[?25l\x1b[2J") // hide the cursor, clear the screen
		defer fmt.Print("\x1b[?25h")
		printLive(topRows(nil, prev, state, by))
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			if live {
				fmt.Println()
			}
			return nil
		case <-t.C:
		}
		cur, err := c.Status(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		v := topRows(prev, cur, state, by)
		prev = cur
		switch {
		case asJSON:
			b, err := json.MarshalIndent(v, "", "  ")
			if err != nil {
				return err
			}
			fmt.Println(string(b))
			return nil
		case once:
			printTop(os.Stdout, v, 0)
			return nil
		case live:
			printLive(v)
		default: // not a terminal: one table after another
			printTop(os.Stdout, v, 0)
			fmt.Println()
		}
	}
}

// printLive redraws the screen from its top left corner, cutting the
// table to the terminal's height.
func printLive(v topView) {
	_, h, err := term.GetSize(int(os.Stdout.Fd()))
	rows := 0
	if err == nil && h > 6 {
		rows = h - 5 - len(v.Nodes)
	}
	var b strings.Builder
	printTop(&b, v, rows)
	out := strings.ReplaceAll(b.String(), "\n", "\x1b[K\n") // clear each line's rest
	fmt.Print("\x1b[H" + out + "\x1b[J")
}

// swapColumn says where a pause puts the node's sandboxes' anonymous
// memory: its swap (used / total, and whether zram), or nowhere.
func swapColumn(n topNode) string {
	switch {
	case n.SwapTotalBytes > 0 && n.SwapZram:
		return fmt.Sprintf("swap %s / %s zram", humanBytes(n.SwapTotalBytes-n.SwapFreeBytes), humanBytes(n.SwapTotalBytes))
	case n.SwapTotalBytes > 0:
		return fmt.Sprintf("swap %s / %s", humanBytes(n.SwapTotalBytes-n.SwapFreeBytes), humanBytes(n.SwapTotalBytes))
	}
	return "swap none (pauses reclaim file pages only)"
}

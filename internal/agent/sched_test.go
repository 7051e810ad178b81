package agent

import (
	"os"
	"strconv"
	"strings"
	"testing"
)

// statField returns field n (1-based, as in proc(5)) of a /proc/PID/stat
// line; the command name (field 2) may hold spaces.
func statField(t testing.TB, stat string, n int) string {
	t.Helper()
	i := strings.LastIndexByte(stat, ')')
	f := strings.Fields(stat[i+1:]) // from field 3
	if i < 0 || n < 3 || n-3 >= len(f) {
		t.Fatalf("stat %q has no field %d", stat, n)
	}
	return f[n-3]
}

// The agent runs above its commands (see AgentNice): with its threads at
// AgentNice, as the host sets them, every command starts at nice 0 (and
// under SCHED_IDLE in a best-effort sandbox, $SHOAL_BEST_EFFORT) whichever
// of the agent's threads took its request, while the agent's threads stay
// at AgentNice and SCHED_OTHER but the one that forks. Before, a command
// inherited its forking thread's scheduling: the agent and a fork bomb
// were equals, and the agent's kill of the timed-out bomb starved.
func TestCommandsBelowAgent(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (CAP_SYS_NICE) to set the agent's nice value, as the host does")
	}
	for _, idle := range []bool{false, true} {
		t.Run(map[bool]string{false: "ls", true: "be"}[idle], func(t *testing.T) {
			if idle {
				t.Setenv(EnvBestEffort, "1")
			}
			cmd, c := startBinary(t, nil)
			if err := Prioritize(cmd.Process.Pid, AgentNice); err != nil {
				t.Fatal(err)
			}
			wantPolicy := map[bool]string{false: "0", true: "5"}[idle]
			for i := range 20 {
				r := run(t, c, ExecRequest{Args: []string{"cat", "/proc/self/stat"}})
				if nice := statField(t, r.stdout, 19); nice != "0" {
					t.Fatalf("command %d runs at nice %s, want 0", i, nice)
				}
				if p := statField(t, r.stdout, 41); p != wantPolicy {
					t.Fatalf("command %d runs under policy %s, want %s", i, p, wantPolicy)
				}
				// And what it starts inherits it.
				r = run(t, c, ExecRequest{Args: []string{"sh", "-c", "cat /proc/self/stat & wait"}})
				if nice, p := statField(t, r.stdout, 19), statField(t, r.stdout, 41); nice != "0" || p != wantPolicy {
					t.Fatalf("a command's child runs at nice %s policy %s", nice, p)
				}
			}
			dir := "/proc/" + strconv.Itoa(cmd.Process.Pid) + "/task"
			ents, err := os.ReadDir(dir)
			if err != nil {
				t.Fatal(err)
			}
			forkers := 0
			for _, e := range ents {
				b, err := os.ReadFile(dir + "/" + e.Name() + "/stat")
				if err != nil {
					continue // gone
				}
				nice, p := statField(t, string(b), 19), statField(t, string(b), 41)
				switch {
				case nice == strconv.Itoa(AgentNice) && p == "0":
				case nice == "0" && p == wantPolicy:
					forkers++
				default:
					t.Errorf("agent thread %s at nice %s policy %s", e.Name(), nice, p)
				}
			}
			if forkers != 1 {
				t.Errorf("%d of the agent's %d threads at the commands' scheduling, want 1 (the spawner)", forkers, len(ents))
			}
		})
	}
}

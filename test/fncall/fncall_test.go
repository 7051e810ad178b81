package fncall

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/fncall"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

func str(s string) *string { return &s }

// verdictCase provokes one verdict on purpose.
type verdictCase struct {
	lang, verdict, src string
	stdin, expected    string
}

// Every verdict in every language: a correct a+b, a wrong one, an
// infinite loop, a memory hog, a crash, an output flood, a compile error.
var verdictCases = []verdictCase{
	{lang: "python", verdict: "OK", src: "a, b = map(int, input().split())\nprint(a + b)\n"},
	{lang: "python", verdict: "WA", src: "a, b = map(int, input().split())\nprint(a + b + 1)\n"},
	{lang: "python", verdict: "TLE", src: "while True:\n    pass\n"},
	{lang: "python", verdict: "MLE", src: "s = 'x' * (300 << 20)\nprint(len(s))\n"},
	{lang: "python", verdict: "RE", src: "import sys\nprint(1 // 0)\n"},
	{lang: "python", verdict: "OLE", src: "while True:\n    print('x' * 1000)\n"},
	// Interpreted: a syntax error shows when the program runs.
	{lang: "python", verdict: "RE", src: "def f(:\n"},

	{lang: "bash", verdict: "OK", src: "read a b\necho $((a + b))\n"},
	{lang: "bash", verdict: "WA", src: "read a b\necho $((a * b + 1))\n"},
	{lang: "bash", verdict: "TLE", src: "while :; do :; done\n"},
	{lang: "bash", verdict: "MLE", src: "s=$(head -c 300000000 /dev/zero | tr '\\0' x)\necho ${#s}\n"},
	{lang: "bash", verdict: "RE", src: "echo failing >&2\nexit 3\n"},
	{lang: "bash", verdict: "OLE", src: "while :; do echo flood flood flood; done\n"},

	{lang: "c", verdict: "OK", src: "#include <stdio.h>\nint main(void){int a,b;scanf(\"%d %d\",&a,&b);printf(\"%d\\n\",a+b);return 0;}\n"},
	{lang: "c", verdict: "WA", src: "#include <stdio.h>\nint main(void){puts(\"43\");return 0;}\n"},
	{lang: "c", verdict: "TLE", src: "int main(void){volatile unsigned long x=0;for(;;)x++;}\n"},
	{lang: "c", verdict: "MLE", src: "#include <stdlib.h>\n#include <string.h>\nint main(void){for(;;){char*p=malloc(1<<20);memset(p,1,1<<20);}}\n"},
	{lang: "c", verdict: "RE", src: "int main(void){volatile int *p=0;return *p;}\n"},
	{lang: "c", verdict: "OLE", src: "#include <stdio.h>\nint main(void){for(;;)puts(\"flood\");}\n"},
	{lang: "c", verdict: "CE", src: "int main(void){return undefined_variable;}\n"},

	{lang: "cpp", verdict: "OK", src: "#include <iostream>\nint main(){long a,b;std::cin>>a>>b;std::cout<<a+b<<std::endl;}\n"},
	{lang: "cpp", verdict: "WA", src: "#include <iostream>\nint main(){std::cout<<\"4 2\"<<std::endl;}\n"},
	{lang: "cpp", verdict: "TLE", src: "int main(){volatile unsigned long x=0;for(;;)x++;}\n"},
	{lang: "cpp", verdict: "MLE", src: "#include <vector>\n#include <iostream>\nint main(){std::vector<char> v(512u<<20, 1);std::cout<<int(v[12345]);}\n"},
	{lang: "cpp", verdict: "RE", src: "#include <stdexcept>\nint main(){throw std::runtime_error(\"boom\");}\n"},
	{lang: "cpp", verdict: "OLE", src: "#include <cstdio>\nint main(){for(;;)std::puts(\"flood\");}\n"},
	{lang: "cpp", verdict: "CE", src: "#include <vector>\nint main(){std::vector<int> v; v.push_bak(1);}\n"},

	{lang: "go", verdict: "OK", src: "package main\nimport \"fmt\"\nfunc main(){var a,b int;fmt.Scan(&a,&b);fmt.Println(a+b)}\n"},
	{lang: "go", verdict: "WA", src: "package main\nimport \"fmt\"\nfunc main(){fmt.Println(-1)}\n"},
	{lang: "go", verdict: "TLE", src: "package main\nfunc main(){x:=0;for{x++}}\n"},
	{lang: "go", verdict: "MLE", src: "package main\nimport \"fmt\"\nfunc main(){b:=make([]byte,512<<20);for i:=range b{b[i]=1};fmt.Println(b[7])}\n"},
	{lang: "go", verdict: "RE", src: "package main\nfunc main(){panic(\"boom\")}\n"},
	{lang: "go", verdict: "OLE", src: "package main\nimport \"fmt\"\nfunc main(){for{fmt.Println(\"flood flood flood flood\")}}\n"},
	{lang: "go", verdict: "CE", src: "package main\nfunc main(){return 1}\n"},
}

func TestVerdictsEveryLanguage(t *testing.T) {
	need(t)
	c := sdk(t).FnCall()
	for _, vc := range verdictCases {
		t.Run(vc.lang+"/"+vc.verdict, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			limits := &pb.Limits{CpuTimeMs: 500, WallTimeMs: 5000, MemoryBytes: 64 << 20, OutputBytes: 64 << 10}
			if vc.verdict == "MLE" {
				// Filling memory takes CPU (bash's pipeline above all):
				// let the memory limit be the one that is hit.
				limits.CpuTimeMs, limits.WallTimeMs = 5000, 20000
			}
			if vc.verdict == "TLE" {
				// The CPU limit is the one asserted: on a loaded host a
				// busy loop may get 7% of a core (347 ms of CPU in 5 s
				// seen), so the wall limit must not come first.
				limits.WallTimeMs = 120000
			}
			res, err := c.Run(ctx, &pb.RunRequest{
				Language: vc.lang, Source: vc.src, Limits: limits,
				Tests: []*pb.TestCase{{Name: "sum", Stdin: "40 2\n", Expected: str("42")}},
			})
			if err != nil {
				t.Fatal(err)
			}
			got := strings.TrimPrefix(res.Verdict.String(), "VERDICT_")
			if got != vc.verdict {
				t.Fatalf("verdict %s, want %s: %s", got, vc.verdict, describe(res))
			}
			if vc.verdict == "CE" {
				if res.Compile == nil || !strings.Contains(string(res.Compile.Stderr), "main.") || len(res.Tests) != 0 {
					t.Fatalf("CE without the compiler's error: %s", describe(res))
				}
				return
			}
			if (vc.lang == "c" || vc.lang == "cpp" || vc.lang == "go") && (res.Compile == nil || res.Compile.Verdict != pb.Verdict_VERDICT_OK) {
				t.Fatalf("compile step: %s", describe(res))
			}
			x := res.Tests[0]
			switch vc.verdict {
			case "OK":
				if strings.TrimSpace(string(x.Stdout)) != "42" || x.CpuMs <= 0 || x.WallMs <= 0 || x.MemoryBytes <= 0 {
					t.Fatalf("OK run: %s", describe(res))
				}
			case "WA":
				if !strings.Contains(x.Message, "expected \"42\"") {
					t.Fatalf("WA message: %q", x.Message)
				}
			case "TLE":
				// Measured by the run's cgroup, killed close to the limit.
				if x.CpuMs < 500 || x.CpuMs > 1500 || !strings.Contains(x.Message, "cpu time") {
					t.Fatalf("TLE: cpu %.1f ms: %s", x.CpuMs, describe(res))
				}
			case "MLE":
				if x.MemoryBytes < 60<<20 || x.MemoryBytes > 66<<20 {
					t.Fatalf("MLE: peak %d bytes for a 64 MiB limit", x.MemoryBytes)
				}
			case "RE":
				if x.ExitCode == 0 {
					t.Fatalf("RE with exit code 0: %s", describe(res))
				}
			case "OLE":
				if !x.StdoutTruncated || len(x.Stdout) != 64<<10 {
					t.Fatalf("OLE: truncated %v, %d bytes kept", x.StdoutTruncated, len(x.Stdout))
				}
			}
		})
	}
}

func describe(res *pb.RunResult) string {
	if res == nil {
		return "no result"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "verdict %s error %q", res.Verdict, res.Error)
	if x := res.Compile; x != nil {
		fmt.Fprintf(&b, "\n compile %s exit %d %s %q stderr %q", x.Verdict, x.ExitCode, x.Signal, x.Message, cut(x.Stderr))
	}
	for _, x := range res.Tests {
		fmt.Fprintf(&b, "\n test %s %s exit %d %s cpu %.1fms wall %.1fms mem %d %q stdout %q stderr %q",
			x.Name, x.Verdict, x.ExitCode, x.Signal, x.CpuMs, x.WallMs, x.MemoryBytes, x.Message, cut(x.Stdout), cut(x.Stderr))
	}
	return b.String()
}

func cut(b []byte) string {
	if len(b) > 300 {
		return string(b[:300]) + "..."
	}
	return string(b)
}

// A call that writes files everywhere it can, fills /tmp, leaves
// background processes (in a new session too) and POSIX shared memory
// must not affect the next call in the same sandbox.
func TestIsolationBetweenCalls(t *testing.T) {
	need(t)
	c := sdk(t).FnCall()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dirty := `
echo secret > /box/leak; mkdir -p /box/d/e; echo secret > /box/d/e/leak
echo secret > /tmp/leak; echo secret > /var/tmp/leak; echo secret > /dev/shm/leak
head -c 50000000 /dev/zero > /tmp/fill && echo filled
for f in /etc/leak /root/leak /usr/bin/leak /leak /var/leak /usr/lib/python3/leak; do
	( echo x > $f ) 2>/dev/null && echo WROTE $f
done
nohup sleep 1000 >/dev/null 2>&1 &
python3 -c 'import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(1000)' &
sleep 0.2
echo done
`
	check := `import os
me = os.getpid()
print("box", sorted(os.listdir("/box")))
for d in ["/tmp", "/var/tmp", "/dev/shm"]:
    print(d, sorted(os.listdir(d)))
procs = [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]
print("procs", procs)
`
	first, err := c.Run(ctx, &pb.RunRequest{Language: "bash", Source: dirty})
	if err != nil {
		t.Fatal(err)
	}
	out := string(first.Tests[0].Stdout)
	if first.Verdict != pb.Verdict_VERDICT_OK || !strings.Contains(out, "filled") || !strings.Contains(out, "done") {
		t.Fatalf("dirty call: %s", describe(first))
	}
	if strings.Contains(out, "WROTE") {
		t.Fatalf("a call wrote outside its box and /tmp: %s", out)
	}
	// The next call sees none of it.
	want := "box ['main.py']\n/tmp []\n/var/tmp []\n/dev/shm []\nprocs []\n"
	res, err := c.Run(ctx, &pb.RunRequest{Language: "python", Source: check})
	if err != nil {
		t.Fatal(err)
	}
	if got := string(res.Tests[0].Stdout); got != want || res.Tests[0].MemoryBytes > 30<<20 {
		t.Fatalf("a call after a dirty call sees (%d bytes charged):\n%s\nwant:\n%s", res.Tests[0].MemoryBytes, got, want)
	}
	// Nor does the dirty call's own sandbox, once reset: look inside it
	// (a pool sandbox is an ordinary sandbox of the node) as root.
	// The reset runs after the call's result is sent, and empties the box
	// before /tmp and the others: wait (with a deadline) until the whole
	// sandbox is clean, not only the box.
	sb := sdk(t)
	// ls, readlink and cat are the shell's own children: only they and
	// the shell may show.
	leftover := func(got string) string {
		if strings.Contains(got, "main.sh") {
			return "main.sh"
		}
		for _, line := range strings.Split(got, "\n") {
			if line == "" || strings.HasSuffix(line, ":") || line == "1" || strings.HasSuffix(line, "/sh") ||
				strings.HasSuffix(line, "/dash") || strings.HasSuffix(line, "/bash") || strings.HasSuffix(line, "/readlink") || strings.HasSuffix(line, "/coreutils") {
				continue
			}
			return line
		}
		return ""
	}
	var got string
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var out strings.Builder
		st, err := sb.Exec(ctx, first.SandboxId, shoal.ExecOptions{Args: []string{"sh", "-c",
			"ls -A /box /tmp /var/tmp /dev/shm; for p in /proc/[0-9]*; do n=${p#/proc/}; [ $n = 1 ] || [ $n = $$ ] || [ -e $p/exe ] && readlink $p/exe; done; cat /proc/sysvipc/shm | wc -l"},
			Stdout: &out})
		if err != nil || st.Code != 0 {
			t.Fatalf("look into %s: %v %+v", first.SandboxId, err, st)
		}
		got = out.String()
		left := leftover(got)
		if left == "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the dirty call's sandbox, 15 s after the call, still has %q:\n%s", left, got)
		}
	}
}

// A warm-up command that cannot start (the pool is shared by the languages
// of an environment) is logged and skipped: calls of every language on it
// go on. (Such a failure once made the sandbox's clean-up use the nil
// newSandbox returned, and crashed serve.)
func TestWarmUpCannotStart(t *testing.T) {
	need(t)
	c := sdk(t).FnCall()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	for _, lang := range []string{"brokenwarm", "bash"} {
		res, err := c.Run(ctx, &pb.RunRequest{Language: lang, Source: "echo fine"})
		if err != nil || res.Verdict != pb.Verdict_VERDICT_OK || string(res.Tests[0].Stdout) != "fine\n" {
			t.Fatalf("%s with a warm-up that cannot start: %v %s", lang, err, describe(res))
		}
	}
}

// System V IPC objects outlive processes and only their owner may remove
// them: a sandbox where a call left one is thrown away.
func TestSysVIPCDiscardsSandbox(t *testing.T) {
	need(t)
	c := sdk(t).FnCall()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	leak, err := c.Run(ctx, &pb.RunRequest{Language: "c", Source: "#include <sys/shm.h>\n#include <stdio.h>\nint main(void){printf(\"%d\\n\", shmget(0x5ea1, 4096, IPC_CREAT|0666));return 0;}\n"})
	if err != nil || leak.Verdict != pb.Verdict_VERDICT_OK || strings.HasPrefix(string(leak.Tests[0].Stdout), "-1") {
		t.Fatalf("shmget call: %v %s", err, describe(leak))
	}
	waitGone(t, leak.SandboxId)
	for i := 0; i < 5; i++ {
		res, err := c.Run(ctx, &pb.RunRequest{Language: "c", Source: "#include <stdio.h>\nint main(void){FILE*f=fopen(\"/proc/sysvipc/shm\",\"r\");int n=0,ch;while((ch=fgetc(f))!=EOF)n+=ch=='\\n';printf(\"%d\\n\",n-1);return 0;}\n"})
		if err != nil || strings.TrimSpace(string(res.Tests[0].Stdout)) != "0" || res.SandboxId == leak.SandboxId {
			t.Fatalf("after the leak: %v %s", err, describe(res))
		}
	}
}

// waitGone waits until a sandbox no longer exists.
func waitGone(t *testing.T, id string) {
	t.Helper()
	c := sdk(t)
	for i := 0; i < 300; i++ {
		if _, err := c.Get(context.Background(), id); connect.CodeOf(err) == connect.CodeNotFound {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("sandbox %s still exists", id)
}

func TestIsolationSandboxPerCall(t *testing.T) {
	need(t)
	c := sdk(t).FnCall()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var ids []string
	for i := 0; i < 3; i++ {
		res, err := c.Run(ctx, &pb.RunRequest{Language: "python", Source: "import os\nprint(os.listdir('/box'), os.listdir('/tmp'))\nopen('/tmp/x', 'w').write('x')\n", Isolation: pb.Isolation_ISOLATION_SANDBOX})
		if err != nil {
			t.Fatal(err)
		}
		if res.Verdict != pb.Verdict_VERDICT_OK || string(res.Tests[0].Stdout) != "['main.py'] []\n" {
			t.Fatalf("call %d: %s", i, describe(res))
		}
		ids = append(ids, res.SandboxId)
	}
	if ids[0] == ids[1] || ids[1] == ids[2] || ids[0] == ids[2] {
		t.Fatalf("sandboxes reused: %v", ids)
	}
	for _, id := range ids {
		waitGone(t, id)
	}
}

// CPU time and memory are those of the whole process tree (the run's
// cgroups), and the process limit holds.
func TestProcessTreeAccounting(t *testing.T) {
	need(t)
	c := sdk(t).FnCall()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	res, err := c.Run(ctx, &pb.RunRequest{Language: "c", Source: `#include <unistd.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
static void burn(double s){clock_t t=clock();volatile long x=0;while((double)(clock()-t)/CLOCKS_PER_SEC<s)x++;}
int main(void){
	/* Both children hold their 40 MiB at once (the peak is what is checked):
	   each says so on "ready" and waits for "go", which the parent closes
	   once both have; on a loaded host one child could otherwise finish
	   before the other had touched its memory. */
	int ready[2], go[2]; char c;
	if(pipe(ready)||pipe(go)) return 3;
	for(int i=0;i<2;i++) if(fork()==0){
		close(go[1]); volatile char*p=malloc(40<<20); for(int j=0;j<(40<<20);j+=4096)p[j]=1;
		if(write(ready[1],"x",1)!=1) return 4; if(read(go[0],&c,1)!=0) return 5;
		burn(0.3); return p[4096]-1; }
	close(go[0]);
	for(int i=0;i<2;i++) if(read(ready[0],&c,1)!=1) return 6;
	close(go[1]);
	int st, bad=0;
	while(wait(&st)>0) bad|=!WIFEXITED(st)||WEXITSTATUS(st);
	return bad;
}
`, Limits: &pb.Limits{CpuTimeMs: 5000, MemoryBytes: 256 << 20,
		// What is checked is the accounting, not the wall clock: the
		// default (2 × CPU + 1 s) ran out once on a host at load ~30.
		WallTimeMs: 120000}})
	if err != nil || res.Verdict != pb.Verdict_VERDICT_OK {
		t.Fatalf("%v %s", err, describe(res))
	}
	x := res.Tests[0]
	if x.CpuMs < 550 || x.MemoryBytes < 80<<20 {
		t.Fatalf("children not accounted: cpu %.1f ms (want >= 600), peak %d bytes (want >= 80 MiB)", x.CpuMs, x.MemoryBytes)
	}
	// A fork bomb against a process limit of 16 fails without harm.
	res, err = c.Run(ctx, &pb.RunRequest{Language: "python", Source: "import os\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            import time; time.sleep(100)\n        n += 1\nexcept OSError as e:\n    print('stopped after', n, e.errno)\n",
		Limits: &pb.Limits{Processes: 16, WallTimeMs: 3000}})
	if err != nil || res.Verdict != pb.Verdict_VERDICT_OK || !strings.HasPrefix(string(res.Tests[0].Stdout), "stopped after 15 11") {
		t.Fatalf("fork bomb: %v %s", err, describe(res))
	}
}

func TestCompileOnceRunAllAndOptions(t *testing.T) {
	need(t)
	c := sdk(t).FnCall()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	src := "#include <stdio.h>\n#include <stdlib.h>\nint main(int argc,char**argv){double x;FILE*f=fopen(\"data/k.txt\",\"r\");int k;fscanf(f,\"%d\",&k);scanf(\"%lf\",&x);printf(\"%.4f %d %s %d\\n\",x/3,k,argc>1?argv[1]:\"-\",VALUE);return 0;}\n"
	var tests []*pb.TestCase
	for i := 1; i <= 20; i++ {
		tests = append(tests, &pb.TestCase{Stdin: fmt.Sprint(i), Expected: str(fmt.Sprintf("%.6f 7 arg 5", float64(i)/3))})
	}
	tests = append(tests, &pb.TestCase{Name: "exact-fails", Stdin: "1", Expected: str("0.3333 7 arg 5\n"), Compare: pb.Compare_COMPARE_EXACT})
	res, err := c.Run(ctx, &pb.RunRequest{
		Language: "c", Source: src, Tests: tests, Compare: pb.Compare_COMPARE_FLOAT, FloatTolerance: 1e-3,
		CompileOptions: []string{"-DVALUE=5"}, Args: []string{"arg"},
		Files: []*pb.File{{Path: "data/k.txt", Content: []byte("7\n")}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Compile == nil || len(res.Tests) != 21 || res.Verdict != pb.Verdict_VERDICT_OK {
		t.Fatalf("%s", describe(res))
	}
	// stop_on_failure skips what follows a failure.
	res, err = c.Run(ctx, &pb.RunRequest{Language: "python", Source: "print(input())", StopOnFailure: true, Tests: []*pb.TestCase{
		{Stdin: "a", Expected: str("a")}, {Stdin: "b", Expected: str("x")}, {Stdin: "c", Expected: str("c")},
	}})
	if err != nil || res.Verdict != pb.Verdict_VERDICT_WA || res.Tests[1].Verdict != pb.Verdict_VERDICT_WA || res.Tests[2].Verdict != pb.Verdict_VERDICT_SKIPPED {
		t.Fatalf("stop on failure: %v %s", err, describe(res))
	}
}

func TestMalformedRequests(t *testing.T) {
	need(t)
	c := sdk(t)
	fc := c.FnCall()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for name, req := range map[string]*pb.RunRequest{
		"no language":         {Source: "print(1)"},
		"unknown language":    {Language: "cobol", Source: "x"},
		"file escapes":        {Language: "python", Source: "x", Files: []*pb.File{{Path: "../etc/passwd"}}},
		"absolute file":       {Language: "python", Source: "x", Files: []*pb.File{{Path: "/etc/passwd"}}},
		"file is the source":  {Language: "python", Source: "x", Files: []*pb.File{{Path: "main.py"}}},
		"file mode":           {Language: "python", Source: "x", Files: []*pb.File{{Path: "a", Mode: 0o4755}}},
		"negative limit":      {Language: "python", Source: "x", Limits: &pb.Limits{CpuTimeMs: -1}},
		"limit over max":      {Language: "python", Source: "x", Limits: &pb.Limits{CpuTimeMs: 3600 * 1000}},
		"memory too small":    {Language: "python", Source: "x", Limits: &pb.Limits{MemoryBytes: 1000}},
		"stdin and tests":     {Language: "python", Source: "x", Stdin: "1", Tests: []*pb.TestCase{{Stdin: "2"}}},
		"options, no compile": {Language: "python", Source: "x", CompileOptions: []string{"-O2"}},
		"compare mode":        {Language: "python", Source: "x", Compare: pb.Compare(42)},
		"isolation":           {Language: "python", Source: "x", Isolation: pb.Isolation(42)},
	} {
		if _, err := fc.Run(ctx, req); connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("%s: got %v, want invalid_argument", name, err)
		}
	}
	// A batch with a malformed call: that call gets SE, the others run.
	got := map[int32]*pb.RunResult{}
	err := fc.RunBatch(ctx, []*pb.RunRequest{
		{Language: "python", Source: "print(1)"},
		{Language: "cobol", Source: "x"},
		{Language: "python", Source: "print(2)", Files: []*pb.File{{Path: "../x"}}},
		{Language: "python", Source: "print(3)"},
	}, 0, func(r *pb.RunBatchResult) error {
		got[r.Index] = r.Result
		return nil
	})
	if err != nil || len(got) != 4 {
		t.Fatalf("batch: %v, %d results", err, len(got))
	}
	if got[0].Verdict != pb.Verdict_VERDICT_OK || got[3].Verdict != pb.Verdict_VERDICT_OK ||
		got[1].Verdict != pb.Verdict_VERDICT_SE || !strings.Contains(got[1].Error, "cobol") ||
		got[2].Verdict != pb.Verdict_VERDICT_SE || !strings.Contains(got[2].Error, "../x") {
		t.Fatalf("batch results: %v", got)
	}
	// The session API's create with backend fncall says what to use.
	_, err = c.Create(ctx, &pb.CreateSandboxRequest{Backend: "fncall", Base: testBase})
	if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "FnCallService") {
		t.Fatalf("create backend=fncall: %v", err)
	}
	// Other creates still work.
	sb, err := c.Create(ctx, &pb.CreateSandboxRequest{Base: testBase})
	if err != nil {
		t.Fatal(err)
	}
	c.Delete(ctx, sb.Id)
}

// RunBatch streams results as they finish: fast calls come back while
// slow ones still run; every call comes back once.
func TestBatchStreams(t *testing.T) {
	need(t)
	fc := sdk(t).FnCall()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var calls []*pb.RunRequest
	calls = append(calls, &pb.RunRequest{Language: "python", Source: "import time\ntime.sleep(15)\nprint('slow')", Limits: &pb.Limits{WallTimeMs: 30000}})
	for i := 0; i < 60; i++ {
		calls = append(calls, &pb.RunRequest{Language: "python", Source: fmt.Sprintf("print(%d)", i)})
	}
	// Streaming is checked by order, not by a time a loaded host may miss:
	// a fast call comes back before the slow one (15 s) does, and not in
	// the same moment (results batched at the end would arrive together).
	seen := map[int32]bool{}
	var firstFast, slow time.Time
	err := fc.RunBatch(ctx, calls, 0, func(r *pb.RunBatchResult) error {
		if seen[r.Index] {
			return fmt.Errorf("index %d twice", r.Index)
		}
		seen[r.Index] = true
		want := "slow\n"
		if r.Index > 0 {
			want = fmt.Sprintf("%d\n", r.Index-1)
		}
		if r.Result.Verdict != pb.Verdict_VERDICT_OK || string(r.Result.Tests[0].Stdout) != want {
			return fmt.Errorf("call %d: %s", r.Index, describe(r.Result))
		}
		if r.Index == 0 {
			slow = time.Now()
		} else if firstFast.IsZero() {
			firstFast = time.Now()
		}
		return nil
	})
	if err != nil || len(seen) != len(calls) {
		t.Fatalf("%v (%d results)", err, len(seen))
	}
	if firstFast.IsZero() || !firstFast.Before(slow) || slow.Sub(firstFast) < time.Second {
		t.Fatalf("first fast result %v, slow result %v: results did not stream while the slow call ran", firstFast.Format(time.StampMilli), slow.Format(time.StampMilli))
	}
}

func TestCLI(t *testing.T) {
	need(t)
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	cpp := write("main.cpp", "#include <iostream>\nint main(){long a,b;std::cin>>a>>b;std::cout<<a+b<<\"\\n\";}\n")
	tests := write("tests.json", `[{"stdin": "1 2", "expected": "3"}, {"name": "big", "stdin": "1000000000 1000000000", "expected": "2000000000"}]`)
	out, code := run(nil, "run", "--lang", "cpp", cpp, "--tests", tests, "--time", "2s", "--memory", "256M")
	if code != 0 || !strings.Contains(out, "verdict: OK (2/2 tests passed)") || !strings.Contains(out, "compile  OK") {
		t.Fatalf("run --tests: code %d\n%s", code, out)
	}
	// A plain run passes stdin, prints the program's output, exits like it.
	py := write("a.py", "import sys\nd = sys.stdin.read()\nprint(d.upper(), end='')\nsys.exit(int(sys.argv[1]))\n")
	stdout, stderr, code := run3([]byte("hello\n"), "run", py, "--stdin", "-", "--", "4")
	if stdout != "HELLO\n" || code != 4 || !strings.Contains(stderr, "RE") {
		t.Fatalf("plain run: code %d stdout %q stderr %q", code, stdout, stderr)
	}
	bad := write("bad.c", "int main(void){return x;}\n")
	if out, code := run(nil, "run", bad); code != 1 || !strings.Contains(out, "undeclared") || !strings.Contains(out, "CE") {
		t.Fatalf("CE: code %d\n%s", code, out)
	}
	// --batch: JSONL in, JSONL out as calls finish.
	var lines []string
	for i := 0; i < 10; i++ {
		lines = append(lines, fmt.Sprintf(`{"language":"python","source":"print(%d)","tests":[{"expected":"%d"}]}`, i, i))
	}
	lines = append(lines, `{"language":"c","source":"int main(void){for(;;);}","limits":{"cpu_time_ms":200}}`)
	batch := write("calls.jsonl", strings.Join(lines, "\n")+"\n")
	stdout, stderr, code = run3(nil, "run", "--batch", batch)
	if code != 0 {
		t.Fatalf("batch: code %d %s", code, stderr)
	}
	verdicts := map[int]string{}
	sc := bufio.NewScanner(strings.NewReader(stdout))
	for sc.Scan() {
		var r struct {
			Index   int    `json:"index"`
			Verdict string `json:"verdict"`
			Tests   []struct {
				Stdout string `json:"stdout"`
			} `json:"tests"`
		}
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatalf("line %q: %v", sc.Text(), err)
		}
		verdicts[r.Index] = r.Verdict
		if r.Index < 10 && r.Tests[0].Stdout != fmt.Sprintf("%d\n", r.Index) {
			t.Fatalf("call %d: %s", r.Index, sc.Text())
		}
	}
	if len(verdicts) != 11 || verdicts[10] != "TLE" || verdicts[3] != "OK" {
		t.Fatalf("batch verdicts: %v\n%s", verdicts, stdout)
	}
	if out, code := run(nil, "run", "--languages"); code != 0 || !strings.Contains(out, "cpp") {
		t.Fatalf("--languages: %s", out)
	}
}

// Idle pools shrink: the test server's idle timeout is 3 s.
func TestPoolShrinksWhenIdle(t *testing.T) {
	need(t)
	c := sdk(t)
	ctx := context.Background()
	if _, err := c.FnCall().Run(ctx, &pb.RunRequest{Language: "bash", Source: "echo hi"}); err != nil {
		t.Fatal(err)
	}
	pooled := func() int {
		sbs, err := c.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, sb := range sbs {
			if _, ok := sb.Metadata[fncall.MetadataKey]; ok {
				n++
			}
		}
		return n
	}
	if pooled() == 0 {
		t.Fatal("no pool sandbox after a call")
	}
	deadline := time.Now().Add(30 * time.Second)
	for pooled() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d pool sandboxes still there after 30 s idle", pooled())
		}
		time.Sleep(250 * time.Millisecond)
	}
}

var _ = shoal.Options{}

// TestCallUIDs: a call runs in a user namespace mapped to an unprivileged
// host range (its sandbox's), and two calls served by one sandbox run as
// different uids.
func TestCallUIDs(t *testing.T) {
	need(t)
	c := sdk(t).FnCall()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	src := "import os\nprint(os.getuid(), os.getgid(), ' '.join(open('/proc/self/uid_map').read().split()))\n"
	type seen struct{ sandbox, uid, gid, uidMap string }
	var calls []seen
	for i := 0; i < 6; i++ {
		res, err := c.Run(ctx, &pb.RunRequest{Language: "python", Source: src})
		if err != nil {
			t.Fatal(err)
		}
		f := strings.Fields(string(res.Tests[0].Stdout))
		if res.Verdict != pb.Verdict_VERDICT_OK || len(f) != 5 {
			t.Fatalf("call: %s", describe(res))
		}
		calls = append(calls, seen{res.SandboxId, f[0], f[1], strings.Join(f[2:], " ")})
	}
	reused := false
	for i, a := range calls {
		if strings.HasPrefix(a.uidMap, "0 0 ") || !strings.HasPrefix(a.uidMap, "0 ") {
			t.Errorf("call %d: uid_map %q, want 0 mapped to an unprivileged host range", i, a.uidMap)
		}
		if a.uid == "0" || a.uid != a.gid {
			t.Errorf("call %d ran as %s:%s", i, a.uid, a.gid)
		}
		for _, b := range calls[:i] {
			if a.sandbox == b.sandbox {
				reused = true
				if a.uid == b.uid {
					t.Errorf("two calls in sandbox %s ran as the same uid %s", a.sandbox, a.uid)
				}
			}
		}
	}
	if !reused {
		t.Logf("no sandbox served two of %d calls: %+v", len(calls), calls)
	}
}

// A serve that stops (SIGTERM) deletes its FnCall pools' idle sandboxes
// before it exits (it used to leave them to the next start): their
// containers are gone from runc.
func TestShutdownStopsPools(t *testing.T) {
	need(t)
	c := sdk(t)
	ctx := context.Background()
	if _, err := c.FnCall().Run(ctx, &pb.RunRequest{Language: "bash", Source: "echo hi"}); err != nil {
		t.Fatal(err)
	}
	sbs, err := c.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var pooled []string
	for _, sb := range sbs {
		if _, ok := sb.Metadata[fncall.MetadataKey]; ok && sb.Runtime["runc_id"] != "" {
			pooled = append(pooled, sb.Runtime["runc_id"])
		}
	}
	if len(pooled) == 0 {
		t.Fatal("no pool sandbox after a call")
	}
	serveCmd.Process.Signal(syscall.SIGTERM)
	exited := make(chan error, 1)
	go func() { exited <- serveCmd.Wait() }()
	select {
	case <-exited:
	case <-time.After(time.Minute):
		serveCmd.Process.Kill()
		<-exited
		t.Error("serve did not stop within a minute of SIGTERM")
	}
	defer func() {
		if err := startServe(); err != nil {
			t.Fatal(err)
		}
	}()
	for _, id := range pooled {
		if out, err := exec.Command("runc", "--root", filepath.Join(dataDir, "runc"), "state", id).CombinedOutput(); err == nil {
			t.Errorf("pool container %s still there after serve stopped: %s", id, out)
		}
	}
}

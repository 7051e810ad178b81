// Command shoal-agent is Shoal's guest agent: PID 1 of a container (or init
// of a VM) serving exec and files to the host node over a unix socket.
//
// It listens on the socket passed as fd $SHOAL_AGENT_FD, or else on
// --listen PATH. As a sandbox's init (PID 1) it survives every signal the
// workload can send it; otherwise SIGTERM kills every command's process
// group and exits 0.
// See internal/agent for the protocol.
package main

import (
	"flag"
	"fmt"
	"os"
	"runtime"
	"time"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/agent/vminit"
	"github.com/shoal-sandbox/shoal/internal/forkserver"
	"golang.org/x/sys/unix"
)

// Before anything else, even flag parsing: no process of the sandbox may
// trace the agent or reach into it through /proc (agent.SetNotDumpable).
// Both modes, cold and pooled, go through here; StartBoot does it again and
// fails closed.
func init() {
	// Started by the node as its fork server (not in a sandbox): serve it
	// and nothing else (forkserver.Serve never returns then).
	forkserver.Serve()
	agent.SetNotDumpable()
	// Started by the native launcher: set the container up, then execute
	// the agent again inside it (agent.NativeInit never returns then).
	agent.NativeInit()
}

func main() {
	listen := flag.String("listen", "", "unix socket `path` to listen on when $SHOAL_AGENT_FD is not set")
	version := flag.Bool("version", false, "print the version and exit")
	vmService := flag.Bool("vm-service", false, "serve as the service of a full system's VM (the fullvm backend's shoal-agent.service)")
	flag.Parse()
	if *version {
		fmt.Println(agent.Version)
		return
	}
	log := agent.StderrLogger{}
	// One P: the agent mostly waits on pipes, sockets and children, and
	// every extra P keeps its own caches and threads (measured: idle RSS
	// 4084 KiB with 2 Ps, 3840 KiB with 1). $GOMAXPROCS still wins.
	if os.Getenv("GOMAXPROCS") == "" {
		runtime.GOMAXPROCS(1)
	}
	agent.PaceGCByGrowth()

	if vminit.Active() {
		runVM(log) // the init of a VM (vm.go)
	}
	if *vmService {
		runVMService(log) // a full system's service (vm.go)
	}
	// Not PID 1 (a test, a dev run): become a child subreaper so that
	// orphans of our commands are still ours to reap.
	if os.Getpid() != 1 {
		unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
	}
	// The seccomp filter goes on before anything else runs; failing to
	// install it is fatal (see agent.StartBoot).
	boot, err := agent.StartBoot()
	if err != nil {
		bootFailed(log, boot, "boot", err)
	}
	// In the background: the first request must not wait for it. A pooled
	// agent starts them before it reports ready (below).
	if !boot.Pooled() {
		go prewarmThreads(prewarm)
	}
	l, err := agent.Listen(*listen)
	if err != nil {
		bootFailed(log, boot, "listen", err)
	}
	srv := agent.NewServer(agent.Config{ReapAll: true, IdleRelease: time.Second, Logger: log, CommandsIdle: boot.CommandsIdle()})
	// Before the first command (a pooled agent's claim, below): as the
	// sandbox's init, no signal of the workload ends the agent; otherwise
	// (a test, a dev run) SIGTERM and SIGINT stop it.
	var stop func()
	if os.Getpid() != 1 {
		stop = func() {
			srv.Shutdown()
			os.Exit(0)
		}
	}
	agent.HandleSignals(log, stop)
	if boot.Pooled() {
		// Where the pool's filler waits, not a create: started at its
		// claim, they cost the claim and the first command ~4 ms of CPU
		// on a 2-core host (cgroup cpuacct of the sandbox: claim 8.9 ->
		// 4.3 ms), more than the claim's capability drop spends visiting
		// the extra threads. After the server's spawner thread, which the
		// host then finds among the first (container.spawnerThread).
		prewarmThreads(prewarm)
		// Then out of every thread's bounding set: the claim needs the
		// capability effective only (agent.DropBoundingSysAdmin).
		if err := agent.DropBoundingSysAdmin(); err != nil {
			bootFailed(log, boot, "boot", err)
		}
		if err := srv.AcceptClaims(boot); err != nil {
			bootFailed(log, boot, "boot", err)
		}
	}

	boot.Ready(nil)
	if err := srv.Serve(l); err != nil {
		log.Warn("serve", "err", err)
		os.Exit(1)
	}
}

// bootFailed logs why the agent cannot serve, tells the backend waiting
// for it (boot.Ready) and exits.
func bootFailed(log agent.StderrLogger, boot *agent.Boot, what string, err error) {
	log.Warn(what, "err", err)
	boot.Ready(err)
	os.Exit(1)
}

// prewarm is how many threads prewarmThreads starts: with the thread the
// server keeps for forking commands (agent.AgentNice), eight in reserve,
// as before that thread existed (each costs the sandbox ~30 KiB of kernel
// and runtime memory).
const prewarm = 7

// prewarmThreads makes the Go runtime start n OS threads now, while the
// sandbox's pids cgroup has room. The runtime keeps idle threads and reuses
// them, so the agent never needs a new one later; without this, a fork bomb
// that fills the pids limit makes the runtime's next thread creation fail,
// which is fatal: the agent (the sandbox's init) would die with the sandbox.
func prewarmThreads(n int) {
	done := make(chan struct{})
	for i := 0; i < n; i++ {
		go func() {
			// A blocking syscall holds its thread; the scheduler starts
			// another for the next goroutine.
			ts := unix.Timespec{Nsec: 20e6}
			unix.Nanosleep(&ts, nil)
			done <- struct{}{}
		}()
	}
	for i := 0; i < n; i++ {
		<-done
	}
}

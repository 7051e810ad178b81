// Command shoal-agent is Shoal's guest agent: PID 1 of a container (or init
// of a VM) serving exec and files to the host node over a unix socket.
//
// It listens on the socket passed as fd $SHOAL_AGENT_FD, or else on
// --listen PATH. SIGTERM kills every command's process group and exits 0.
// See internal/agent for the protocol.
package main

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"golang.org/x/sys/unix"
)

func main() {
	listen := flag.String("listen", "", "unix socket `path` to listen on when $SHOAL_AGENT_FD is not set")
	version := flag.Bool("version", false, "print the version and exit")
	flag.Parse()
	if *version {
		fmt.Println(agent.Version)
		return
	}
	log := stderrLogger{}

	// Not PID 1 (a test, a dev run): become a child subreaper so that
	// orphans of our commands are still ours to reap.
	if os.Getpid() != 1 {
		unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
	}
	l, err := agent.Listen(*listen)
	if err != nil {
		log.Warn("listen", "err", err)
		os.Exit(1)
	}
	srv := agent.NewServer(agent.Config{ReapAll: true, IdleRelease: time.Second, Logger: log})

	sigc := make(chan os.Signal, 1)
	signal.Notify(sigc, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-sigc
		srv.Shutdown()
		os.Exit(0)
	}()
	if err := srv.Serve(l); err != nil {
		log.Warn("serve", "err", err)
		os.Exit(1)
	}
}

// stderrLogger writes "shoal-agent: msg key=value ..." lines. It stands in
// for log/slog, which would cost the agent about 370 KiB of RSS.
type stderrLogger struct{}

func (stderrLogger) Warn(msg string, args ...any) {
	line := "shoal-agent: " + msg
	for i := 0; i+1 < len(args); i += 2 {
		line += fmt.Sprintf(" %v=%v", args[i], args[i+1])
	}
	fmt.Fprintln(os.Stderr, line)
}

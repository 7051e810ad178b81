package main

import (
	"errors"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/agent/vminit"
)

// runVM is the agent as the init of a VM (the microvm backend): it
// assembles the sandbox's root from the layer devices, switches to it and
// serves on the VM's virtio-serial port. It never returns: PID 1 of a VM
// that cannot serve powers the VM off, with the reason on its console.
func runVM(log agent.Logger) {
	// The init of the VM: the kernel panics when it exits.
	agent.HandleSignals(log, nil)
	cfg, l, err := vminit.Boot()
	if err != nil {
		vminit.Fatal(err)
	}
	vminit.Fatal(serveVM(log, cfg, l))
}

// runVMService is the agent as shoal-agent.service of a full system (the
// fullvm backend): systemd is PID 1, started by the agent in the initramfs
// (vminit.Boot). A failure exits, and systemd starts it again.
func runVMService(log agent.Logger) {
	cfg, l, err := vminit.Service()
	if err == nil {
		// The commands' cgroup below the service's (delegated to it).
		if cfg.Commands, cfg.CommandsPath, err = vminit.ServiceCgroup(cfg.Pids); err != nil {
			log.Warn("no cgroup for the commands: no tasks limit, commits stop them with signals", "err", err)
			err = nil
		}
		// Orphans of our commands are still ours to reap.
		unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
		err = serveVM(log, cfg, l)
	}
	log.Warn("vm service", "err", err)
	os.Exit(1)
}

// serveVM serves the agent protocol on the VM's port until it fails.
func serveVM(log agent.Logger, cfg *vminit.Config, l net.Listener) error {
	// 127.0.0.1 reachable (servers the workload starts, port forwarding)
	// and the host name resolvable, as in a container.
	if err := agent.LoopbackUp(); err != nil {
		return err
	}
	if err := agent.BindHosts(cfg.Hostname); err != nil {
		log.Warn("the host name will not resolve", "err", err)
	}
	go prewarmThreads(prewarm)
	// Above the commands (see agent.AgentNice); root of the guest may.
	if err := agent.Prioritize(os.Getpid(), agent.AgentNice); err != nil {
		log.Warn("the agent runs at its commands' priority", "err", err)
	}
	srv := agent.NewServer(agent.Config{ReapAll: true, IdleRelease: time.Second, Logger: log, Env: cfg.Env, Upper: cfg.Upper,
		SystemService: os.Getpid() != 1 && cfg.System, CommandsCgroup: cfg.Commands, CommandsCgroupPath: cfg.CommandsPath})
	if err := srv.Serve(l); err != nil {
		return err
	}
	return errors.New("agent channel closed")
}

package main

import (
	"errors"
	"time"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/agent/vminit"
)

// runVM is the agent as the init of a VM (the microvm backend): it
// assembles the sandbox's root from the layer devices, switches to it and
// serves on the VM's virtio-serial port. It never returns: PID 1 of a VM
// that cannot serve powers the VM off, with the reason on its console.
func runVM(log agent.Logger) {
	cfg, l, err := vminit.Boot()
	if err != nil {
		vminit.Fatal(err)
	}
	// 127.0.0.1 reachable (servers the workload starts, port forwarding)
	// and the host name resolvable, as in a container.
	if err := agent.LoopbackUp(); err != nil {
		vminit.Fatal(err)
	}
	if err := agent.BindHosts(cfg.Hostname); err != nil {
		log.Warn("the host name will not resolve", "err", err)
	}
	go prewarmThreads(8)
	srv := agent.NewServer(agent.Config{ReapAll: true, IdleRelease: time.Second, Logger: log, Env: cfg.Env, Upper: cfg.Upper})
	err = srv.Serve(l)
	if err == nil {
		err = errors.New("agent channel closed")
	}
	vminit.Fatal(err)
}

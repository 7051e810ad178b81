package main

import (
	"fmt"
	"log/slog"
	"path/filepath"

	"github.com/spf13/cobra"

	"github.com/shoal-sandbox/shoal/internal/backend/microvm"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// vmConfig configures the VM backends (internal/backend/microvm).
type vmConfig struct {
	MicroVM   string // auto | on | off
	KernelDir string
	Accel     string // auto | kvm | tcg
	QEMU      string
}

func addVMFlags(cmd *cobra.Command, c *vmConfig) {
	cmd.Flags().StringVar(&c.MicroVM, "microvm", "auto", "the microvm backend (QEMU -M microvm): auto (when QEMU and the guest kernel are installed), on (fail to start otherwise) or off")
	cmd.Flags().StringVar(&c.KernelDir, "vm-kernel", microvm.DefaultKernelDir, "directory of the VM guest kernel and its modules (scripts/vmkernel.sh makes it)")
	cmd.Flags().StringVar(&c.Accel, "vm-accel", "auto", "VM accelerator: auto (KVM when a probe guest boots on it, else TCG; $SHOAL_VM_ACCEL overrides), kvm or tcg")
	cmd.Flags().StringVar(&c.QEMU, "vm-qemu", "qemu-system-x86_64", "QEMU binary of the VM backends")
}

// vmBackends returns the VM backends this node offers, or an error when one
// is required (--microvm on) but cannot run here.
func vmBackends(c vmConfig, dataDir, agentBin string, log *slog.Logger) ([]sandbox.Backend, error) {
	switch c.MicroVM {
	case "off":
		return nil, nil
	case "auto", "on":
	default:
		return nil, fmt.Errorf("--microvm %q: want auto, on or off", c.MicroVM)
	}
	cfg := microvm.Config{Name: "microvm", Machine: microvm.MachineMicroVM, QEMU: c.QEMU, KernelDir: c.KernelDir,
		StateDir: filepath.Join(dataDir, "vm"), AgentBinary: agentBin, Accel: c.Accel, Logger: log}
	if err := cfg.Check(); err != nil {
		if c.MicroVM == "on" {
			return nil, fmt.Errorf("--microvm on: %w", err)
		}
		log.Info("backend microvm: not available on this node", "why", err)
		return nil, nil
	}
	b, err := microvm.New(cfg)
	if err != nil {
		if c.MicroVM == "on" {
			return nil, err
		}
		log.Warn("backend microvm: not available on this node", "why", err)
		return nil, nil
	}
	return []sandbox.Backend{b}, nil
}

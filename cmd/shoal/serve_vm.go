//go:build !client

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
	FullVM    string // auto | on | off
	KernelDir string
	Accel     string // auto | kvm | tcg
	QEMU      string
}

func addVMFlags(cmd *cobra.Command, c *vmConfig) {
	cmd.Flags().StringVar(&c.MicroVM, "microvm", "auto", "the microvm backend (QEMU -M microvm): auto (when QEMU and the guest kernel are installed), on (fail to start otherwise) or off")
	cmd.Flags().StringVar(&c.FullVM, "fullvm", "auto", "the fullvm backend (QEMU q35, PCI devices; same guest kernel and agent as microvm for now): auto, on or off")
	cmd.Flags().StringVar(&c.KernelDir, "vm-kernel", microvm.DefaultKernelDir, "directory of the VM guest kernel and its modules (scripts/vmkernel.sh makes it)")
	cmd.Flags().StringVar(&c.Accel, "vm-accel", "auto", "VM accelerator: auto (KVM when a probe guest boots on it, else TCG; $SHOAL_VM_ACCEL overrides), kvm or tcg")
	cmd.Flags().StringVar(&c.QEMU, "vm-qemu", "qemu-system-x86_64", "QEMU binary of the VM backends")
}

// vmBackends returns the VM backends this node offers, or an error when one
// is required (--microvm on, --fullvm on) but cannot run here.
func vmBackends(c vmConfig, dataDir, agentBin string, log *slog.Logger) ([]sandbox.Backend, error) {
	var out []sandbox.Backend
	for _, k := range []struct{ name, machine, mode string }{
		{"microvm", microvm.MachineMicroVM, c.MicroVM},
		{"fullvm", microvm.MachineQ35, c.FullVM},
	} {
		switch k.mode {
		case "off":
			continue
		case "auto", "on":
		default:
			return nil, fmt.Errorf("--%s %q: want auto, on or off", k.name, k.mode)
		}
		cfg := microvm.Config{Name: k.name, Machine: k.machine, QEMU: c.QEMU, KernelDir: c.KernelDir,
			StateDir: filepath.Join(dataDir, "vm"), AgentBinary: agentBin, Accel: c.Accel, Logger: log}
		b, err := microvm.New(cfg)
		if err != nil {
			if k.mode == "on" {
				return nil, fmt.Errorf("--%s on: %w", k.name, err)
			}
			log.Info("backend "+k.name+": not available on this node", "why", err)
			continue
		}
		out = append(out, b)
	}
	return out, nil
}

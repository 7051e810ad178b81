//go:build !client

package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/shoal-sandbox/shoal/internal/backend/microvm"
	"github.com/shoal-sandbox/shoal/internal/egress"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// vmConfig configures the VM backends (internal/backend/microvm).
type vmConfig struct {
	MicroVM   string // auto | on | off
	FullVM    string // auto | on | off
	KernelDir string
	Image     string // the fullvm base image
	Accel     string // auto | kvm | tcg
	Layers    string // auto | pmem | blk
	QEMU      string
	DiskIOPS  int64  // each VM's disk requests per second (0: unbounded)
	DiskBPS   string // each VM's disk bytes per second, as a size (0: unbounded)
	Pause     string // snapshot | in-place
	Boot      string // cold | template
}

func addVMFlags(cmd *cobra.Command, c *vmConfig) {
	cmd.Flags().StringVar(&c.MicroVM, "microvm", "auto", "the microvm backend (QEMU -M microvm): auto (when QEMU and the guest kernel are installed), on (fail to start otherwise) or off")
	cmd.Flags().StringVar(&c.FullVM, "fullvm", "auto", "the fullvm backend (QEMU q35 booting a full Debian system from a copy-on-write overlay of --vm-image): auto, on or off")
	cmd.Flags().StringVar(&c.KernelDir, "vm-kernel", microvm.DefaultKernelDir, "directory of the VM guest kernel and its modules (scripts/vmkernel.sh makes it)")
	cmd.Flags().StringVar(&c.Image, "vm-image", filepath.Join(microvm.DefaultKernelDir, microvm.ImageLink), "the fullvm backend's base image (`shoal vm image build` makes it)")
	cmd.Flags().StringVar(&c.Accel, "vm-accel", "auto", "VM accelerator: auto (KVM when a probe guest boots on it, else TCG; $SHOAL_VM_ACCEL overrides), kvm or tcg")
	cmd.Flags().StringVar(&c.Layers, "vm-layers", "auto", "how layers reach a microVM: pmem (persistent memory mounted with DAX: guests share the host's page cache of a layer), blk (read-only virtio-blk devices) or auto (pmem when the guest kernel and QEMU support it, else blk; logged with the reason)")
	cmd.Flags().StringVar(&c.QEMU, "vm-qemu", "qemu-system-x86_64", "QEMU binary of the VM backends")
	cmd.Flags().Int64Var(&c.DiskIOPS, "vm-disk-iops", 4000, "disk requests per second each VM may make, all its drives together (QEMU's throttling; 0: unbounded)")
	cmd.Flags().StringVar(&c.DiskBPS, "vm-disk-bps", "256M", "disk bytes per second each VM may read and write, all its drives together (0: unbounded)")
	cmd.Flags().StringVar(&c.Boot, "vm-boot", microvm.BootCold, "how a microVM starts: cold (every create boots its guest) or template (a create restores a snapshot of a guest booted once for its shape: memory, CPUs, device count; layers then go as blk devices)")
	cmd.Flags().StringVar(&c.Pause, "vm-pause", microvm.PauseSnapshot, "how a VM is paused: snapshot (its state to a file, QEMU ended: no memory left on the host; a resume restores it in a new QEMU) or in-place (QEMU stopped, its memory paged out to zram but for the translated code it last ran: ~20 MiB of RSS plus the compressed memory; a resume continues it, ~5x faster under TCG)")
}

// vmBackends returns the VM backends this node offers, or an error when one
// is required (--microvm on, --fullvm on) but cannot run here.
func vmBackends(c vmConfig, dataDir, agentBin, cgroupParent string, eg *egress.Egress, log *slog.Logger) ([]sandbox.Backend, error) {
	var out []sandbox.Backend
	if c.DiskIOPS < 0 {
		return nil, fmt.Errorf("--vm-disk-iops %d: want 0 (unbounded) or more", c.DiskIOPS)
	}
	var diskBPS int64
	if c.DiskBPS != "" {
		n, err := parseBytes(c.DiskBPS) // never negative
		if err != nil {
			return nil, fmt.Errorf("--vm-disk-bps %q: want a size per second (256M) or 0 (unbounded)", c.DiskBPS)
		}
		diskBPS = n
	}
	switch c.Layers {
	case microvm.LayersAuto, microvm.LayersPmem, microvm.LayersBlk:
	default:
		return nil, fmt.Errorf("--vm-layers %q: want auto, pmem or blk", c.Layers)
	}
	switch c.Pause {
	case "", microvm.PauseSnapshot, microvm.PauseInPlace:
	default:
		return nil, fmt.Errorf("--vm-pause %q: want %s or %s", c.Pause, microvm.PauseSnapshot, microvm.PauseInPlace)
	}
	switch c.Boot {
	case "", microvm.BootCold:
	case microvm.BootTemplate:
		if c.Layers == microvm.LayersPmem {
			return nil, fmt.Errorf("--vm-boot %s with --vm-layers %s: a template's memory cannot hold a sandbox's layers; use --vm-layers blk or auto", c.Boot, c.Layers)
		}
	default:
		return nil, fmt.Errorf("--vm-boot %q: want %s or %s", c.Boot, microvm.BootCold, microvm.BootTemplate)
	}
	for _, k := range []struct{ name, machine, mode, image string }{
		{"microvm", microvm.MachineMicroVM, c.MicroVM, ""},
		{"fullvm", microvm.MachineQ35, c.FullVM, c.Image},
	} {
		switch k.mode {
		case "off":
			continue
		case "auto", "on":
		default:
			return nil, fmt.Errorf("--%s %q: want auto, on or off", k.name, k.mode)
		}
		cfg := microvm.Config{Name: k.name, Machine: k.machine, QEMU: c.QEMU, KernelDir: c.KernelDir, Image: k.image,
			StateDir: filepath.Join(dataDir, "vm"), AgentBinary: agentBin, Accel: c.Accel, CgroupParent: cgroupParent, Egress: eg,
			DiskIOPS: c.DiskIOPS, DiskBPS: diskBPS, Pause: c.Pause, Logger: log}
		if k.machine == microvm.MachineMicroVM {
			cfg.Layers, cfg.Boot = c.Layers, c.Boot
		}
		b, err := microvm.New(cfg)
		if err != nil {
			if k.mode == "on" {
				return nil, fmt.Errorf("--%s on: %w", k.name, err)
			}
			if errors.Is(err, microvm.ErrNoPmem) {
				return nil, fmt.Errorf("--vm-layers pmem: %w", err)
			}
			log.Info("backend "+k.name+": not available on this node", "why", err)
			continue
		}
		out = append(out, b)
	}
	return out, nil
}

// vmCmd is `shoal vm`: the node's VM backends' local set-up.
func vmCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "vm", Short: "Set up this node's VM backends (run on the node, as root)"}
	image := &cobra.Command{Use: "image", Short: "The fullvm backend's base image"}
	var spec microvm.ImageSpec
	var free string
	build := &cobra.Command{
		Use:   "build [--dir DIR] [--package P]... [--mirror URL] [--free 4G]",
		Short: "Build the full Debian system that fullvm sandboxes boot (debootstrap; cached: built again only when its packages change)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if free != "" {
				n, err := parseBytes(free)
				if err != nil || n < 64<<20 || n > 1<<40 {
					return fmt.Errorf("--free %q: want a size from 64M to 1T", free)
				}
				spec.FreeBytes = n
			}
			ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			spec.Logger = slog.New(slog.NewTextHandler(os.Stderr, nil))
			img, err := microvm.BuildImage(ctx, spec)
			if err != nil {
				return err
			}
			fmt.Println(img)
			return nil
		},
	}
	build.Flags().StringVar(&spec.Dir, "dir", microvm.DefaultKernelDir, "directory of the images (serve --vm-image is DIR/"+microvm.ImageLink+", a link to the newest)")
	build.Flags().StringSliceVar(&spec.Packages, "package", nil, "Debian packages installed over minbase (default: systemd, systemd-sysv, udev, dbus, procps; give them all)")
	build.Flags().StringVar(&spec.Mirror, "mirror", "", "Debian mirror (default http://deb.debian.org/debian)")
	build.Flags().StringVar(&free, "free", "", "free space of the image's file system: the system's slack, to which each sandbox's --disk is added (default 256M)")
	image.AddCommand(build)
	cmd.AddCommand(image)
	return cmd
}

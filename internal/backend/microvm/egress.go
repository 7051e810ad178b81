package microvm

// Network egress for a VM (internal/egress, shared with the node's other
// backends): the host's end of the sandbox's link is a persistent tap
// device, addressed like a container's veth and under the same nftables
// rules (the rules match the link's name and the guest's address); QEMU
// attaches a virtio-net device to it, on every start (boot and each
// resume: the tap outlives QEMU). The guest's agent loads virtio_net and
// gives eth0 its address and default route from its config (vminit.Net)
// before the root switch. The guest's root may change its own eth0, but
// nothing it sends passes the host's rules but what its policy allows from
// its own address (a spoofed source is dropped). Without egress a VM has
// no network device at all.

import (
	"fmt"

	"github.com/vishvananda/netlink"

	"github.com/shoal-sandbox/shoal/internal/agent/vminit"
	"github.com/shoal-sandbox/shoal/internal/egress"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/netpolicy"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// checkEgress says why this backend cannot give sandbox egress (nil if it
// can): none on the node, or an initramfs without the network modules (the
// guest kernel's directory had none when the node started).
func (b *Backend) checkEgress() error {
	if b.cfg.Egress == nil {
		return fmt.Errorf("%s backend: network egress is disabled on this node (serve --egress-subnet): %w%.0w", b.cfg.Name, sandbox.ErrUnsupported, errdefs.ErrFailedPrecondition)
	}
	if !b.netModules {
		return fmt.Errorf("%s backend: network egress: the guest kernel in %s had no network modules when serve started (run scripts/vmkernel.sh again, then restart serve): %w%.0w", b.cfg.Name, b.cfg.KernelDir, sandbox.ErrUnsupported, errdefs.ErrFailedPrecondition)
	}
	return nil
}

// attachEgress makes sandbox id's link (a tap) and rules, and returns what
// goes into its handle and the guest's side of it.
func (b *Backend) attachEgress(id string, req *netpolicy.Request) (map[string]string, *vminit.Net, error) {
	var guest *vminit.Net
	data, err := b.cfg.Egress.Attach(id, req, func(l *egress.Link) error {
		la := netlink.NewLinkAttrs()
		la.Name = l.HostIf
		// Persistent (it outlives each QEMU), owned by root, as QEMU
		// opens it (with a virtio-net header, one queue).
		tap := &netlink.Tuntap{LinkAttrs: la, Mode: netlink.TUNTAP_MODE_TAP, Flags: netlink.TUNTAP_NO_PI | netlink.TUNTAP_VNET_HDR}
		if err := netlink.LinkAdd(tap); err != nil {
			return fmt.Errorf("create tap %s: %w", l.HostIf, err)
		}
		guest = &vminit.Net{Addr: l.SandboxIP.String(), Gateway: l.HostIP.String()}
		return egress.SetUpHostEnd(l)
	})
	return data, guest, err
}

// netArgs are the QEMU arguments of h's network device: none without
// egress.
func (b *Backend) netArgs(h sandbox.Handle) []string {
	if !egress.Has(h.Data) {
		return nil
	}
	return []string{
		"-netdev", "tap,id=net0,script=no,downscript=no,ifname=" + qemuEscape(h.Data[egress.DataIf]),
		"-device", b.dev("virtio-net") + ",netdev=net0",
	}
}

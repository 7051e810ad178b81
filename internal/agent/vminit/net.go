package vminit

import (
	"errors"
	"fmt"
	"net/netip"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Net is a VM's link for network egress (internal/egress): the guest's
// address and its gateway, the host's end of the link, in one /31. The
// host's nftables rules decide what the guest reaches through it.
type Net struct {
	Addr    string `json:"addr"`
	Gateway string `json:"gateway"`
}

// netIf is the guest's interface: the one virtio-net device.
const netIf = "eth0"

// setUpNet loads the network modules (NetOrder) and gives eth0 the link's
// address and a default route via its gateway, with ioctls (the agent
// carries no netlink library: it is every sandbox's PID 1).
func setUpNet(n *Net) error {
	addr, err1 := netip.ParseAddr(n.Addr)
	gw, err2 := netip.ParseAddr(n.Gateway)
	if err1 != nil || err2 != nil || !addr.Is4() || !gw.Is4() {
		return fmt.Errorf("network: address %q, gateway %q: want IPv4 addresses", n.Addr, n.Gateway)
	}
	if err := loadModules(NetOrder, ""); err != nil {
		return err
	}
	s, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("network: %w", err)
	}
	defer unix.Close(s)
	ifr, err := unix.NewIfreq(netIf)
	if err != nil {
		return err
	}
	// The driver probes its device as it loads; wait a little anyway.
	for deadline := time.Now().Add(5 * time.Second); ; {
		err := unix.IoctlIfreq(s, unix.SIOCGIFFLAGS, ifr)
		if err == nil {
			break
		}
		if !errors.Is(err, unix.ENODEV) || time.Now().After(deadline) {
			return fmt.Errorf("network: %s: %w", netIf, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	flags := ifr.Uint16()
	a4, mask := addr.As4(), [4]byte{255, 255, 255, 254}
	for _, step := range []struct {
		what string
		req  uint
		val  []byte
	}{{"address", unix.SIOCSIFADDR, a4[:]}, {"netmask", unix.SIOCSIFNETMASK, mask[:]}} {
		ifr, _ := unix.NewIfreq(netIf)
		if err := ifr.SetInet4Addr(step.val); err != nil {
			return err
		}
		if err := unix.IoctlIfreq(s, step.req, ifr); err != nil {
			return fmt.Errorf("network: %s %s of %s: %w", step.what, addr, netIf, err)
		}
	}
	ifr.SetUint16(flags | unix.IFF_UP)
	if err := unix.IoctlIfreq(s, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("network: set %s up: %w", netIf, err)
	}
	rt := rtentry{flags: unix.RTF_UP | unix.RTF_GATEWAY}
	rt.dst = sockaddr4([4]byte{})
	rt.genmask = sockaddr4([4]byte{})
	rt.gateway = sockaddr4(gw.As4())
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(s), unix.SIOCADDRT, uintptr(unsafe.Pointer(&rt))); e != 0 {
		return fmt.Errorf("network: default route via %s: %w", gw, e)
	}
	return nil
}

// rtentry is the kernel's struct rtentry (linux/route.h) on a 64-bit
// architecture, for SIOCADDRT.
type rtentry struct {
	pad1    uintptr
	dst     [16]byte // struct sockaddr
	gateway [16]byte
	genmask [16]byte
	flags   uint16
	pad2    int16
	pad3    uintptr
	pad4    uintptr
	metric  int16
	dev     uintptr // char *
	mtu     uintptr
	window  uintptr
	irtt    uint16
}

// sockaddr4 is a struct sockaddr_in of a, port 0.
func sockaddr4(a [4]byte) [16]byte {
	var b [16]byte
	*(*uint16)(unsafe.Pointer(&b[0])) = unix.AF_INET // host order, as sa_family is
	copy(b[4:8], a[:])
	return b
}

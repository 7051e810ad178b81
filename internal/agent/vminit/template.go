package vminit

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/procfs"
)

// A template guest (EnvTemplate on its kernel command line) boots as far
// as every VM of its shape boots alike — the kernel, the agent's runtime,
// the modules but one — then says so on the agent port (TemplateReady) and
// waits, without reading, for the port's first byte. The host snapshots it
// there once, and creates each sandbox of that shape by restoring the
// snapshot into a QEMU with the sandbox's own devices: the guest wakes at
// the host's first sync record and goes on as from a boot, with the rest
// that differs per sandbox:
//
//   - virtio_blk (TemplateDeferred) is loaded only then: the block
//     devices (the config disk, the layers, the writable layer's disk)
//     are the sandbox's, and a driver bound before the snapshot would have
//     read the template's (their sizes, their first blocks in its cache);
//   - the kernel's random generator is reseeded from Config.Seed (every
//     restored guest starts from the template's state);
//   - the clock is stepped from the RTC when the session begins
//     (syncClock), as after any snapshot;
//   - the agent's own identity (its boot ID) is made after Boot returns.
//
// What the clones keep of the template: the kernel's boot-time
// randomization (its memory layout, stack canary, hash seeds) and the
// agent's Go runtime seeds. They guard the guest's kernel against its own
// workload, which sees the same values in its own VM only.

const (
	// EnvTemplate makes the guest a template (see above).
	EnvTemplate = "SHOAL_VM_TEMPLATE"
	// TemplateReady is what a template guest writes on the agent port
	// when it waits to be snapshotted.
	TemplateReady = "SHOAL-TEMPLATE-READY\n"
	// TemplateDeferred is the module a template guest loads after its
	// restore only.
	TemplateDeferred = "virtio_blk.ko"
	// SeedLen is the length of Config.Seed.
	SeedLen = 32
)

// waitRestore is a template guest's stop: it writes TemplateReady on the
// agent port and waits until the port has a byte to read. It returns the
// port, still open and unread (closing it would discard the host's first
// record), for the agent's listener.
func waitRestore() (*os.File, error) {
	if _, err := os.Stat("/sys/bus/virtio/drivers/virtio_blk"); err == nil {
		return nil, errors.New("template: virtio_blk is built into the guest's kernel, so its devices were probed before the snapshot")
	}
	zeroFreeMemory()
	p, err := findPort()
	if err != nil {
		return nil, err
	}
	f, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		return nil, err
	}
	if _, err := f.Write([]byte(TemplateReady)); err != nil {
		f.Close()
		return nil, fmt.Errorf("template: %w", err)
	}
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, err
	}
	for {
		var revents int16
		var perr error
		rc.Control(func(fd uintptr) {
			fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
			_, perr = unix.Poll(fds, 1000)
			revents = fds[0].Revents
		})
		switch {
		case errors.Is(perr, unix.EINTR):
		case perr != nil:
			f.Close()
			return nil, fmt.Errorf("template: poll the agent port: %w", perr)
		case revents&unix.POLLHUP != 0:
			// No host connected (a port whose host end is closed
			// polls readable): wait for one.
			time.Sleep(10 * time.Millisecond)
		case revents&unix.POLLIN != 0:
			return f, nil
		}
	}
}

// zeroFreeMemory leaves the guest's free memory zeroed: what the boot
// used and freed (the initramfs's archive, the kernel's init sections,
// caches) still holds its bytes, which the snapshot would carry and each
// restore write back into RAM all over the guest's memory (on a host with
// transparent huge pages, a 2 MiB page cleared for each scattered one).
// It drops the caches, then takes all but a margin of the free memory,
// which the kernel hands over zeroed, and gives it back: a snapshot then
// has only what the guest holds. Best effort: a failure leaves more to
// copy, nothing else.
func zeroFreeMemory() {
	os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0)
	free, _ := procfs.KiB("/proc/meminfo", "MemFree:")
	free <<= 10
	const margin = 32 << 20 // the agent is PID 1: the OOM killer cannot end it
	if free <= 2*margin {
		return
	}
	n := int((free - margin) &^ 4095)
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_POPULATE|unix.MAP_NORESERVE)
	if err != nil {
		return
	}
	unix.Munmap(b)
}

// reseed mixes the host's seed into the kernel's random generator and
// reseeds it, so that a guest restored from a template does not draw the
// numbers every other clone of it draws.
func reseed(seed []byte) error {
	if len(seed) == 0 {
		return nil
	}
	f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	// struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
	info := make([]byte, 8+len(seed))
	binary.NativeEndian.PutUint32(info[0:], uint32(len(seed)*8))
	binary.NativeEndian.PutUint32(info[4:], uint32(len(seed)))
	copy(info[8:], seed)
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.RNDADDENTROPY, uintptr(unsafe.Pointer(&info[0]))); e != 0 {
		return fmt.Errorf("add the host's seed: %w", e)
	}
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.RNDRESEEDCRNG, 0); e != 0 {
		return fmt.Errorf("reseed: %w", e)
	}
	return nil
}

// Package zram sets up a compressed swap device in RAM (zram) on the host,
// so that the anonymous memory of paused sandboxes can be reclaimed: a
// pause pages it out (process_madvise MADV_PAGEOUT, memory.reclaim) into
// swap, where zram keeps it compressed (typically 3-4x smaller).
//
// What it changes on the host, and how to undo it (as root):
//
//	modprobe zram                        # if /sys/class/zram-control is missing
//	cat /sys/class/zram-control/hot_add  # a new device N (or zram0 if unused)
//	echo lz4 > /sys/block/zramN/comp_algorithm
//	echo SIZE > /sys/block/zramN/disksize
//	mkswap /dev/zramN && swapon -p 100 /dev/zramN
//
// Undo: swapoff /dev/zramN (this reads every swapped-out page back into
// RAM: do it with no paused sandbox), then
// echo N > /sys/class/zram-control/hot_remove (or echo 1 >
// /sys/block/zramN/reset). Nothing is persisted across a reboot.
package zram

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Device is an active zram swap device.
type Device struct {
	Name    string // zramN
	Size    int64  // bytes of swap (uncompressed)
	Created bool   // set up by Ensure (else found active)
}

// Active returns the zram devices in use as swap.
func Active() ([]Device, error) {
	data, err := os.ReadFile("/proc/swaps")
	if err != nil {
		return nil, err
	}
	var out []Device
	for _, line := range strings.Split(string(data), "\n")[1:] {
		f := strings.Fields(line)
		if len(f) < 3 || !strings.HasPrefix(f[0], "/dev/zram") {
			continue
		}
		kib, _ := strconv.ParseInt(f[2], 10, 64)
		out = append(out, Device{Name: filepath.Base(f[0]), Size: kib << 10})
	}
	return out, nil
}

// AutoSize is the size of the zram swap serve sets up by default (--zram-size
// auto) on a host of mem bytes of memory: half of it. It is the most the
// swapped-out memory can be, uncompressed; zram takes memory only for what
// it holds, compressed.
func AutoSize(mem int64) int64 { return mem / 2 &^ (1<<20 - 1) }

// EnsureSwap makes sure the host has swap, as serve --zram-size auto does:
// a host with swap (zram or not) is left alone (a zero Device); else a zram
// swap of AutoSize of the host's memory is set up (or one that became
// active meanwhile kept). Tests that need swap call it, so that they run
// on a host that no serve has set up yet.
func EnsureSwap() (Device, error) {
	data, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return Device{}, fmt.Errorf("zram: %w", err)
	}
	var memTotal, swapTotal int64 = -1, -1
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		n, _ := strconv.ParseInt(f[1], 10, 64)
		switch f[0] {
		case "MemTotal:":
			memTotal = n << 10
		case "SwapTotal:":
			swapTotal = n << 10
		}
	}
	if memTotal <= 0 || swapTotal < 0 {
		return Device{}, errors.New("zram: no MemTotal or SwapTotal in /proc/meminfo")
	}
	if swapTotal > 0 {
		return Device{}, nil
	}
	return Ensure(AutoSize(memTotal))
}

// lockPath serializes Ensure across processes: two serves starting at once
// on a host without swap must not both add a device.
const lockPath = "/run/shoal-zram.lock"

// Ensure makes sure a zram swap device is active: an active one is kept
// whatever its size (a restarted node finds the one it made, another serve
// of the host the one it made); else one of size bytes is made (see the
// package comment).
func Ensure(size int64) (Device, error) {
	if size <= 0 {
		return Device{}, errors.New("zram: size must be positive")
	}
	if f, err := os.OpenFile(lockPath, os.O_CREATE|os.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600); err == nil {
		defer f.Close()
		if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
			return Device{}, fmt.Errorf("zram: lock %s: %w", lockPath, err)
		}
	}
	act, err := Active()
	if err != nil {
		return Device{}, fmt.Errorf("zram: %w", err)
	}
	if len(act) > 0 {
		return act[0], nil
	}
	if _, err := os.Stat("/sys/class/zram-control"); err != nil {
		if out, err := exec.Command("modprobe", "zram").CombinedOutput(); err != nil {
			return Device{}, fmt.Errorf("zram: modprobe zram: %v: %s", err, strings.TrimSpace(string(out)))
		}
	}
	name, added, err := freeDevice()
	if err != nil {
		return Device{}, fmt.Errorf("zram: %w", err)
	}
	dir := filepath.Join("/sys/block", name)
	// A device that cannot be set up is reset, and removed if it was
	// added here: a host where swapon is refused (a container) must not
	// gain a device at each start.
	undo := func() {
		os.WriteFile(filepath.Join(dir, "reset"), []byte("1"), 0)
		if added {
			os.WriteFile("/sys/class/zram-control/hot_remove", []byte(strings.TrimPrefix(name, "zram")), 0)
		}
	}
	// lz4: fast, and the kernel's default otherwise (lzo-rle) is ~2x slower
	// to compress for about the same ratio.
	if algs, err := os.ReadFile(filepath.Join(dir, "comp_algorithm")); err == nil && strings.Contains(string(algs), "lz4") {
		os.WriteFile(filepath.Join(dir, "comp_algorithm"), []byte("lz4"), 0)
	}
	if err := os.WriteFile(filepath.Join(dir, "disksize"), []byte(strconv.FormatInt(size, 10)), 0); err != nil {
		undo()
		return Device{}, fmt.Errorf("zram: set %s disksize: %w", name, err)
	}
	dev := "/dev/" + name
	for _, c := range [][]string{{"mkswap", dev}, {"swapon", "-p", "100", dev}} {
		if out, err := exec.Command(c[0], c[1:]...).CombinedOutput(); err != nil {
			undo()
			return Device{}, fmt.Errorf("zram: %s: %v: %s", strings.Join(c, " "), err, strings.TrimSpace(string(out)))
		}
	}
	return Device{Name: name, Size: size, Created: true}, nil
}

// MemUsed is the memory all zram devices take, their compressed pages and
// metadata (mm_stat's mem_used_total), in bytes; 0 without zram.
func MemUsed() int64 {
	var total int64
	devs, _ := filepath.Glob("/sys/block/zram*/mm_stat")
	for _, p := range devs {
		data, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		if f := strings.Fields(string(data)); len(f) >= 3 {
			n, _ := strconv.ParseInt(f[2], 10, 64)
			total += n
		}
	}
	return total
}

// freeDevice returns an unused zram device: a new one (hot_add; added
// true), or zram0 if it is not initialized and the kernel cannot add
// devices.
func freeDevice() (name string, added bool, err error) {
	if data, err := os.ReadFile("/sys/class/zram-control/hot_add"); err == nil {
		return "zram" + strings.TrimSpace(string(data)), true, nil
	}
	if data, err := os.ReadFile("/sys/block/zram0/disksize"); err == nil && strings.TrimSpace(string(data)) == "0" {
		return "zram0", false, nil
	}
	return "", false, errors.New("no free zram device (and /sys/class/zram-control/hot_add is missing)")
}

// Remove turns the swap on device name off and removes the device (see
// the package comment: swapoff reads its pages back into RAM).
func Remove(name string) error {
	if !strings.HasPrefix(name, "zram") {
		return fmt.Errorf("zram: %q is not a zram device", name)
	}
	if out, err := exec.Command("swapoff", "/dev/"+name).CombinedOutput(); err != nil {
		return fmt.Errorf("zram: swapoff: %v: %s", err, strings.TrimSpace(string(out)))
	}
	n := strings.TrimPrefix(name, "zram")
	if err := os.WriteFile("/sys/class/zram-control/hot_remove", []byte(n), 0); err != nil {
		return os.WriteFile(filepath.Join("/sys/block", name, "reset"), []byte("1"), 0)
	}
	return nil
}

package vminit

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Layers as persistent memory: the host maps each layer's EROFS image into
// the guest's physical memory and marks its range as legacy persistent
// memory on the kernel command line (the microvm backend's pmem.go); the
// kernel's nd_e820 and nd_pmem (loaded from PmemOrder) make one /dev/pmemN
// of each, whose region starts at the address Config.PmemAddrs gives for
// the layer. A layer is mounted with dax=always: its files' reads and
// mappings reach the host's page cache of the image without a copy in the
// guest's page cache.

// layerDevices returns each layer's device, top first.
func layerDevices(cfg *Config) ([]string, error) {
	devs := make([]string, cfg.Layers)
	if len(cfg.PmemAddrs) > 0 {
		byAddr, err := pmemByAddr(cfg.PmemAddrs)
		if err != nil {
			return nil, err
		}
		for i, a := range cfg.PmemAddrs {
			devs[i] = byAddr[a]
		}
		return devs, nil
	}
	serials := make([]string, cfg.Layers)
	for i := range serials {
		serials[i] = fmt.Sprintf("%s%d", LayerSerialPrefix, i)
	}
	bySerial, err := blockBySerial(serials)
	if err != nil {
		return nil, err
	}
	for i, s := range serials {
		devs[i] = bySerial[s]
	}
	return devs, nil
}

// pmemByAddr waits (bounded) until a pmem device exists for each address
// and returns their /dev paths by address: a namespace's "resource" is the
// start of its region.
func pmemByAddr(addrs []uint64) (map[uint64]string, error) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		found := map[uint64]string{}
		ents, _ := os.ReadDir("/sys/block")
		for _, e := range ents {
			if !strings.HasPrefix(e.Name(), "pmem") {
				continue
			}
			b, err := os.ReadFile(filepath.Join("/sys/block", e.Name(), "device", "resource"))
			if err != nil {
				continue
			}
			a, err := strconv.ParseUint(strings.TrimSpace(string(b)), 0, 64)
			if err != nil {
				continue
			}
			found[a] = "/dev/" + e.Name()
		}
		missing := false
		for _, a := range addrs {
			p, ok := found[a]
			if !ok {
				missing = true
				break
			}
			if !deviceReady(p) {
				missing = true
				break
			}
		}
		if !missing {
			return found, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("no pmem device at %#x (of %d layers)", addrs, len(addrs))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// mountLayer mounts a layer's EROFS device read-only at dir and returns
// how: a pmem one with DAX, or without if the kernel refuses it (one that
// has no DAX for EROFS, or a device without it).
func mountLayer(dev, dir string, pmem bool) (string, error) {
	flags := uintptr(unix.MS_RDONLY | unix.MS_NODEV)
	if pmem {
		err := unix.Mount(dev, dir, "erofs", flags, "dax=always")
		if err == nil {
			return "dax=always", nil
		}
		if !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.EOPNOTSUPP) {
			return "", err
		}
		kmsg(fmt.Sprintf("shoal-agent: %s: no DAX (%v): mounted without", dev, err))
	}
	return "ro", unix.Mount(dev, dir, "erofs", flags, "")
}

// kmsg writes a line to the kernel's log (dmesg; the console shows it
// too), where a boot's facts stay readable in the guest.
func kmsg(line string) {
	if f, err := os.OpenFile("/dev/kmsg", os.O_WRONLY, 0); err == nil {
		f.WriteString("<6>" + line + "\n") // info: not on a quiet console
		f.Close()
	}
}

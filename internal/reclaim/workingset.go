package reclaim

import (
	"encoding/binary"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// A WorkingSet is where a process's private memory was resident at one
// moment: read just before a PageOut, it is what the process had touched
// since the PageOut before (or since it started), and so what it will
// likely touch first once it runs again. Prefetch reads it back from
// swap, in parallel, before the process runs: its first touches are then
// minor faults instead of one decompression each, in its own thread.
type WorkingSet struct {
	ranges []iovec
	bytes  int64
}

// Bytes is the memory the working set covers.
func (w WorkingSet) Bytes() int64 { return w.bytes }

// Ranges is how many address ranges it holds (what keeping it costs:
// 16 bytes each).
func (w WorkingSet) Ranges() int { return len(w.ranges) }

const (
	pageSize = 4096
	// mergeGap: resident pages at most this far apart are one range (a
	// few pages read back for nothing are cheaper than the ranges).
	mergeGap = 64 << 10
	// maxWorkingSetRanges bounds what a working set keeps.
	maxWorkingSetRanges = 4096
	// maxScan bounds the address space Resident reads the page map of.
	maxScan = 64 << 30
	// pagemapBatch: page-map entries read at once.
	pagemapBatch = 16 << 10
	pmPresent    = 1 << 63
	pmFile       = 1 << 61 // a file's page (or shared anonymous memory)
)

// Resident reads which anonymous pages of pid's private, accessible
// mappings (a JIT's code left out) are in memory (/proc/PID/pagemap:
// present, not a file's; a file's pages come back from the page cache,
// not from swap). A working set larger than maxBytes is not one worth
// prefetching (it is most of the process: what a first pause after a
// boot finds): Resident returns an empty one.
func Resident(pid int, maxBytes int64) (WorkingSet, error) {
	maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return WorkingSet{}, err
	}
	f, err := os.Open(fmt.Sprintf("/proc/%d/pagemap", pid))
	if err != nil {
		return WorkingSet{}, err
	}
	defer f.Close()
	var (
		ws      WorkingSet
		scanned uint64
		buf     = make([]byte, pagemapBatch*8)
	)
	for _, m := range privateMappings(maps, notResident) {
		if scanned += m.Len; scanned > maxScan {
			return WorkingSet{}, fmt.Errorf("reclaim: working set of %d: more than %d GiB of mappings", pid, maxScan>>30)
		}
		for addr, end := uint64(m.Base), uint64(m.Base)+m.Len; addr < end; {
			pages := min((end-addr)/pageSize, pagemapBatch)
			n, err := f.ReadAt(buf[:pages*8], int64(addr/pageSize*8))
			if n < int(pages*8) {
				return WorkingSet{}, fmt.Errorf("reclaim: pagemap of %d at %#x: %w", pid, addr, err)
			}
			for i := range pages {
				if e := binary.LittleEndian.Uint64(buf[i*8:]); e&pmPresent == 0 || e&pmFile != 0 {
					continue
				}
				if !ws.add(addr+i*pageSize) || ws.bytes > maxBytes {
					return WorkingSet{}, nil
				}
			}
			addr += pages * pageSize
		}
	}
	return ws, nil
}

// add puts the page at addr (above every page added before) in the set;
// false if it would need more than maxWorkingSetRanges ranges.
func (w *WorkingSet) add(addr uint64) bool {
	if n := len(w.ranges); n > 0 {
		last := &w.ranges[n-1]
		if end := uint64(last.Base) + last.Len; addr >= end && addr-end <= mergeGap {
			w.bytes += int64(addr + pageSize - end)
			last.Len = addr + pageSize - uint64(last.Base)
			return true
		}
	}
	if len(w.ranges) == maxWorkingSetRanges {
		return false
	}
	w.ranges = append(w.ranges, iovec{Base: uintptr(addr), Len: pageSize})
	w.bytes += pageSize
	return true
}

// Prefetch reads a working set of pid back from swap (MADV_WILLNEED), in
// parallel, and returns the bytes advised. Ranges no longer mapped are
// skipped.
func Prefetch(pid int, w WorkingSet) (int64, error) {
	if len(w.ranges) == 0 {
		return 0, nil
	}
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return 0, fmt.Errorf("pidfd_open: %w", err)
	}
	defer unix.Close(pidfd)
	return adviseParallel(pidfd, w.ranges, WillNeed)
}

// notResident leaves out of a working set the mappings that hold no pages
// (no access: a guard, a reservation) and a JIT's code (PageOutKeepingJIT
// keeps it).
func notResident(f []string) bool { return strings.HasPrefix(f[1], "---") || isJIT(f) }

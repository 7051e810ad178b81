// Package reclaim gives the kernel advice on another process's memory:
// MADV_PAGEOUT over its private mappings pages out what it can (anonymous
// pages to swap, which zram keeps compressed; clean file pages dropped),
// MADV_WILLNEED reads swapped-out pages back. It is how a paused sandbox's
// memory is reclaimed on cgroup v1, where there is no memory.reclaim: the
// processes of a frozen container (internal/backend/container), the QEMU
// of a VM paused in place (internal/backend/microvm).
package reclaim

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Advice.
const (
	WillNeed = unix.MADV_WILLNEED // 3
	PageOut  = 21                 // MADV_PAGEOUT (Linux 5.4)
)

const (
	// iovMax is the kernel's UIO_MAXIOV: iovecs per process_madvise.
	iovMax = 1024
	// adviseChunk bounds the bytes of one process_madvise (the kernel
	// caps a call at MAX_RW_COUNT, just under 2 GiB).
	adviseChunk = 1 << 30
)

// Process gives advice (PageOut, WillNeed) on every private mapping of
// pid, through a pidfd, and returns the bytes advised.
func Process(pid, advice int) (int64, error) { return process(pid, advice, nil) }

// PageOutKeepingJIT pages out what Process would, but for anonymous
// executable mappings: a JIT's code, such as QEMU's TCG translation
// cache, which is what the process runs first when it runs again. A VM
// paused in place keeps it: paged out and faulted back a page at a time,
// it doubled the resume (TestVMPauseInPlace, 12 rounds: 157–166 ms p50
// against 86 ms kept).
func PageOutKeepingJIT(pid int) (int64, error) { return process(pid, PageOut, isJIT) }

// isJIT tells whether the fields of a /proc/PID/maps line are an
// anonymous executable mapping (no path: a JIT's code).
func isJIT(f []string) bool { return f[1][2] == 'x' && len(f) == 5 }

func process(pid, advice int, leaveOut func(f []string) bool) (int64, error) {
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return 0, fmt.Errorf("pidfd_open: %w", err)
	}
	defer unix.Close(pidfd)
	// Read the maps after the pidfd is open: if the pid was reused before
	// the open, the maps are another process's (of the same frozen
	// sandbox, since the freezer stops forks); the advice is harmless.
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return 0, err
	}
	return adviseParallel(pidfd, privateMappings(data, leaveOut), advice)
}

// adviseParallel gives advice on ranges of the process behind pidfd. The
// kernel compresses what it pages out into zram, and decompresses what
// it reads back, in the calling thread: one call per CPU, on parts of
// about equal size, runs that on every CPU (a sandbox's memory is mostly
// one process's).
func adviseParallel(pidfd int, ranges []iovec, advice int) (int64, error) {
	parts := splitRanges(ranges, min(runtime.NumCPU(), maxAdviseThreads), adviseSplitMin)
	if len(parts) == 1 {
		return adviseRanges(pidfd, parts[0], advice)
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		done  int64
		first error
	)
	for _, part := range parts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n, err := adviseRanges(pidfd, part, advice)
			mu.Lock()
			defer mu.Unlock()
			done += n
			if err != nil && first == nil {
				first = err
			}
		}()
	}
	wg.Wait()
	return done, first
}

const (
	// maxAdviseThreads bounds the calls advising one process at once.
	maxAdviseThreads = 8
	// adviseSplitMin: a process with less than this per CPU is advised
	// in one call.
	adviseSplitMin = 16 << 20
)

// splitRanges cuts ranges into at most k parts of about equal bytes, each
// at least min bytes (page-aligned cuts; a range may be cut in two).
func splitRanges(ranges []iovec, k int, minBytes uint64) [][]iovec {
	var total uint64
	for _, r := range ranges {
		total += r.Len
	}
	k = min(k, int(total/max(minBytes, 1)))
	if k <= 1 {
		return [][]iovec{ranges}
	}
	per := (total/uint64(k) + 4095) &^ 4095
	var parts [][]iovec
	var cur []iovec
	var size uint64
	for _, r := range ranges {
		for r.Len > 0 {
			take := r.Len // the last part takes the rest
			if len(parts) < k-1 {
				take = min(r.Len, per-size) // > 0: size < per here
			}
			cur = append(cur, iovec{Base: r.Base, Len: take})
			size += take
			r.Base += uintptr(take)
			r.Len -= take
			if size == per && len(parts) < k-1 {
				parts = append(parts, cur)
				cur, size = nil, 0
			}
		}
	}
	if len(cur) > 0 {
		parts = append(parts, cur)
	}
	return parts
}

// adviseRanges gives advice on ranges of the process behind pidfd, in
// calls of at most iovMax ranges and adviseChunk bytes.
func adviseRanges(pidfd int, ranges []iovec, advice int) (int64, error) {
	var done int64
	for len(ranges) > 0 {
		batch, size := ranges, int64(0)
		for i, r := range ranges {
			if i == iovMax || size+int64(r.Len) > adviseChunk && i > 0 {
				batch = ranges[:i]
				break
			}
			size += int64(r.Len)
		}
		n, err := processMadvise(pidfd, batch, advice)
		done += n
		if err != nil && n == 0 {
			if errors.Is(err, unix.ESRCH) {
				return done, err
			}
			// EINVAL/ENOMEM on the first range (locked, special, or
			// unmapped since): skip it and go on.
			ranges = ranges[1:]
			continue
		}
		// Skip what was advised, and the range the kernel stopped at
		// when it stopped early.
		ranges = skipAdvised(ranges, n, len(batch))
	}
	return done, nil
}

// skipAdvised drops the first n bytes' worth of ranges (of a batch of k
// ranges); a partly advised range is dropped too.
func skipAdvised(ranges []iovec, n int64, k int) []iovec {
	i := 0
	for i < k && n >= int64(ranges[i].Len) {
		n -= int64(ranges[i].Len)
		i++
	}
	if i < k {
		i++ // the kernel stopped inside (or at) this one: skip it
	}
	return ranges[i:]
}

// iovec is struct iovec with the base as a number: an address in another
// process, never dereferenced here.
type iovec struct {
	Base uintptr
	Len  uint64
}

func processMadvise(pidfd int, iov []iovec, advice int) (int64, error) {
	if len(iov) == 0 {
		return 0, nil
	}
	n, _, errno := unix.Syscall6(unix.SYS_PROCESS_MADVISE, uintptr(pidfd), uintptr(unsafe.Pointer(&iov[0])), uintptr(len(iov)), uintptr(advice), 0, 0)
	if errno != 0 {
		return 0, errno
	}
	return int64(n), nil
}

// privateMappings parses /proc/PID/maps into iovecs over its private
// mappings (anonymous or not), leaving out the kernel's special ones and
// those leaveOut (if not nil) tells by their line's fields.
func privateMappings(maps []byte, leaveOut func(f []string) bool) []iovec {
	var out []iovec
	sc := bufio.NewScanner(bytes.NewReader(maps))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		// 7f0c1c000000-7f0c1c021000 rw-p 00000000 00:00 0     [heap]
		f := strings.Fields(sc.Text())
		if len(f) < 5 || len(f[1]) != 4 || f[1][3] != 'p' {
			continue
		}
		if len(f) >= 6 && (f[5] == "[vvar]" || f[5] == "[vdso]" || f[5] == "[vsyscall]" || f[5] == "[vvar_vclock]") {
			continue
		}
		if leaveOut != nil && leaveOut(f) {
			continue
		}
		lo, hi, ok := strings.Cut(f[0], "-")
		if !ok {
			continue
		}
		start, err1 := strconv.ParseUint(lo, 16, 64)
		end, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 != nil || err2 != nil || end <= start {
			continue
		}
		for start < end {
			n := min(end-start, adviseChunk)
			out = append(out, iovec{Base: uintptr(start), Len: n})
			start += n
		}
	}
	return out
}

// HostSwap returns the host's swap, all devices together (/proc/meminfo's
// SwapTotal and SwapFree), in bytes. Without swap (total 0) a pause
// reclaims only file pages: anonymous memory has nowhere to go.
func HostSwap() (total, free int64, err error) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, 0, err
	}
	found := 0
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		n, _ := strconv.ParseInt(f[1], 10, 64)
		switch f[0] {
		case "SwapTotal:":
			total, found = n<<10, found+1
		case "SwapFree:":
			free, found = n<<10, found+1
		}
	}
	if found != 2 {
		return 0, 0, errors.New("no SwapTotal or SwapFree in /proc/meminfo")
	}
	return total, free, nil
}

// FilePagesOnly reports whether a pause can reclaim only file pages now:
// the host has no swap (or its size cannot be read).
func FilePagesOnly() bool {
	total, _, err := HostSwap()
	return err != nil || total == 0
}

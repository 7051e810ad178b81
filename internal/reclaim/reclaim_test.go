package reclaim

import (
	"os"
	"slices"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/zram"
)

// TestSplitRanges: the ranges advised in parallel cover exactly the
// mappings, in order, in about equal parts; small processes stay whole.
func TestSplitRanges(t *testing.T) {
	mib := uint64(1 << 20)
	ranges := []iovec{{0x10000, 3 * mib}, {0x1000000, 40 * mib}, {0x9000000, 1 * mib}, {0xa000000, 20 * mib}}
	for _, tc := range []struct {
		k, want int
		min     uint64
	}{{1, 1, mib}, {2, 2, mib}, {4, 4, mib}, {3, 3, 16 * mib}, {8, 4, 16 * mib}, {2, 1, 64 * mib}} {
		parts := splitRanges(ranges, tc.k, tc.min)
		if len(parts) != tc.want {
			t.Fatalf("k=%d min=%d: %d parts, want %d", tc.k, tc.min, len(parts), tc.want)
		}
		// Merge back adjacent pieces and compare with the input.
		var got []iovec
		var sizes []uint64
		for _, p := range parts {
			var size uint64
			for _, r := range p {
				size += r.Len
				if n := len(got); n > 0 && got[n-1].Base+uintptr(got[n-1].Len) == r.Base {
					got[n-1].Len += r.Len
					continue
				}
				got = append(got, r)
			}
			sizes = append(sizes, size)
		}
		if len(got) != len(ranges) {
			t.Fatalf("k=%d: ranges %v after split, want %v", tc.k, got, ranges)
		}
		for i := range got {
			if got[i] != ranges[i] {
				t.Fatalf("k=%d: range %d is %v, want %v", tc.k, i, got[i], ranges[i])
			}
		}
		for _, s := range sizes[:len(sizes)-1] {
			if s != sizes[0] || s%4096 != 0 {
				t.Fatalf("k=%d: part sizes %v, want equal and page-aligned but the last", tc.k, sizes)
			}
		}
	}
}

// TestResident: the working set holds the pages a process touched and not
// the ones it did not; one past the bound is empty.
func TestResident(t *testing.T) {
	const mib = 1 << 20
	mem, err := unix.Mmap(-1, 0, 16*mib, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	unix.Madvise(mem, unix.MADV_NOHUGEPAGE) // one page touched is one page in
	for i := 0; i < 4*mib; i += pageSize {
		mem[i] = 1 // the first 4 MiB
	}
	mem[12*mib] = 1 // and one page further on
	base := uintptr(unsafe.Pointer(&mem[0]))
	ws, err := Resident(os.Getpid(), 1<<40)
	if err != nil {
		t.Fatal(err)
	}
	in := func(addr uintptr) bool {
		for _, r := range ws.ranges {
			if addr >= r.Base && uint64(addr-r.Base) < r.Len {
				return true
			}
		}
		return false
	}
	for _, off := range []int{0, 2 * mib, 4*mib - pageSize, 12 * mib} {
		if !in(base + uintptr(off)) {
			t.Errorf("touched page at +%d KiB not in the working set", off>>10)
		}
	}
	for _, off := range []int{4*mib + 2*mergeGap, 8 * mib, 12*mib + 2*mergeGap} {
		if in(base + uintptr(off)) {
			t.Errorf("untouched page at +%d KiB in the working set", off>>10)
		}
	}
	if ws.Bytes() < 4*mib || ws.Ranges() == 0 {
		t.Errorf("working set %d bytes in %d ranges, want at least the 4 MiB touched", ws.Bytes(), ws.Ranges())
	}
	if small, err := Resident(os.Getpid(), 2*mib); err != nil || small.Bytes() != 0 || small.Ranges() != 0 {
		t.Errorf("working set over its bound: %d bytes, %d ranges, %v; want none", small.Bytes(), small.Ranges(), err)
	}
}

// TestPrefetch: a working set paged out to swap is back in memory (the
// swap cache, which mincore counts) after Prefetch, untouched.
func TestPrefetch(t *testing.T) {
	// The swap serve sets up by default (--zram-size auto), once per host.
	if _, err := zram.EnsureSwap(); err != nil {
		t.Skipf("no swap, and none can be set up: %v", err)
	}
	const size = 8 << 20
	mem, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	unix.Madvise(mem, unix.MADV_NOHUGEPAGE)
	for i := 0; i < size; i += pageSize {
		mem[i] = byte(i>>12) | 1 // not zero pages: zram keeps those as a mark
	}
	ws, err := Resident(os.Getpid(), 1<<40)
	if err != nil {
		t.Fatal(err)
	}
	resident := func() int {
		vec := make([]byte, size/pageSize)
		if _, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&mem[0])), size, uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
			t.Fatal(errno)
		}
		n := 0
		for _, v := range vec {
			n += int(v & 1)
		}
		return n
	}
	if err := unix.Madvise(mem, PageOut); err != nil {
		t.Fatal(err)
	}
	out := resident()
	if out > size/pageSize/2 {
		t.Skipf("MADV_PAGEOUT left %d of %d pages in memory (swap full?)", out, size/pageSize)
	}
	if _, err := Prefetch(os.Getpid(), ws); err != nil {
		t.Fatal(err)
	}
	if in := resident(); in < size/pageSize*9/10 {
		t.Errorf("after the prefetch %d of %d pages are in memory (%d after the page-out)", in, size/pageSize, out)
	}
	for i := 0; i < size; i += pageSize {
		if mem[i] != byte(i>>12)|1 {
			t.Fatalf("page at +%d KiB changed across page-out and prefetch", i>>10)
		}
	}
}

// TestPrivateMappingsNoJIT: a JIT's code (an anonymous executable private
// mapping) is left out when asked, and only it.
func TestPrivateMappingsNoJIT(t *testing.T) {
	maps := []byte(`55afaf681000-55afafc18000 r-xp 00407000 fe:00 10166304   /usr/bin/qemu-system-x86_64
55afbc2d5000-55afbcf00000 rw-p 00000000 00:00 0          [heap]
7fb809e00000-7fb817e00000 rw-p 00000000 00:00 0
7fb818000000-7fb81bfff000 rwxp 00000000 00:00 0
7fb8218b9000-7fb821ad4000 r--s 00000000 fe:00 9987265    /tmp/pmem-pad
7ffd1c1f0000-7ffd1c1f2000 r-xp 00000000 00:00 0          [vdso]
`)
	bases := func(leaveOut func([]string) bool) []uintptr {
		var out []uintptr
		for _, r := range privateMappings(maps, leaveOut) {
			out = append(out, r.Base)
		}
		return out
	}
	all := []uintptr{0x55afaf681000, 0x55afbc2d5000, 0x7fb809e00000, 0x7fb818000000}
	if got := bases(nil); !slices.Equal(got, all) {
		t.Errorf("all private mappings: %x, want %x", got, all)
	}
	if got, want := bases(isJIT), []uintptr{0x55afaf681000, 0x55afbc2d5000, 0x7fb809e00000}; !slices.Equal(got, want) {
		t.Errorf("without the JIT: %x, want %x", got, want)
	}
}

package reclaim

import "testing"

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

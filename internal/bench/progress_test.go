package bench

import (
	"context"
	"sync"
	"testing"
)

// The long loops report to the context's ProgressFunc: a start at 0, then
// one step per item, from every worker, ending at the total.
func TestProgress(t *testing.T) {
	var mu sync.Mutex
	var got []int
	ctx := WithProgress(context.Background(), func(stage string, done, total int) {
		if stage != "create" || total != 50 {
			t.Errorf("report %s %d/%d", stage, done, total)
		}
		mu.Lock()
		got = append(got, done)
		mu.Unlock()
	})
	step := progress(ctx, "create", 50)
	parallel(50, 8, func(int) { step() })
	seen := map[int]bool{}
	for _, d := range got {
		seen[d] = true
	}
	if len(got) != 51 || len(seen) != 51 || !seen[0] || !seen[50] {
		t.Fatalf("reports %v: want 0 then each of 1..50 once", got)
	}
	progress(context.Background(), "none", 3)() // no ProgressFunc: nothing, no panic
}

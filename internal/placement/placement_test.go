package placement

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

const gib = 1 << 30

func node(name string, cpu, mem, usedCPU, usedMem int64, layers ...string) Node {
	return Node{Name: name, MilliCPU: cpu, Memory: mem, UsedMilliCPU: usedCPU, UsedMemory: usedMem,
		Backends: []string{"container"}, Layers: layers}
}

func TestCandidates(t *testing.T) {
	for _, tc := range []struct {
		name  string
		nodes []Node
		req   Request
		want  []string
	}{
		{"most free first", []Node{node("a", 8000, 16*gib, 6000, 4*gib), node("b", 8000, 16*gib, 1000, 2*gib), node("c", 8000, 16*gib, 3000, 3*gib)},
			Request{MilliCPU: 1000, Memory: gib}, []string{"b", "c", "a"}},
		{"tighter resource decides", []Node{node("a", 8000, 16*gib, 0, 15*gib), node("b", 8000, 16*gib, 4000, 0)},
			Request{MilliCPU: 100, Memory: 100 << 20}, []string{"b", "a"}},
		{"full nodes left out", []Node{node("a", 8000, 16*gib, 7500, 0), node("b", 8000, 16*gib, 0, 15*gib+1)},
			Request{MilliCPU: 1000, Memory: gib}, []string{}},
		{"backend support", []Node{node("a", 8000, 16*gib, 0, 0), {Name: "b", MilliCPU: 8000, Memory: 16 * gib, Backends: []string{"microvm"}}},
			Request{Backend: "microvm", MilliCPU: 1000, Memory: gib}, []string{"b"}},
		{"draining left out", []Node{node("a", 8000, 16*gib, 0, 0), {Name: "b", MilliCPU: 8000, Memory: 16 * gib, Backends: []string{"container"}, Draining: true}},
			Request{Backend: "container"}, []string{"a"}},
		{"locality outweighs a little load", []Node{node("a", 8000, 16*gib, 200, 0, "sha256:base"), node("b", 8000, 16*gib, 0, 0)},
			Request{MilliCPU: 500, Memory: 512 << 20, Layers: []string{"sha256:base"}}, []string{"a", "b"}},
		{"but not more", []Node{node("a", 8000, 16*gib, 800, 0, "sha256:base"), node("b", 8000, 16*gib, 0, 0)},
			Request{MilliCPU: 500, Memory: 512 << 20, Layers: []string{"sha256:base"}}, []string{"b", "a"}},
		{"at most n", []Node{node("a", 8000, 16*gib, 0, 0), node("b", 8000, 16*gib, 100, 0), node("c", 8000, 16*gib, 200, 0), node("d", 8000, 16*gib, 300, 0)},
			Request{MilliCPU: 1000}, []string{"a", "b", "c"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := New(Config{})
			for _, n := range tc.nodes {
				e.Update(n)
			}
			got := e.Candidates(tc.req, 3)
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Fatalf("candidates %v, want %v", got, tc.want)
			}
		})
	}
}

func refuse(node string) error {
	return errdefs.New(errdefs.ErrUnavailable, "node full: %s", node)
}

func TestPlaceRetriesOnRefusal(t *testing.T) {
	e := New(Config{MaxAttempts: 3, MaxWait: 200 * time.Millisecond})
	e.Update(node("a", 8000, 16*gib, 0, 0))
	e.Update(node("b", 8000, 16*gib, 1000, 0))
	e.Update(node("c", 8000, 16*gib, 2000, 0))
	var tried []string
	got, err := e.Place(context.Background(), Request{MilliCPU: 100}, func(_ context.Context, n string) error {
		tried = append(tried, n)
		if n != "c" {
			return refuse(n)
		}
		return nil
	})
	if err != nil || got != "c" || fmt.Sprint(tried) != "[a b c]" {
		t.Fatalf("placed on %q (%v) after trying %v; want c after [a b c]", got, err, tried)
	}
	if st := e.Stats(); st.Refusals != 2 || st.Retries != 2 || st.Placed != 1 {
		t.Fatalf("stats %+v", st)
	}
	// The refusing nodes are scored down for a while: the next create
	// goes to c first although a and b are emptier.
	if c := e.Candidates(Request{MilliCPU: 100}, 3); c[0] != "c" {
		t.Fatalf("after refusals candidates %v, want c first", c)
	}
}

func TestPlaceBoundedAttempts(t *testing.T) {
	e := New(Config{MaxAttempts: 2, MaxWait: 300 * time.Millisecond})
	for _, n := range []string{"a", "b", "c", "d"} {
		e.Update(node(n, 8000, 16*gib, 0, 0))
	}
	var mu sync.Mutex
	tries := 0
	_, err := e.Place(context.Background(), Request{MilliCPU: 100}, func(_ context.Context, n string) error {
		mu.Lock()
		tries++
		mu.Unlock()
		return refuse(n)
	})
	if !errors.Is(err, errdefs.ErrResourceExhausted) || !errors.Is(err, ErrNoCapacity) {
		t.Fatalf("every node refusing: %v, want resource exhausted", err)
	}
	// Each decision tries at most 2 nodes; decisions repeat only when
	// capacity changes (a release after a refusal), bounded by the deadline.
	mu.Lock()
	defer mu.Unlock()
	if tries < 2 {
		t.Fatalf("%d tries, want at least 2", tries)
	}
	if st := e.Stats(); st.Retries*2 < st.Refusals-1 {
		t.Fatalf("stats %+v: more than 2 nodes per decision", st)
	}
}

func TestPlaceOtherErrorNotRetried(t *testing.T) {
	e := New(Config{})
	e.Update(node("a", 8000, 16*gib, 0, 0))
	e.Update(node("b", 8000, 16*gib, 0, 0))
	bad := errdefs.New(errdefs.ErrInvalidArgument, "no such base layer")
	n := 0
	_, err := e.Place(context.Background(), Request{}, func(context.Context, string) error { n++; return bad })
	if !errors.Is(err, errdefs.ErrInvalidArgument) || n != 1 {
		t.Fatalf("err %v after %d tries; want the invalid argument after 1", err, n)
	}
}

func TestReservationsSpreadABurst(t *testing.T) {
	e := New(Config{})
	for _, n := range []string{"a", "b", "c", "d"} {
		e.Update(node(n, 64000, 256*gib, 0, 0))
	}
	count := map[string]int{}
	for i := 0; i < 100; i++ {
		n, err := e.Place(context.Background(), Request{MilliCPU: 500, Memory: gib}, func(context.Context, string) error { return nil })
		if err != nil {
			t.Fatal(err)
		}
		count[n]++
	}
	for n, c := range count {
		if c != 25 {
			t.Fatalf("burst without reports placed %v; want 25 on each (node %s)", count, n)
		}
	}
	// A failed try gives its reservation back.
	e.Update(node("a", 1000, gib, 0, 0))
	for _, n := range []string{"b", "c", "d"} {
		e.Remove(n)
	}
	for i := 0; i < 3; i++ {
		if _, err := e.Place(context.Background(), Request{MilliCPU: 1000}, func(context.Context, string) error {
			return errdefs.New(errdefs.ErrInvalidArgument, "bad")
		}); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Fatalf("try %d: %v; want the try's own error (the reservation released)", i, err)
		}
	}
}

// TestReportKeepsInFlight: a report that comes while a create is in
// flight (the node has not admitted it yet) does not make the node look
// emptier than it is.
func TestReportKeepsInFlight(t *testing.T) {
	// Ties are broken at random: 20 rounds, so that a node wrongly
	// looking empty is picked at least once (all but 1 in 2^20).
	for round := 0; round < 20; round++ {
		reportKeepsInFlight(t)
	}
}

func reportKeepsInFlight(t *testing.T) {
	e := New(Config{})
	e.Update(Node{Name: "a", Backends: []string{"container"}}) // unbounded: spread by count
	e.Update(Node{Name: "b", Backends: []string{"container"}})
	inTry := make(chan string)
	finish := make(chan struct{})
	done := make(chan string)
	go func() {
		n, _ := e.Place(context.Background(), Request{}, func(_ context.Context, n string) error {
			inTry <- n
			<-finish
			return nil
		})
		done <- n
	}()
	first := <-inTry
	e.Update(Node{Name: first, Backends: []string{"container"}}) // a report that does not count it yet
	second, err := e.Place(context.Background(), Request{}, func(context.Context, string) error { return nil })
	close(finish)
	<-done
	if err != nil || second == first {
		t.Fatalf("second create on %q (%v) while the first was in flight on %q: want the other node", second, err, first)
	}
}

func TestPlaceWaitsForCapacity(t *testing.T) {
	e := New(Config{})
	e.Update(node("a", 1000, gib, 1000, 0)) // full
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := e.Place(ctx, Request{MilliCPU: 500}, func(context.Context, string) error { return nil })
		done <- err
	}()
	// Wait until the create has found the fleet full, then free capacity.
	for e.Stats().NoCapacity == 0 {
		select {
		case err := <-done:
			t.Fatalf("placed on a full fleet: %v", err)
		case <-time.After(time.Millisecond):
		}
	}
	e.Update(node("a", 1000, gib, 0, 0))
	if err := <-done; err != nil {
		t.Fatalf("after capacity freed: %v", err)
	}
}

func TestPlaceDeadline(t *testing.T) {
	e := New(Config{})
	e.Update(node("a", 1000, gib, 1000, 0))
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err := e.Place(ctx, Request{MilliCPU: 500}, func(context.Context, string) error { return nil })
	if !errors.Is(err, errdefs.ErrResourceExhausted) || errdefs.Code(err) != "resource_exhausted" {
		t.Fatalf("full fleet past deadline: %v (%s), want resource_exhausted", err, errdefs.Code(err))
	}
	if e.Stats().TimedOut != 1 {
		t.Fatalf("stats %+v", e.Stats())
	}
}

func TestQueueFull(t *testing.T) {
	e := New(Config{MaxQueue: 2})
	e.Update(node("a", 1000, gib, 1000, 0)) // full: creates wait
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for i := 0; i < 2; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			e.Place(ctx, Request{MilliCPU: 500}, func(context.Context, string) error { return nil })
		}()
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if q := e.queued.Load(); q == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the creates never queued")
		}
		time.Sleep(time.Millisecond)
	}
	_, err := e.Place(context.Background(), Request{MilliCPU: 500}, func(context.Context, string) error { return nil })
	if !errors.Is(err, errdefs.ErrResourceExhausted) || e.Stats().QueueFull != 1 {
		t.Fatalf("third create with a queue of 2: %v, want resource exhausted at once", err)
	}
	cancel()
	wg.Wait()
}

// TestTenantFairness: one tenant's burst queued first does not hold back
// another tenant's create: slots go round-robin over tenants.
func TestTenantFairness(t *testing.T) {
	e := New(Config{Concurrency: 1})
	e.Update(node("a", 0, 0, 0, 0)) // unbounded
	var mu sync.Mutex
	var order []string
	gate := make(chan struct{})
	try := func(tenant string) func(context.Context, string) error {
		return func(context.Context, string) error {
			<-gate
			mu.Lock()
			order = append(order, tenant)
			mu.Unlock()
			return nil
		}
	}
	ctx := context.Background()
	var wg sync.WaitGroup
	place := func(tenant string) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := e.Place(ctx, Request{Tenant: tenant}, try(tenant)); err != nil {
				t.Error(err)
			}
		}()
	}
	waiting := func(n int) {
		deadline := time.Now().Add(30 * time.Second)
		for {
			q := int(e.waiting.Load())
			if q == n {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%d waiters, want %d", q, n)
			}
			time.Sleep(time.Millisecond)
		}
	}
	place("burst") // holds the one slot
	for e.Stats().Placed == 0 && e.inflight.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	for i := 0; i < 50; i++ {
		place("burst")
	}
	waiting(50)
	place("other")
	waiting(51)
	close(gate)
	wg.Wait()
	pos := -1
	for i, tn := range order {
		if tn == "other" {
			pos = i
		}
	}
	// The first burst create held the slot; the other tenant's turn comes
	// right after the next burst waiter's at the latest.
	if pos < 0 || pos > 2 {
		t.Fatalf("other tenant's create ran %dth of %d: %v", pos+1, len(order), order[:min(len(order), 5)])
	}
}

func BenchmarkPlace160(b *testing.B) {
	e := New(Config{})
	for i := 0; i < 160; i++ {
		e.Update(node(fmt.Sprintf("n%03d", i), 192000*4, 1536*gib, 0, 0, "sha256:base"))
	}
	ok := func(context.Context, string) error { return nil }
	r := Request{MilliCPU: 1000, Memory: gib, Layers: []string{"sha256:base"}}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		n, _ := e.Place(context.Background(), r, ok)
		e.Release(n, r)
	}
}

// TestQueueNoLostWakeups: creates of many tenants arriving at once, with
// few slots, some giving up while they wait: every create that did not
// give up is placed, and the queue ends empty with every slot free (a
// waiter left behind a free slot, or a slot never handed back, hangs or
// fails here).
func TestQueueNoLostWakeups(t *testing.T) {
	e := New(Config{Concurrency: 3})
	e.Update(node("a", 0, 0, 0, 0)) // unbounded
	const n = 3000
	var placed, gaveUp atomic.Int64
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx := context.Background()
			if i%7 == 0 { // gives up while it waits, at a random moment
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, time.Duration(rand.IntN(2000))*time.Microsecond)
				defer cancel()
			}
			_, err := e.Place(ctx, Request{Tenant: fmt.Sprintf("t%d", i%5)}, func(context.Context, string) error {
				if i%3 == 0 {
					runtime.Gosched()
				}
				return nil
			})
			switch {
			case err == nil:
				placed.Add(1)
			case i%7 == 0 && errors.Is(err, errdefs.ErrResourceExhausted):
				gaveUp.Add(1)
			default:
				t.Errorf("create %d: %v", i, err)
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(2 * time.Minute):
		t.Fatalf("hung: %d placed, %d gave up of %d; %d waiting, %d slots taken", placed.Load(), gaveUp.Load(), n, e.waiting.Load(), e.inflight.Load())
	}
	if placed.Load()+gaveUp.Load() != n || placed.Load() < n*6/7 {
		t.Fatalf("%d placed + %d gave up, want %d (at least %d placed)", placed.Load(), gaveUp.Load(), n, n*6/7)
	}
	if q, w, f := e.queued.Load(), e.waiting.Load(), e.inflight.Load(); q != 0 || w != 0 || f != 0 {
		t.Fatalf("after: %d queued, %d waiting, %d slots taken; want 0, 0, 0", q, w, f)
	}
}

// holdSlot places a create of tenant t that holds its slot until the
// returned function is called; it returns once the create holds it.
func holdSlot(t *testing.T, e *Engine, tenant string, wg *sync.WaitGroup) (release func()) {
	t.Helper()
	gate, in := make(chan struct{}), make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		if _, err := e.Place(context.Background(), Request{Tenant: tenant}, func(context.Context, string) error {
			close(in)
			<-gate
			return nil
		}); err != nil {
			t.Error(err)
		}
	}()
	<-in
	return func() { close(gate) }
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestSlotFreedWhileLinking: a slot freed while the next waiter of its
// tenant is half pushed (the release finds the queue's end not linked
// yet) goes to that waiter once it is linked, though it did not start its
// tenant's turn.
func TestSlotFreedWhileLinking(t *testing.T) {
	e := New(Config{Concurrency: 1})
	e.Update(node("a", 0, 0, 0, 0))
	var wg sync.WaitGroup
	defer wg.Wait()
	releaseA := holdSlot(t, e, "x", &wg)
	// W1 waits first (its push starts the tenant's turn).
	w1 := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		e.Place(context.Background(), Request{Tenant: "x"}, func(context.Context, string) error { <-w1; return nil })
	}()
	waitUntil(t, "W1 waits", func() bool { return e.waiting.Load() == 1 })
	// W2 is stopped between taking the tail and linking itself.
	linking, link := make(chan struct{}), make(chan struct{})
	hook := func(*waiter) { close(linking); <-link }
	testHookLinking.Store(&hook)
	defer testHookLinking.Store(nil)
	placed2 := make(chan error, 1)
	go func() {
		_, err := e.Place(context.Background(), Request{Tenant: "x"}, func(context.Context, string) error { return nil })
		placed2 <- err
	}()
	<-linking
	testHookLinking.Store(nil)
	releaseA()                                                                      // the slot goes to W1
	waitUntil(t, "W1 holds the slot", func() bool { return e.waiting.Load() == 1 }) // W2 only
	close(w1)                                                                       // W1 ends: its release finds W2 not linked
	waitUntil(t, "the slot is free", func() bool { return e.inflight.Load() == 0 })
	close(link)
	select {
	case err := <-placed2:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(time.Minute):
		t.Fatal("W2 was left waiting behind a free slot")
	}
}

// TestGrantedWhileGivingUp: a create granted a slot just as its context
// ended hands the slot on.
func TestGrantedWhileGivingUp(t *testing.T) {
	e := New(Config{Concurrency: 1})
	e.Update(node("a", 0, 0, 0, 0))
	var wg sync.WaitGroup
	defer wg.Wait()
	releaseA := holdSlot(t, e, "x", &wg)
	ctx, cancel := context.WithCancel(context.Background())
	givingUp, proceed := make(chan struct{}), make(chan struct{})
	hook := func(*waiter) { close(givingUp); <-proceed }
	testHookGivingUp.Store(&hook)
	defer testHookGivingUp.Store(nil)
	gaveUp := make(chan error, 1)
	go func() {
		_, err := e.Place(ctx, Request{Tenant: "x"}, func(context.Context, string) error { return nil })
		gaveUp <- err
	}()
	waitUntil(t, "W waits", func() bool { return e.waiting.Load() == 1 })
	cancel()
	<-givingUp
	testHookGivingUp.Store(nil)
	releaseA() // grants W, whose context has ended
	waitUntil(t, "W granted", func() bool { return e.waiting.Load() == 0 })
	close(proceed)
	if err := <-gaveUp; err == nil {
		t.Fatal("a create whose context ended was placed")
	}
	// The slot W was granted is free again: the next create gets it.
	done := make(chan error, 1)
	go func() {
		_, err := e.Place(context.Background(), Request{Tenant: "y"}, func(context.Context, string) error { return nil })
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(time.Minute):
		t.Fatalf("the slot was never handed back: %d taken", e.inflight.Load())
	}
}

// A backend no node offers is refused at once with the backends offered
// (a node refuses it the same way), not queued until the deadline; with
// no node at all, a create waits as for capacity.
func TestPlaceBackendNoNodeOffers(t *testing.T) {
	e := New(Config{MaxWait: time.Minute})
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	_, err := e.Place(ctx, Request{Backend: "teleport"}, func(context.Context, string) error { return nil })
	cancel()
	if !errors.Is(err, ErrNoCapacity) || errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("no nodes yet: %v, want a wait for capacity until the deadline", err)
	}
	e.Update(node("a", 8000, 16*gib, 0, 0))
	t0 := time.Now()
	_, err = e.Place(context.Background(), Request{Backend: "teleport"}, func(context.Context, string) error {
		t.Fatal("tried a node that does not offer the backend")
		return nil
	})
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), `"teleport"`) || !strings.Contains(err.Error(), "offered: container") {
		t.Fatalf("err %v, want invalid argument naming the backend and what is offered", err)
	}
	if time.Since(t0) > 30*time.Second {
		t.Fatalf("the refusal waited %s", time.Since(t0))
	}
	if got, err := e.Place(context.Background(), Request{Backend: "container"}, func(context.Context, string) error { return nil }); err != nil || got != "a" {
		t.Fatalf("container: %q %v", got, err)
	}
}

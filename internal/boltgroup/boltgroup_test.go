package boltgroup

import (
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"testing"

	"go.etcd.io/bbolt"
)

func open(t *testing.T) *bbolt.DB {
	t.Helper()
	db, err := bbolt.Open(filepath.Join(t.TempDir(), "t.db"), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	if err := db.Update(func(tx *bbolt.Tx) error { _, err := tx.CreateBucket([]byte("b")); return err }); err != nil {
		t.Fatal(err)
	}
	return db
}

func put(k string) func(*bbolt.Tx) error {
	return func(tx *bbolt.Tx) error { return tx.Bucket([]byte("b")).Put([]byte(k), []byte("v")) }
}

// TestGroups: concurrent writes all land, in fewer commits than writes;
// a failing write gets its own error and does not fail the others of its
// group.
func TestGroups(t *testing.T) {
	db := open(t)
	const n = 400
	bad := errors.New("refused")
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if i%50 == 7 {
				errs[i] = Update(db, func(tx *bbolt.Tx) error { put(fmt.Sprint("x", i))(tx); return bad })
				return
			}
			errs[i] = Update(db, put(fmt.Sprint(i)))
		}()
	}
	wg.Wait()
	db.View(func(tx *bbolt.Tx) error {
		b := tx.Bucket([]byte("b"))
		for i := range n {
			if i%50 == 7 {
				if !errors.Is(errs[i], bad) {
					t.Errorf("write %d: %v, want its own error", i, errs[i])
				}
				if b.Get([]byte(fmt.Sprint("x", i))) != nil {
					t.Errorf("write %d failed but its change stayed", i)
				}
				continue
			}
			if errs[i] != nil || b.Get([]byte(fmt.Sprint(i))) == nil {
				t.Errorf("write %d: %v, present %v", i, errs[i], b.Get([]byte(fmt.Sprint(i))) != nil)
			}
		}
		return nil
	})
	v, _ := committers.Load(db)
	c := v.(*committer)
	c.mu.Lock()
	commits, writes := c.commits, c.writes
	c.mu.Unlock()
	t.Logf("%d writes in %d commits", writes, commits)
	if writes != n || commits >= n {
		t.Errorf("%d writes in %d commits: want all %d, grouped", writes, commits, n)
	}
}

// TestLoneWrite: a write with nothing in progress commits at once, on its
// own.
func TestLoneWrite(t *testing.T) {
	db := open(t)
	for i := range 3 {
		if err := Update(db, put(fmt.Sprint(i))); err != nil {
			t.Fatal(err)
		}
	}
	v, _ := committers.Load(db)
	if c := v.(*committer); c.commits != 3 || c.writes != 3 || c.leading || len(c.queue) != 0 {
		t.Errorf("commits %d writes %d leading %v queued %d, want 3 3 false 0", c.commits, c.writes, c.leading, len(c.queue))
	}
}

func BenchmarkLoneWrite(b *testing.B) {
	db, err := bbolt.Open(filepath.Join(b.TempDir(), "t.db"), 0o600, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer db.Close()
	db.Update(func(tx *bbolt.Tx) error { _, err := tx.CreateBucket([]byte("b")); return err })
	db.MaxBatchDelay = defaultServeBatchDelay
	b.Run("boltgroup", func(b *testing.B) {
		for i := range b.N {
			Update(db, put(fmt.Sprint(i)))
		}
	})
	b.Run("bbolt-batch", func(b *testing.B) {
		for i := range b.N {
			db.Batch(put(fmt.Sprint(i)))
		}
	})
}

// defaultServeBatchDelay is the MaxBatchDelay serve set (1 ms) while its
// writes went through DB.Batch, for the comparison.
const defaultServeBatchDelay = 1e6

// TestPanic: a write that panics panics in its caller, fails nothing else
// of its group, and leaves the committer working.
func TestPanic(t *testing.T) {
	db := open(t)
	var wg sync.WaitGroup
	recovered := make(chan any, 1)
	errs := make([]error, 20)
	for i := range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if i == 5 {
				defer func() { recovered <- recover() }()
				Update(db, func(*bbolt.Tx) error { panic("boom") })
				return
			}
			errs[i] = Update(db, put(fmt.Sprint(i)))
		}()
	}
	wg.Wait()
	if p := <-recovered; p != "boom" {
		t.Errorf("the panicking write's caller recovered %v, want boom", p)
	}
	for i, err := range errs {
		if i != 5 && err != nil {
			t.Errorf("write %d: %v", i, err)
		}
	}
	if err := Update(db, put("after")); err != nil {
		t.Errorf("a write after the panic: %v", err)
	}
}

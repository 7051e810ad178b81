// Package boltgroup commits bbolt write transactions in groups without
// waiting for company: a write made while no commit is in progress is
// committed at once; writes made while one is in progress wait for it and
// then share the next commit (one fsync for all of them).
//
// bbolt's own DB.Batch coalesces by waiting MaxBatchDelay for other calls,
// which every lone write pays (1 ms per create, per command end, on an
// idle node) and which coalesces nothing that arrives after the timer.
// Update here has Batch's contract: fn may be called more than once (a
// group whose transaction fails is run again one function at a time, so
// that each gets its own error), and must not depend on the other writes
// of its group.
package boltgroup

import (
	"fmt"
	"sync"

	"go.etcd.io/bbolt"
)

// committers holds one committer per database.
var committers sync.Map // *bbolt.DB → *committer

// Update runs fn in a read-write transaction of db, sharing its commit
// with the writes that queued while the previous commit ran, and returns
// fn's error (or the commit's).
func Update(db *bbolt.DB, fn func(*bbolt.Tx) error) error {
	v, ok := committers.Load(db)
	if !ok {
		v, _ = committers.LoadOrStore(db, &committer{db: db})
	}
	return v.(*committer).update(fn)
}

type committer struct {
	db      *bbolt.DB
	mu      sync.Mutex
	leading bool    // a goroutine is committing (guarded by mu)
	queue   []*call // writes waiting for the next commit (guarded by mu)
	// commits and writes count commits and the writes they carried
	// (for tests).
	commits, writes int
}

type call struct {
	fn    func(*bbolt.Tx) error
	err   error
	panic any           // what fn panicked with, raised again in its caller's goroutine
	done  chan struct{} // closed when err is set
	lead  chan struct{} // closed when this call's goroutine is to commit the queue
}

// run calls fn in tx, turning a panic into an error of the call (and
// keeping it for its caller): one function's panic must not leave the
// others of its group, nor the next commits, waiting.
func (cl *call) run(tx *bbolt.Tx) (err error) {
	defer func() {
		if p := recover(); p != nil {
			cl.panic = p
			err = fmt.Errorf("boltgroup: a write panicked: %v", p)
		}
	}()
	return cl.fn(tx)
}

func (c *committer) update(fn func(*bbolt.Tx) error) error {
	me := &call{fn: fn, done: make(chan struct{}), lead: make(chan struct{})}
	c.mu.Lock()
	c.queue = append(c.queue, me)
	if c.leading {
		c.mu.Unlock()
		select {
		case <-me.done:
			return me.result()
		case <-me.lead: // the previous leader handed over: commit the queue
		}
		c.mu.Lock()
	}
	c.leading = true
	group := c.queue
	c.queue = nil
	c.commits++
	c.writes += len(group)
	c.mu.Unlock()

	c.commit(group)

	// Hand over to the first writer that queued meanwhile, or stop.
	c.mu.Lock()
	if len(c.queue) > 0 {
		close(c.queue[0].lead)
	} else {
		c.leading = false
	}
	c.mu.Unlock()
	<-me.done
	return me.result()
}

func (cl *call) result() error {
	if cl.panic != nil {
		panic(cl.panic)
	}
	return cl.err
}

// commit runs group in one transaction; if it fails, each function again
// in a transaction of its own, for its own error.
func (c *committer) commit(group []*call) {
	err := c.db.Update(func(tx *bbolt.Tx) error {
		for _, cl := range group {
			if err := cl.run(tx); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil && len(group) > 1 {
		for _, cl := range group {
			if cl.panic == nil { // a function that panicked is not run again
				cl.err = c.db.Update(cl.run)
			}
			close(cl.done)
		}
		return
	}
	for _, cl := range group {
		cl.err = err
		close(cl.done)
	}
}

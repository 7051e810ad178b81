package lazy

import (
	"context"
	"sync"
	"time"
)

// sched orders an FS's requests to the store so that a read a sandbox is
// blocked on never waits behind speculative ones.
//
// Demand fetches (a FUSE read missed the cache and waits) take one of
// demandMax slots, in arrival order; they never wait for background work.
// Background fetches (readahead, trace prefetch) start only while no
// demand fetch is in flight or waiting, nor ended within demandHold (a
// process's page faults come one after another: the gaps between them
// are not idle time), at most bgMax at once, and each
// asks for at most bgMaxBytes, so that a demand fetch arriving while they
// run shares the link with little. A demand read of a chunk a background
// fetch is already getting joins that fetch (image.inflight), it does not
// fetch the chunk again.
//
// mu guards demand, lastDemand, bg and wake.
type sched struct {
	dsem chan struct{} // demand slots
	hold time.Duration

	mu         sync.Mutex
	demand     int           // demand fetches waiting for a slot or in flight
	lastDemand time.Time     // when the last demand fetch ended
	bg         int           // background fetches in flight
	bgMax      int           // background fetches at most at once
	wake       chan struct{} // closed (and replaced) when demand or bg falls
}

// bgMaxBytes bounds what one background request asks for: at 20 Mbit/s,
// 256 KiB is ~0.1 s of the link that a demand fetch arriving meanwhile
// shares.
const bgMaxBytes = 256 << 10

// demandHold is how long background fetches keep off the store after the
// last demand fetch ended.
const demandHold = 20 * time.Millisecond

func newSched(demandMax, bgMax int) *sched {
	return &sched{dsem: make(chan struct{}, demandMax), hold: demandHold, bgMax: bgMax, wake: make(chan struct{})}
}

// beginDemand counts a demand fetch: background fetches do not start
// from the call on until the matching endDemand.
func (s *sched) beginDemand() {
	s.mu.Lock()
	s.demand++
	s.mu.Unlock()
}

// demandSlot takes a demand slot for a fetch counted by beginDemand,
// waiting in arrival order; it fails only when ctx ends. The slot is
// given back by releaseSlot.
func (s *sched) demandSlot(ctx context.Context) error {
	select {
	case s.dsem <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (s *sched) releaseSlot() { <-s.dsem }

// endDemand uncounts a demand fetch.
func (s *sched) endDemand() {
	s.mu.Lock()
	s.demand--
	s.lastDemand = time.Now()
	if s.demand == 0 {
		s.broadcastLocked()
	}
	s.mu.Unlock()
}

func (s *sched) broadcastLocked() {
	close(s.wake)
	s.wake = make(chan struct{})
}

// tryBackground takes a background slot if no more than own demand
// fetches are waiting or in flight (those of the caller's read, for its
// readahead) and one is free; it never waits. The hold does not apply:
// the caller's read is the fault that came, and its readahead is what
// the same process reads next.
func (s *sched) tryBackground(own int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.demand > own || s.bg >= s.bgMax {
		return false
	}
	s.bg++
	return true
}

// acquireBackground waits for a background slot (see tryBackground); it
// returns false if done is closed first.
func (s *sched) acquireBackground(done <-chan struct{}) bool {
	for {
		s.mu.Lock()
		quiet := s.hold - time.Since(s.lastDemand)
		if s.demand == 0 && quiet <= 0 && s.bg < s.bgMax {
			s.bg++
			s.mu.Unlock()
			return true
		}
		w, busy := s.wake, s.demand > 0
		s.mu.Unlock()
		if busy || quiet <= 0 { // woken when demand or bg falls
			select {
			case <-w:
				continue
			case <-done:
				return false
			}
		}
		t := time.NewTimer(quiet) // then the hold is over
		select {
		case <-w:
		case <-t.C:
		case <-done:
			t.Stop()
			return false
		}
		t.Stop()
	}
}

func (s *sched) releaseBackground() {
	s.mu.Lock()
	s.bg--
	s.broadcastLocked()
	s.mu.Unlock()
}

// counts returns the demand fetches waiting or in flight and the
// background fetches in flight.
func (s *sched) counts() (demand, bg int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.demand, s.bg
}

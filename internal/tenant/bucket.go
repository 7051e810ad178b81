package tenant

import (
	"math"
	"time"
)

// Bucket is a token bucket: Rate tokens a second up to Burst; Take spends
// one. The zero Bucket is empty; not safe for concurrent use (its owner
// holds a lock).
type Bucket struct {
	rate, burst float64
	tokens      float64
	last        time.Time
}

// NewBucket returns a full bucket refilled at rate tokens a second, holding
// at most burst (burst < 1: max(1, rate)).
func NewBucket(rate float64, burst int64, now time.Time) *Bucket {
	b := float64(burst)
	if b < 1 {
		b = math.Max(1, math.Ceil(rate))
	}
	return &Bucket{rate: rate, burst: b, tokens: b, last: now}
}

// Same reports whether b was made with rate and burst.
func (b *Bucket) Same(rate float64, burst int64) bool {
	n := NewBucket(rate, burst, time.Time{})
	return b.rate == n.rate && b.burst == n.burst
}

// Take spends a token at now and reports whether there was one.
func (b *Bucket) Take(now time.Time) bool {
	if d := now.Sub(b.last); d > 0 {
		b.tokens = math.Min(b.burst, b.tokens+d.Seconds()*b.rate)
		b.last = now
	}
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}

// Put gives back a token Take spent (the create it admitted was refused
// for another reason).
func (b *Bucket) Put() { b.tokens = math.Min(b.burst, b.tokens+1) }

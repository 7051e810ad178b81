package sandbox

import (
	"strings"
	"time"
)

// Phases times the steps of one operation for its debug log line, so
// that the log says where a slow create or start spent its time: Mark
// after each step; String lists them ("limits=1.2ms agent=3.4ms").
type Phases struct {
	last time.Time
	b    strings.Builder
}

// StartPhases starts timing the first step now.
func StartPhases() *Phases { return &Phases{last: time.Now()} }

// Mark ends the step called name, begun at the previous Mark (or at
// StartPhases).
func (p *Phases) Mark(name string) {
	now := time.Now()
	if p.b.Len() > 0 {
		p.b.WriteByte(' ')
	}
	p.b.WriteString(name)
	p.b.WriteByte('=')
	p.b.WriteString(now.Sub(p.last).Round(10 * time.Microsecond).String())
	p.last = now
}

func (p *Phases) String() string { return p.b.String() }

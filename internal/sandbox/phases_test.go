package sandbox

import (
	"regexp"
	"testing"
	"time"
)

func TestPhases(t *testing.T) {
	ph := StartPhases()
	time.Sleep(2 * time.Millisecond)
	ph.Mark("first")
	ph.Mark("second")
	got := ph.String()
	m := regexp.MustCompile(`^first=([0-9.]+)ms second=([0-9.]+[µm]?s)$`).FindStringSubmatch(got)
	if m == nil {
		t.Fatalf("phases %q: want first=<ms> second=<duration>", got)
	}
	if d, _ := time.ParseDuration(m[1] + "ms"); d < 2*time.Millisecond {
		t.Errorf("first step %s, want >= 2ms (it slept that long)", d)
	}
}

package limits

import (
	"errors"
	"io"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

func TestSecondsDoNotWrap(t *testing.T) {
	if d := Seconds(18446744075); d != math.MaxInt64 {
		t.Errorf("Seconds(18446744075) = %s, want saturated (it wraps to 1.3s)", d)
	}
	if d := Seconds(-18446744075); d != math.MinInt64 {
		t.Errorf("Seconds(-18446744075) = %s", d)
	}
	if d := Millis(math.MaxInt64); d != math.MaxInt64 {
		t.Errorf("Millis(max) = %s", d)
	}
	if d := Seconds(90); d != 90*time.Second {
		t.Errorf("Seconds(90) = %s", d)
	}
	err := Duration("timeout", Seconds(18446744075), time.Second, 24*time.Hour)
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "overflow") {
		t.Errorf("Duration of an overflow: %v", err)
	}
}

func TestReaderBounds(t *testing.T) {
	b, err := io.ReadAll(Reader(strings.NewReader("12345"), 5, "x"))
	if err != nil || string(b) != "12345" {
		t.Fatalf("exactly the bound: %q %v", b, err)
	}
	_, err = io.ReadAll(Reader(strings.NewReader("123456"), 5, "x"))
	if !errors.Is(err, ErrTooLarge) || !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("over the bound: %v", err)
	}
}

package vminit

import (
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// syncClock steps the guest's clock forward when it is behind its RTC: the
// guest's clock stands still while its VM is paused (a snapshot restored
// later), while QEMU's RTC follows the host's. The RTC counts whole
// seconds: a clock behind the RTC's second is behind by more than the
// part of a second the RTC does not show, and is set to the middle of the
// RTC's second (within half a second of the host's); a clock that is not
// is left alone (never stepped back). Called at each new host session (a
// resume begins one).
func syncClock() {
	f, err := os.Open("/dev/rtc0")
	if err != nil {
		return
	}
	defer f.Close()
	rt, err := unix.IoctlGetRTCTime(int(f.Fd()))
	if err != nil {
		return
	}
	rtc := time.Date(int(rt.Year)+1900, time.Month(rt.Mon+1), int(rt.Mday), int(rt.Hour), int(rt.Min), int(rt.Sec), 0, time.UTC)
	if !rtc.After(time.Now()) {
		return
	}
	ts := unix.NsecToTimespec(rtc.Add(500 * time.Millisecond).UnixNano())
	unix.ClockSettime(unix.CLOCK_REALTIME, &ts)
}

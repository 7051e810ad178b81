package vminit

import (
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// syncClock steps the guest's clock forward to its RTC's time when it is
// more than a second behind it: the guest's clock stands still while its
// VM is paused (a snapshot restored later), while QEMU's RTC follows the
// host's. The RTC counts whole seconds, so the clock is never stepped back.
// Called at each new host session (a resume begins one).
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
	if rtc.Sub(time.Now()) <= time.Second {
		return
	}
	ts := unix.NsecToTimespec(rtc.UnixNano())
	unix.ClockSettime(unix.CLOCK_REALTIME, &ts)
}

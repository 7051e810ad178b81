// Package procfs reads the size fields of the kernel's /proc files, the
// lines "KEY:   N kB" of /proc/meminfo and /proc/PID/status. The host's
// benchmarks and VM backend read them, and so does the guest agent.
package procfs

import (
	"os"
	"strconv"
	"strings"
)

// KiB returns N of path's line "KEY N kB" (key with its colon:
// "MemFree:", "VmRSS:"); ok is false when the file, the line or the
// number is missing.
func KiB(path, key string) (n int64, ok bool) {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	for _, l := range strings.Split(string(data), "\n") {
		if v, found := strings.CutPrefix(l, key); found {
			n, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return n, err == nil
		}
	}
	return 0, false
}

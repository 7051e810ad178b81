// Package procfs reads fields of the kernel's /proc files: the size
// lines "KEY:   N kB" of /proc/meminfo and /proc/PID/status (the host's
// benchmarks and VM backend read them, and so does the guest agent), and a
// process's cgroup v2 path in /proc/PID/cgroup (the guest agent's), and
// the escaped paths of /proc/PID/mountinfo.
package procfs

import (
	"errors"
	"os"
	"strconv"
	"strings"
)

// Cgroup2 returns the cgroup v2 path of process pid ("self" or a number):
// its /proc/PID/cgroup line "0::PATH".
func Cgroup2(pid string) (string, error) {
	data, err := os.ReadFile("/proc/" + pid + "/cgroup")
	if err != nil {
		return "", err
	}
	for l := range strings.Lines(string(data)) {
		if g, ok := strings.CutPrefix(strings.TrimSpace(l), "0::"); ok {
			return g, nil
		}
	}
	return "", errors.New("process " + pid + " is in no cgroup v2 hierarchy")
}

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

// UnescapeMountinfo undoes the kernel's octal escapes (\040 for a space,
// \134 for a backslash, ...) of a path in /proc/PID/mountinfo.
func UnescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

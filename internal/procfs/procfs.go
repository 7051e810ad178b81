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

// Mount is one line of /proc/PID/mountinfo, its paths unescaped:
//
//	36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue
type Mount struct {
	ID, Parent   int
	Dev          string   // "major:minor" of the file system
	Root         string   // the mount's root within its file system
	Point        string   // where it is mounted
	Options      []string // per-mount options ("rw", "noatime", ...)
	Optional     []string // optional fields ("shared:1", "master:2", ...)
	FSType       string
	Source       string
	SuperOptions []string // per-superblock options (a v1 cgroup's controllers, ...)
}

// Mountinfo parses /proc/PID/mountinfo (pid "self" or a number). Lines
// that do not parse are skipped.
func Mountinfo(pid string) ([]Mount, error) {
	data, err := os.ReadFile("/proc/" + pid + "/mountinfo")
	if err != nil {
		return nil, err
	}
	return ParseMountinfo(string(data)), nil
}

// ParseMountinfo parses the text of a mountinfo file (see Mountinfo).
func ParseMountinfo(data string) []Mount {
	var ms []Mount
	for line := range strings.SplitSeq(data, "\n") {
		pre, post, ok := strings.Cut(line, " - ")
		if !ok {
			continue
		}
		f, g := strings.Fields(pre), strings.Fields(post)
		if len(f) < 6 || len(g) < 2 {
			continue
		}
		id, err1 := strconv.Atoi(f[0])
		parent, err2 := strconv.Atoi(f[1])
		if err1 != nil || err2 != nil {
			continue
		}
		m := Mount{
			ID: id, Parent: parent, Dev: f[2],
			Root:     UnescapeMountinfo(f[3]),
			Point:    UnescapeMountinfo(f[4]),
			Options:  strings.Split(f[5], ","),
			Optional: f[6:],
			FSType:   g[0],
			Source:   UnescapeMountinfo(g[1]),
		}
		if len(g) > 2 {
			m.SuperOptions = strings.Split(g[2], ",")
		}
		ms = append(ms, m)
	}
	return ms
}

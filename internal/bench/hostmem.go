package bench

import (
	"bufio"
	"bytes"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Host memory, read from /proc and the cgroup file systems of the machine
// the benchmark runs on (it must be the server's: the density benchmark
// says so when it cannot find the server's process).

// meminfo is /proc/meminfo in bytes by field name.
func meminfo() map[string]int64 {
	out := map[string]int64{}
	data, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return out
	}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		f := strings.Fields(v)
		if len(f) == 0 {
			continue
		}
		n, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			continue
		}
		if len(f) > 1 && f[1] == "kB" {
			n <<= 10
		}
		out[k] = n
	}
	return out
}

// procMem is what smaps_rollup and status say of a process, in bytes.
type procMem struct {
	RSS     int64 `json:"rss_bytes"`
	PSS     int64 `json:"pss_bytes"`
	Private int64 `json:"private_bytes"`
	Swap    int64 `json:"swap_bytes"`
	Threads int64 `json:"threads"`
}

func (p *procMem) add(q procMem) {
	p.RSS += q.RSS
	p.PSS += q.PSS
	p.Private += q.Private
	p.Swap += q.Swap
	p.Threads += q.Threads
}

func readProcMem(pid int) (procMem, bool) {
	var m procMem
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		return m, false
	}
	for _, line := range strings.Split(string(data), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		f := strings.Fields(v)
		if len(f) == 0 {
			continue
		}
		n, _ := strconv.ParseInt(f[0], 10, 64)
		n <<= 10
		switch k {
		case "Rss":
			m.RSS = n
		case "Pss":
			m.PSS = n
		case "Private_Clean", "Private_Dirty":
			m.Private += n
		case "Swap":
			m.Swap = n
		}
	}
	if st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid)); err == nil {
		for _, line := range strings.Split(string(st), "\n") {
			if v, ok := strings.CutPrefix(line, "Threads:"); ok {
				m.Threads, _ = strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			}
		}
	}
	return m, true
}

// sandboxMem sums the memory of the sandboxes under a cgroup parent (the
// node's --cgroup-parent) in the cgroup v1 memory hierarchy: their
// cgroups' charges, and their processes split into guest agents and the
// rest. Pool containers waiting for a claim are among them.
type sandboxMem struct {
	Cgroups    int     `json:"cgroups"`
	Charged    int64   `json:"charged_bytes"`   // memory.usage_in_bytes (user pages, page cache, kernel memory)
	Kmem       int64   `json:"kmem_bytes"`      // memory.kmem.usage_in_bytes: kernel objects charged to them
	Swap       int64   `json:"swap_bytes"`      // memsw - usage: swapped out
	Agents     int     `json:"agents"`          // processes named shoal-agent
	AgentMem   procMem `json:"agent"`           // their smaps_rollup sums
	Others     int     `json:"other_processes"` // the rest (the resident shells)
	OtherMem   procMem `json:"other"`
	Unreadable int     `json:"unreadable_processes,omitempty"` // gone before they were read
}

func readSandboxMem(parent string) sandboxMem {
	var s sandboxMem
	root := filepath.Join("/sys/fs/cgroup/memory", parent)
	dirs, err := os.ReadDir(root)
	if err != nil {
		return s
	}
	for _, d := range dirs {
		if !d.IsDir() {
			continue
		}
		dir := filepath.Join(root, d.Name())
		s.Cgroups++
		u := readInt64(filepath.Join(dir, "memory.usage_in_bytes"))
		s.Charged += u
		s.Kmem += readInt64(filepath.Join(dir, "memory.kmem.usage_in_bytes"))
		if sw := readInt64(filepath.Join(dir, "memory.memsw.usage_in_bytes")); sw > u {
			s.Swap += sw - u
		}
		procs, _ := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
		for _, f := range strings.Fields(string(procs)) {
			pid, err := strconv.Atoi(f)
			if err != nil {
				continue
			}
			m, ok := readProcMem(pid)
			if !ok {
				s.Unreadable++
				continue
			}
			if isInit(pid) {
				s.Agents++
				s.AgentMem.add(m)
			} else {
				s.Others++
				s.OtherMem.add(m)
			}
		}
	}
	return s
}

func readInt64(path string) int64 {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	n, _ := strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64)
	return n
}

// servePID finds the process listening on the API URL's TCP port on this
// machine (0 if none is found: the server runs elsewhere).
func servePID(apiURL string) int {
	u, err := url.Parse(apiURL)
	if err != nil {
		return 0
	}
	port, err := strconv.Atoi(u.Port())
	if err != nil {
		return 0
	}
	inodes := map[string]bool{}
	for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		data, _ := os.ReadFile(f)
		for _, line := range strings.Split(string(data), "\n")[1:] {
			fs := strings.Fields(line)
			if len(fs) < 10 || fs[3] != "0A" { // LISTEN
				continue
			}
			_, p, ok := strings.Cut(fs[1], ":")
			if !ok {
				continue
			}
			if n, err := strconv.ParseInt(p, 16, 32); err == nil && int(n) == port {
				inodes["socket:["+fs[9]+"]"] = true
			}
		}
	}
	if len(inodes) == 0 {
		return 0
	}
	procs, _ := os.ReadDir("/proc")
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
		for _, fd := range fds {
			if l, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name())); err == nil && inodes[l] {
				return pid
			}
		}
	}
	return 0
}

// isInit reports whether pid is PID 1 of its pid namespace (a sandbox's
// guest agent).
func isInit(pid int) bool {
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(st), "\n") {
		if v, ok := strings.CutPrefix(line, "NSpid:"); ok {
			f := strings.Fields(v)
			return len(f) > 1 && f[len(f)-1] == "1"
		}
	}
	return false
}

// slabs is /proc/slabinfo: bytes held by each cache (objects × size).
func slabs() map[string]int64 {
	out := map[string]int64{}
	data, err := os.ReadFile("/proc/slabinfo")
	if err != nil {
		return out
	}
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) < 4 || strings.HasPrefix(line, "#") || strings.HasPrefix(line, "slabinfo") {
			continue
		}
		objs, err1 := strconv.ParseInt(f[2], 10, 64)
		size, err2 := strconv.ParseInt(f[3], 10, 64)
		if err1 == nil && err2 == nil {
			out[f[0]] += objs * size
		}
	}
	return out
}

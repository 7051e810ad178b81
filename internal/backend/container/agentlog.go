package container

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// The agent's log.
//
// A container's stdio is runc's, and the agent inherits it: stdin and
// stdout are /dev/null, stderr is the write end of a pipe. The node drains
// the read end into DIR/agent.log (runc's errors, the agent's start-up
// errors and warnings, Go runtime crashes) up to agentLogCap bytes; then it
// writes a last line saying so and closes the pipe. No host file is ever a
// descriptor of the container: whatever a sandbox process could write to
// the agent's stderr (it cannot: the agent is not dumpable, see
// agent.SetNotDumpable) would cost the host at most the cap.
//
// The pipe outlives the node process; the agent writes to it without
// blocking and drops what does not fit (agent.PrepareStderr), so a node
// that is gone, or slow, never stalls it. Recover reopens the read end
// (/proc/PID/fd/2 of the agent) and drains it again, within the same cap.

// agentLogCap bounds DIR/agent.log.
const agentLogCap = 256 << 10

// logDrain copies a container's log pipe into its agent.log.
type logDrain struct {
	r    *os.File
	done chan struct{} // closed when the pipe reached EOF or was closed
}

// drainAgentLog starts copying r (a pipe's read end; the drain owns it)
// into the file at path, opened for appending. When the file reaches the
// cap, or on EOF, it closes r and stops.
func drainAgentLog(r *os.File, path string) (*logDrain, error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o640)
	if err != nil {
		r.Close()
		return nil, err
	}
	d := &logDrain{r: r, done: make(chan struct{})}
	go func() {
		defer close(d.done)
		defer f.Close()
		defer r.Close()
		size := int64(0)
		if fi, err := f.Stat(); err == nil {
			size = fi.Size()
		}
		buf := make([]byte, 4<<10)
		for size < agentLogCap {
			n, err := r.Read(buf[:min(int64(len(buf)), agentLogCap-size)])
			if n > 0 {
				if _, werr := f.Write(buf[:n]); werr != nil {
					return
				}
				size += int64(n)
			}
			if err != nil {
				return // EOF: every writer is gone
			}
		}
		fmt.Fprintf(f, "\nshoal: the agent log reached its cap of %d bytes; the rest is dropped\n", agentLogCap)
	}()
	return d, nil
}

// settle waits until the drain has copied everything its writers wrote and
// they are gone, at most for timeout: before reading the log for an error
// message.
func (d *logDrain) settle(timeout time.Duration) {
	if d == nil {
		return
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-d.done:
	case <-t.C:
	}
}

// stop stops the drain (as the node's exit would) and waits for it.
func (d *logDrain) stop() {
	d.r.Close()
	<-d.done
}

// drains tracks the log drains of one process by runc container ID, so
// that a Recover does not start a second one for a container this process
// started.
type drains struct {
	mu sync.Mutex
	m  map[string]*logDrain
}

func (ds *drains) add(id string, d *logDrain) {
	ds.mu.Lock()
	defer ds.mu.Unlock()
	if ds.m == nil {
		ds.m = map[string]*logDrain{}
	}
	ds.m[id] = d
	go func() {
		<-d.done
		ds.mu.Lock()
		if ds.m[id] == d {
			delete(ds.m, id)
		}
		ds.mu.Unlock()
	}()
}

func (ds *drains) has(id string) bool {
	ds.mu.Lock()
	defer ds.mu.Unlock()
	_, ok := ds.m[id]
	return ok
}

// agentLogPath is where a sandbox's agent log is: in the sandbox's dir for
// a cold sandbox, in its container dir under PoolDir for a pooled one.
func (b *Backend) agentLogPath(h sandbox.Handle, runcID string) string {
	if strings.HasPrefix(runcID, poolPrefix) {
		return filepath.Join(b.claimedDir(h.ID), agentLogName)
	}
	return filepath.Join(h.Data["dir"], agentLogName)
}

// initProcess returns the pid of a container's init and its start time as
// runc recorded them.
func (b *Backend) initProcess(runcID string) (pid int, start uint64, err error) {
	data, err := os.ReadFile(filepath.Join(b.stateDir, runcID, "state.json"))
	if errors.Is(err, os.ErrNotExist) {
		// The native launcher's record (native.go), of the same form.
		data, err = os.ReadFile(b.nativeStatePath(runcID))
	}
	if err != nil {
		return 0, 0, err
	}
	var st struct {
		Pid   int    `json:"init_process_pid"`
		Start uint64 `json:"init_process_start"`
	}
	if err := json.Unmarshal(data, &st); err != nil {
		return 0, 0, fmt.Errorf("runc state: %w", err)
	}
	return st.Pid, st.Start, nil
}

// processStart returns field 22 (starttime) of /proc/PID/stat, and whether
// the process is a zombie (or dead).
func processStart(pid int) (start uint64, dead bool, err error) {
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, true, nil // gone
	}
	// Field 22 comes after the command name, which is in parentheses and
	// may contain spaces.
	rest := string(stat)
	if i := strings.LastIndexByte(rest, ')'); i >= 0 {
		rest = rest[i+1:]
	}
	f := strings.Fields(rest)
	if len(f) < 20 {
		return 0, false, fmt.Errorf("short /proc/%d/stat", pid)
	}
	if f[0] == "Z" || f[0] == "X" {
		return 0, true, nil
	}
	start, err = strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return 0, false, fmt.Errorf("/proc/%d/stat: %w", pid, err)
	}
	return start, false, nil
}

// reattachLog drains the agent log pipe of a running container again, after
// a restart of the node: it reopens the read end through the agent's
// /proc/PID/fd/2. Best effort: the agent does not need a reader.
func (b *Backend) reattachLog(h sandbox.Handle, runcID string) error {
	if b.drains.has(runcID) {
		return nil
	}
	path := b.agentLogPath(h, runcID)
	if fi, err := os.Stat(path); err == nil && fi.Size() >= agentLogCap {
		return nil // capped: the pipe stays without a reader
	}
	pid, start, err := b.initProcess(runcID)
	if err != nil {
		return err
	}
	fd, err := unix.Open("/proc/"+strconv.Itoa(pid)+"/fd/2", unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("reopen agent log pipe: %w", err)
	}
	// The pid must still be the container's init (not reused), and its
	// stderr a pipe: checked after the open, on what was opened.
	var st unix.Stat_t
	now, dead, err := processStart(pid)
	if err == nil && (dead || now != start) {
		err = errors.New("the container's init is gone")
	}
	if err == nil {
		if err = unix.Fstat(fd, &st); err == nil && st.Mode&unix.S_IFMT != unix.S_IFIFO {
			err = fmt.Errorf("the agent's stderr is not a pipe (mode %#o)", st.Mode)
		}
	}
	if err != nil {
		unix.Close(fd)
		return fmt.Errorf("reopen agent log pipe: %w", err)
	}
	d, err := drainAgentLog(os.NewFile(uintptr(fd), "agent-log"), path)
	if err != nil {
		return fmt.Errorf("reopen agent log: %w", err)
	}
	b.drains.add(runcID, d)
	return nil
}

package container

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

var _ sandbox.Prober = (*Backend)(nil)

// Alive reports whether the sandbox's init (its guest agent) still runs,
// the way runc itself decides it: the pid in runc's state file must exist
// and have the start time runc recorded (so a reused pid does not count).
// It reads two small files and runs nothing.
func (b *Backend) Alive(h sandbox.Handle) (bool, error) {
	id, err := b.runcID(h)
	if err != nil {
		return false, err
	}
	data, err := os.ReadFile(filepath.Join(b.stateDir, id, "state.json"))
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("probe sandbox %s: %w", h.ID, err)
	}
	var st struct {
		Pid   int    `json:"init_process_pid"`
		Start uint64 `json:"init_process_start"`
	}
	if err := json.Unmarshal(data, &st); err != nil {
		return false, fmt.Errorf("probe sandbox %s: runc state: %w", h.ID, err)
	}
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(st.Pid) + "/stat")
	if err != nil {
		return false, nil // gone
	}
	// Field 22 (starttime) comes after the command name, which is in
	// parentheses and may contain spaces.
	rest := string(stat)
	if i := strings.LastIndexByte(rest, ')'); i >= 0 {
		rest = rest[i+1:]
	}
	f := strings.Fields(rest)
	if len(f) < 20 {
		return false, fmt.Errorf("probe sandbox %s: short /proc/%d/stat", h.ID, st.Pid)
	}
	if f[0] == "Z" || f[0] == "X" {
		return false, nil // exited, not yet reaped
	}
	start, err := strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return false, fmt.Errorf("probe sandbox %s: /proc/%d/stat: %w", h.ID, st.Pid, err)
	}
	return start == st.Start, nil
}

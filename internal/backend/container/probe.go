package container

import (
	"errors"
	"fmt"
	"io/fs"

	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// Alive reports whether the sandbox's init (its guest agent) still runs,
// the way runc itself decides it: the pid in runc's state file must exist
// and have the start time runc recorded (so a reused pid does not count).
// It reads two small files and runs nothing.
func (b *Backend) Alive(h sandbox.Handle) (bool, error) {
	id, err := b.runcID(h)
	if err != nil {
		return false, err
	}
	pid, start, err := b.initProcess(id)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("probe sandbox %s: %w", h.ID, err)
	}
	now, dead, err := processStart(pid)
	if err != nil {
		return false, fmt.Errorf("probe sandbox %s: %w", h.ID, err)
	}
	return !dead && now == start, nil
}

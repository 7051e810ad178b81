package node

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.etcd.io/bbolt"
	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// freezerBackend is a backend whose sandboxes exist only as records: it
// counts Freeze and Thaw calls and can be told to fail Freeze.
type freezerBackend struct {
	mu        sync.Mutex
	frozen    bool
	freezes   int
	thaws     int
	overlap   bool  // a Freeze came while frozen
	freezeErr error // returned by Freeze
}

func (b *freezerBackend) Name() string                       { return "fake" }
func (b *freezerBackend) Capabilities() sandbox.Capabilities { return sandbox.Capabilities{} }
func (b *freezerBackend) Create(context.Context, sandbox.Spec) (sandbox.Handle, error) {
	return sandbox.Handle{}, sandbox.ErrUnsupported
}
func (b *freezerBackend) Recover(context.Context, sandbox.Handle) (sandbox.Status, error) {
	return sandbox.StatusRunning, nil
}
func (b *freezerBackend) Delete(context.Context, sandbox.Handle) error { return nil }

func (b *freezerBackend) Freeze(ctx context.Context, h sandbox.Handle) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.freezeErr != nil {
		return b.freezeErr
	}
	b.overlap = b.overlap || b.frozen
	b.frozen = true
	b.freezes++
	return nil
}

func (b *freezerBackend) Thaw(ctx context.Context, h sandbox.Handle) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.frozen = false
	b.thaws++
	return nil
}

func (b *freezerBackend) isFrozen() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.frozen
}

// sbID is the sandbox of commitEnv.
const sbID = "aaaaaaaaaaaaaaaaaaaa"

// commitEnv is a Manager over a fake backend with one running sandbox
// sbID, whose writable layer is upper.
func commitEnv(t *testing.T) (m *Manager, b *freezerBackend, upper string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: a commit keeps owners and whiteouts")
	}
	if _, err := exec.LookPath("mkfs.erofs"); err != nil {
		t.Skip("needs mkfs.erofs (erofs-utils)")
	}
	dir := t.TempDir()
	db, err := bbolt.Open(filepath.Join(dir, "db"), 0o600, &bbolt.Options{Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	layers, err := layer.Open(filepath.Join(dir, "layers"), db, log)
	if err != nil {
		t.Fatal(err)
	}
	agentBin := filepath.Join(dir, "agent")
	os.WriteFile(agentBin, nil, 0o755)
	b = &freezerBackend{}
	m, err = New(Config{DataDir: dir, AgentBinary: agentBin, DefaultBackend: "fake"}, db, layers, []sandbox.Backend{b}, log)
	if err != nil {
		t.Fatal(err)
	}
	sbDir := filepath.Join(dir, "sandboxes", sbID)
	upper = filepath.Join(sbDir, upperDirName)
	if err := os.MkdirAll(filepath.Join(upper, "work"), 0o755); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(upper, "work", "f"), []byte("data"), 0o644)
	m.sandboxes[sbID] = &entry{rec: Record{
		ID: sbID, Backend: "fake", State: StateRunning, Timeout: time.Hour,
		Handle: sandbox.Handle{ID: sbID, Backend: "fake", Data: map[string]string{"dir": sbDir}},
	}}
	return m, b, upper
}

// TestCommitFreezesDuringCopy: the sandbox is frozen while its writable
// layer is copied and thawed before the image is built; thawed when the
// commit fails; a failed freeze fails the commit; a backend that cannot
// freeze gets an unfrozen commit; commits of one sandbox do not overlap.
func TestCommitFreezesDuringCopy(t *testing.T) {
	m, b, upper := commitEnv(t)
	ctx := context.Background()
	var stages []string
	progress := func(p layer.Progress) {
		if p.Message != "" {
			state := "thawed"
			if b.isFrozen() {
				state = "frozen"
			}
			stages = append(stages, p.Stage+":"+state)
		}
	}
	l, err := m.CommitLayer(ctx, sbID, layer.CommitOptions{Kind: layer.KindWorkspace, Name: "c", Version: "1", Progress: progress})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(stages, " "); got != "copy:frozen scan:thawed mkfs:thawed hash:thawed done:thawed" {
		t.Errorf("stages: %s", got)
	}
	if b.freezes != 1 || b.thaws != 1 || l.Files != 2 {
		t.Errorf("freezes %d thaws %d files %d", b.freezes, b.thaws, l.Files)
	}

	// A refused commit thaws too.
	if err := unix.Mkfifo(filepath.Join(upper, "work", "p"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = m.CommitLayer(ctx, sbID, layer.CommitOptions{Kind: layer.KindWorkspace, Name: "c", Version: "2"})
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || b.isFrozen() || b.freezes != 2 || b.thaws != 2 {
		t.Errorf("refused commit: %v; frozen %v, freezes %d, thaws %d", err, b.isFrozen(), b.freezes, b.thaws)
	}
	os.Remove(filepath.Join(upper, "work", "p"))

	// So does a cancelled one.
	cctx, cancel := context.WithCancel(ctx)
	_, err = m.CommitLayer(cctx, sbID, layer.CommitOptions{Kind: layer.KindWorkspace, Name: "c", Version: "3",
		Progress: func(p layer.Progress) {
			if p.Stage == layer.StageCopy {
				cancel()
			}
		}})
	if !errors.Is(err, context.Canceled) || b.isFrozen() || b.thaws != 3 {
		t.Errorf("cancelled commit: %v; frozen %v, thaws %d", err, b.isFrozen(), b.thaws)
	}

	// A freeze that fails fails the commit.
	b.freezeErr = errors.New("cgroup says no")
	_, err = m.CommitLayer(ctx, sbID, layer.CommitOptions{Kind: layer.KindWorkspace, Name: "c", Version: "4"})
	if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "cgroup says no") {
		t.Errorf("commit with a failed freeze: %v", err)
	}
	// A host that cannot freeze: the commit goes on, with a note.
	b.freezeErr = sandbox.ErrUnsupported
	var notes []string
	_, err = m.CommitLayer(ctx, sbID, layer.CommitOptions{Kind: layer.KindWorkspace, Name: "c", Version: "5",
		Progress: func(p layer.Progress) { notes = append(notes, p.Message) }})
	if err != nil || !strings.Contains(strings.Join(notes, "\n"), "cannot be frozen") {
		t.Errorf("commit without a freezer: %v %q", err, notes)
	}
	b.freezeErr = nil

	// Concurrent commits of one sandbox take turns.
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Go(func() {
			if _, err := m.CommitLayer(ctx, sbID, layer.CommitOptions{Kind: layer.KindWorkspace, Name: "par", Version: string(rune('a' + i))}); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if b.overlap || b.isFrozen() {
		t.Errorf("overlapping freezes %v, left frozen %v", b.overlap, b.frozen)
	}
}

package microvm

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/agent/vminit"
	"github.com/shoal-sandbox/shoal/internal/egress"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// Boot from templates (Config.Boot BootTemplate): a microVM is created by
// restoring a snapshot of a guest stopped where every boot of its shape is
// the same (vminit's template.go: the kernel up, the agent's runtime
// started, the modules loaded but virtio_blk), instead of booting it. A
// shape is what the snapshot fixes: the accelerator, the guest's memory
// and CPUs, how many block devices it has (layers, a writable layer's
// disk), QEMU, the kernel and the initramfs. The first create of a shape
// boots as before and has its template made in the background (a boot of
// its own, then a snapshot); the creates after restore it into a QEMU with
// their own devices, and the guest goes on from there: virtio_blk, the
// sandbox's config, its mounts. A restore that fails drops the template
// and the create boots.
//
// Not for pmem layers (a guest's memory layout holds them: pmem.go), a
// full system (fullvm), or network egress (its device and link are the
// sandbox's): those boot.

// How a VM's guest starts (Config.Boot).
const (
	BootCold     = "cold"     // every create boots its guest
	BootTemplate = "template" // creates restore a template of their shape
)

// templateFormat changes when what a template holds changes.
const templateFormat = "1"

// maxTemplateFailures: a shape whose template failed this many restores
// boots from then on.
const maxTemplateFailures = 2

// maxTemplates bounds the shapes kept (each a snapshot of ~70 MiB under
// TCG); the least recently used goes.
const maxTemplates = 8

// templates is the node's templates, in dir (DATA/vm/templates).
type templates struct {
	dir string

	mu       sync.Mutex
	ready    map[string]*template // by key
	making   map[string]bool
	refused  map[string]string // key → why it is not made again (its making failed, or its restores)
	failures map[string]int    // key → restores of it that failed
}

type template struct {
	state string // the snapshot file
	used  time.Time
}

func newTemplates(dir string) (*templates, error) {
	// Templates of an earlier process may be of another QEMU or kernel
	// (their keys say so, but nothing would remove them): start afresh.
	// (Backend.sweepTemplates first ends what it was making.)
	if err := os.RemoveAll(dir); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	return &templates{dir: dir, ready: map[string]*template{}, making: map[string]bool{}, refused: map[string]string{}, failures: map[string]int{}}, nil
}

// sweepTemplates ends the QEMUs of templates an earlier process was making
// when it died (their own session outlives it) and removes their cgroups,
// before newTemplates removes their directories.
func (b *Backend) sweepTemplates(dir string) {
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		key, _, ok := strings.Cut(e.Name(), ".")
		if !e.IsDir() || !ok {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err := kill(ctx, pidfileProcess(filepath.Join(dir, e.Name())))
		cancel()
		if err == nil {
			err = b.removeCgroup(sandbox.Handle{ID: templateID(key)})
		}
		if err != nil {
			b.log.Warn("a template's QEMU left by an earlier process", "template", key, "err", err)
		}
	}
}

// templateID names the QEMU that makes key's template (its cgroups).
func templateID(key string) string { return "tpl-" + key }

// templateKey is the shape of the VM h (Create's handle) as a key, and
// whether a template can make it.
func (b *Backend) templateKey(h sandbox.Handle) (string, bool) {
	if b.tpl == nil || b.cfg.Machine != MachineMicroVM || h.Data["pmem"] != "" || h.Data["image"] != "" || egress.Has(h.Data) {
		return "", false
	}
	var images []string
	if err := json.Unmarshal([]byte(h.Data["layers"]), &images); err != nil {
		return "", false
	}
	ident := func(path string) string {
		fi, err := os.Stat(path)
		if err != nil {
			return path + ":?"
		}
		return fmt.Sprintf("%s:%d:%d", path, fi.Size(), fi.ModTime().UnixNano())
	}
	shape := strings.Join([]string{
		templateFormat, b.cfg.QEMU + "=" + ident(qemuPath(b.cfg.QEMU)), ident(b.kernel), ident(b.initrd),
		h.Data["accel"], h.Data["mem"], h.Data["cpus"], strconv.Itoa(len(images)),
		"disk=" + strconv.FormatBool(h.Data["disk"] != ""), "balloon=" + h.Data["balloon"],
	}, "\x00")
	sum := sha256.Sum256([]byte(shape))
	return hex.EncodeToString(sum[:8]), true
}

// qemuPath is the file the QEMU command runs.
func qemuPath(name string) string {
	if strings.Contains(name, "/") {
		return name
	}
	for _, d := range filepath.SplitList(os.Getenv("PATH")) {
		if p := filepath.Join(d, name); unix.Access(p, unix.X_OK) == nil {
			return p
		}
	}
	return name
}

// template returns the snapshot of key's template ("" if none yet).
func (t *templates) get(key string) string {
	t.mu.Lock()
	defer t.mu.Unlock()
	tp := t.ready[key]
	if tp == nil {
		return ""
	}
	tp.used = time.Now()
	return tp.state
}

// drop forgets key's template (a restore of it failed). It is made again
// at the next create of its shape, unless it failed maxTemplateFailures
// times: the same shape would fail the same way.
func (t *templates) drop(key, why string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if tp := t.ready[key]; tp != nil {
		os.Remove(tp.state)
		delete(t.ready, key)
	}
	t.failures[key]++
	if t.failures[key] >= maxTemplateFailures {
		t.refused[key] = why
	}
}

// claim marks key's template as being made; false if it is, exists or
// was refused.
func (t *templates) claim(key string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.making[key] || t.ready[key] != nil || t.refused[key] != "" {
		return false
	}
	t.making[key] = true
	return true
}

// done records the end of key's making: state, or why it failed.
func (t *templates) done(key, state string, err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.making, key)
	if err != nil {
		t.refused[key] = err.Error()
		return
	}
	if len(t.ready) >= maxTemplates {
		var oldest string
		for k, tp := range t.ready {
			if oldest == "" || tp.used.Before(t.ready[oldest].used) {
				oldest = k
			}
		}
		os.Remove(t.ready[oldest].state)
		delete(t.ready, oldest)
	}
	t.ready[key] = &template{state: state, used: time.Now()}
}

// createFromTemplate makes the VM of h from the template's snapshot state:
// a QEMU with h's devices restores it and the guest boots on from there.
func (b *Backend) createFromTemplate(ctx context.Context, h sandbox.Handle, state string) (sandbox.Handle, error) {
	f, err := os.OpenFile(state, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return h, err
	}
	defer f.Close()
	return b.startFrom(ctx, h, f)
}

// makeTemplateLater makes the template of key, shaped as h, in the
// background, unless it is being made, exists or failed before.
func (b *Backend) makeTemplateLater(key string, h sandbox.Handle) {
	if !b.tpl.claim(key) {
		return
	}
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), b.bootLimit+time.Minute)
		defer cancel()
		start := time.Now()
		state, err := b.makeTemplate(ctx, key, h)
		b.tpl.done(key, state, err)
		if err != nil {
			b.log.Warn("vm template not made: its shape boots", "template", key, "err", err)
			return
		}
		b.log.Info("vm template made", "template", key, "mem", h.Data["mem"], "cpus", h.Data["cpus"], "took", time.Since(start))
	}()
}

// makeTemplate boots a template guest of h's shape, with placeholder
// devices of its own, waits until it says it waits (vminit.TemplateReady)
// and snapshots it to a file, which it returns.
func (b *Backend) makeTemplate(ctx context.Context, key string, shape sandbox.Handle) (string, error) {
	dir, err := os.MkdirTemp(b.tpl.dir, key+".")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(dir)
	var images []string
	if err := json.Unmarshal([]byte(shape.Data["layers"]), &images); err != nil {
		return "", err
	}
	// Placeholders: the guest never reads them (no driver binds a block
	// device before the snapshot).
	placeholder := func(name string) (string, error) {
		p := filepath.Join(dir, name)
		return p, os.WriteFile(p, make([]byte, 4096), 0o600)
	}
	for i := range images {
		if images[i], err = placeholder("layer" + strconv.Itoa(i)); err != nil {
			return "", err
		}
	}
	if _, err := placeholder(configImage); err != nil {
		return "", err
	}
	if shape.Data["disk"] != "" {
		if _, err := placeholder(upperImage); err != nil {
			return "", err
		}
	}
	pipe := filepath.Join(dir, agentPipe)
	for _, f := range []string{pipe + ".in", pipe + ".out"} {
		if err := unix.Mkfifo(f, 0o600); err != nil {
			return "", err
		}
	}
	layers, _ := json.Marshal(images)
	h := sandbox.Handle{ID: templateID(key), Backend: b.cfg.Name, Data: map[string]string{
		"dir": dir, "accel": shape.Data["accel"], "machine": b.cfg.Machine,
		"mem": shape.Data["mem"], "cpus": shape.Data["cpus"], "layers": string(layers),
		"balloon": shape.Data["balloon"], "millicpu": "0", "disk": shape.Data["disk"],
		"template": "1",
	}}
	h, exited, err := b.start(h)
	if err != nil {
		return "", err
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := b.Delete(dctx, h); err != nil {
			b.log.Error("end a template's QEMU", "template", key, "err", err)
		}
	}()
	if err := waitTemplateReady(ctx, pipe, exited); err != nil {
		return "", fmt.Errorf("template guest: %w%s", err, b.console(filepath.Join(dir, "qmp.sock"), dir, exited, ""))
	}
	q, err := dialQMP(ctx, filepath.Join(dir, "qmp.sock"))
	if err != nil {
		return "", err
	}
	defer q.Close()
	if err := q.run("stop", nil, nil); err != nil {
		return "", err
	}
	state := filepath.Join(b.tpl.dir, key+".state")
	if err := b.snapshot(ctx, q, state, false); err != nil {
		return "", err
	}
	return state, nil
}

// waitTemplateReady reads the agent channel's guest end (path.out) until
// the guest writes vminit.TemplateReady.
func waitTemplateReady(ctx context.Context, path string, exited <-chan struct{}) error {
	var p *pipes
	for {
		var err error
		if p, err = openPipes(path); err == nil {
			break
		}
		if !errors.Is(err, unix.ENXIO) {
			return err
		}
		// QEMU has not opened its end yet.
		select {
		case <-exited:
			return errors.New("qemu exited")
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	defer p.Close()
	// QEMU's end or ctx's ends the reads (QEMU ends with this call's caller).
	go func() {
		select {
		case <-exited:
		case <-ctx.Done():
		}
		p.SetDeadline(time.Now())
	}()
	var seen []byte
	buf := make([]byte, 256)
	for {
		n, err := p.Read(buf)
		seen = append(seen, buf[:n]...)
		if bytes.Contains(seen, []byte(vminit.TemplateReady)) {
			return nil
		}
		if len(seen) > 4096 {
			return errors.New("the guest wrote something else than that it waits")
		}
		if err != nil {
			select {
			case <-exited:
				return errors.New("qemu exited")
			default:
			}
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if !errors.Is(err, io.EOF) {
				return err
			}
			// No writer yet: QEMU has not opened its end.
			time.Sleep(20 * time.Millisecond)
		}
	}
}

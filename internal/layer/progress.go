package layer

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"strconv"
	"sync"
	"time"
)

// Progress is one report of a build, commit or import on its way.
//
// A report with a Message starts a stage (or ends the build: Stage "done")
// and is meant to be printed as a line; reports without one update how far
// the current stage is, at most every progressInterval, for a progress bar.
type Progress struct {
	Stage   string // "extract", "unpack", "copy", "scan", "mkfs", "hash", "done"
	Done    int64  // units done in this stage
	Total   int64  // units in this stage; 0 if unknown
	Unit    string // "bytes", "files" or "layers"
	Message string // a human-readable line; "" for updates
}

// Stages of a build, in the order they run.
const (
	StageExtract = "extract" // unpacking a tarball
	StageUnpack  = "unpack"  // applying the layers of an image
	StageCopy    = "copy"    // copying a sandbox's upper directory
	StageScan    = "scan"    // checking the tree
	StageMkfs    = "mkfs"    // mkfs.erofs writing the image
	StageHash    = "hash"    // hashing the image
	StageDone    = "done"
)

const progressInterval = 100 * time.Millisecond

// reporter sends Progress to a callback, throttling updates. It is safe for
// concurrent use (mkfs progress is polled from another goroutine); mu
// guards every field and serializes calls of fn.
type reporter struct {
	mu    sync.Mutex
	fn    func(Progress) // nil: reports are dropped
	stage string
	unit  string
	last  time.Time
}

func newReporter(fn func(Progress)) *reporter { return &reporter{fn: fn} }

// start begins a stage with a message line.
func (r *reporter) start(stage, unit string, total int64, format string, args ...any) {
	if r == nil || r.fn == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.stage, r.unit, r.last = stage, unit, time.Now()
	r.fn(Progress{Stage: stage, Total: total, Unit: unit, Message: fmt.Sprintf(format, args...)})
}

// note sends a line without changing the stage (a warning, say).
func (r *reporter) note(format string, args ...any) {
	if r == nil || r.fn == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.fn(Progress{Stage: r.stage, Unit: r.unit, Message: fmt.Sprintf(format, args...)})
}

// update reports how far the current stage is; calls closer together than
// progressInterval are dropped, except the one that completes the stage.
func (r *reporter) update(done, total int64) {
	if r == nil || r.fn == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	now := time.Now()
	if now.Sub(r.last) < progressInterval && (total == 0 || done < total) {
		return
	}
	r.last = now
	r.fn(Progress{Stage: r.stage, Done: done, Total: total, Unit: r.unit})
}

// countingReader counts the bytes read through it and reports them.
type countingReader struct {
	r     io.Reader
	n     int64
	total int64
	rep   *reporter
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	if n > 0 { // not again at EOF
		c.n += int64(n)
		c.rep.update(c.n, c.total)
	}
	return n, err
}

// procReadBytes returns how many bytes process pid has read so far ("rchar"
// of /proc/PID/io): for mkfs.erofs, how far it is through the tree's files.
func procReadBytes(pid int) (int64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/io")
	if err != nil {
		return 0, err
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if v, ok := bytes.CutPrefix(sc.Bytes(), []byte("rchar: ")); ok {
			return strconv.ParseInt(string(v), 10, 64)
		}
	}
	return 0, fmt.Errorf("no rchar in /proc/%d/io", pid)
}

// humanSize is n bytes for a progress line: "512 B", "3.5 KiB", "1.2 GiB".
func humanSize(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	v, i := float64(n)/unit, 0
	for v >= unit && i < 3 {
		v /= unit
		i++
	}
	return fmt.Sprintf("%.1f %ciB", v, "KMGT"[i])
}

package main

import (
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
)

// progressBar prints the progress a layer build streams: on a terminal,
// each stage's line and below it a bar redrawn in place; elsewhere (a log,
// a pipe) the lines, plus one line per quarter of a stage with a known size.
type progressBar struct {
	w       *os.File
	tty     bool
	drawn   bool // a bar is on the terminal's last line
	quarter int  // last quarter printed (not a terminal)
}

func newProgressBar(w *os.File) *progressBar {
	_, err := unix.IoctlGetTermios(int(w.Fd()), unix.TCGETS)
	return &progressBar{w: w, tty: err == nil}
}

// update is a shoal.LayerProgress.
func (p *progressBar) update(line string, st *pb.BuildProgress) {
	if line != "" {
		p.clear()
		fmt.Fprintln(p.w, line)
		p.quarter = 0
		return
	}
	if st == nil {
		return
	}
	if !p.tty {
		if st.Total > 0 {
			if q := int(4 * st.Done / st.Total); q > p.quarter && q < 4 {
				p.quarter = q
				fmt.Fprintf(p.w, "  %s %d%% (%s)\n", st.Stage, q*25, amount(st.Done, st.Total, st.Unit))
			}
		}
		return
	}
	width := 80
	if ws, err := unix.IoctlGetWinsize(int(p.w.Fd()), unix.TIOCGWINSZ); err == nil && ws.Col > 0 {
		width = int(ws.Col)
	}
	var s string
	if st.Total > 0 {
		frac := min(float64(st.Done)/float64(st.Total), 1)
		tail := fmt.Sprintf(" %3.0f%% %s", 100*frac, amount(st.Done, st.Total, st.Unit))
		head := fmt.Sprintf("  %-7s ", st.Stage)
		barw := min(max(width-len(head)-len(tail)-3, 10), 50)
		fill := int(frac * float64(barw))
		bar := strings.Repeat("=", fill)
		if fill < barw {
			bar += ">" + strings.Repeat(" ", barw-fill-1)
		}
		s = head + "[" + bar + "]" + tail
	} else {
		s = fmt.Sprintf("  %-7s %s", st.Stage, amount(st.Done, 0, st.Unit))
	}
	if len(s) >= width {
		s = s[:width-1]
	}
	fmt.Fprint(p.w, "\r\033[K"+s)
	p.drawn = true
}

// clear removes the bar from the terminal.
func (p *progressBar) clear() {
	if p.drawn {
		fmt.Fprint(p.w, "\r\033[K")
		p.drawn = false
	}
}

func amount(done, total int64, unit string) string {
	if unit == "bytes" {
		if total > 0 {
			return fmt.Sprintf("%s / %s", humanBytes(done), humanBytes(total))
		}
		return humanBytes(done)
	}
	if total > 0 {
		return fmt.Sprintf("%d / %d %s", done, total, unit)
	}
	return fmt.Sprintf("%d %s", done, unit)
}

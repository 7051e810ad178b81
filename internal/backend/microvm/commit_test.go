package microvm

import (
	"archive/tar"
	"context"
	"io"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// checkExport: the backend gives a VM's writable layer as the stream its
// guest's agent sends (for a commit): a file deleted from the base layer is
// a whiteout, a directory removed and made again is opaque, what was
// written is there; and the guest's processes stand still while the
// stream is open, and go on once it is closed: frozen in their cgroup,
// where the guest has one (a microVM's: no SIGSTOP or SIGCONT reaches
// them), else stopped with signals (a full system's).
func checkExport(t *testing.T, ctx context.Context, b *Backend, c *agent.Client, h sandbox.Handle) {
	t.Helper()
	// /work/big: more than the channel's window, so that the agent is
	// still sending while the test looks at the guest's writer.
	if _, err := c.WriteFile(ctx, "/work/exported.txt", 0o640, strings.NewReader("through the files API")); err != nil {
		t.Fatal(err)
	}
	run(t, ctx, c, "sh", "-c", "rm /etc/base-file && rm -rf /tmp && mkdir /tmp && echo new > /tmp/fresh && dd if=/dev/zero of=/work/big bs=1M count=4 2>/dev/null")
	frozen := strings.HasSuffix(strings.TrimSpace(run(t, ctx, c, "cat", "/proc/self/cgroup")), "/cmds")
	// A writer that runs until the end of the VM, and notes a SIGCONT.
	p, err := c.Exec(ctx, agent.ExecRequest{Args: []string{"sh", "-c", "trap 'echo cont >> /work/sigcont' CONT; while :; do echo x >> /work/counter; sleep 0.01; done"}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	// 0 until the writer has made its file. Through the files API, which
	// the agent serves itself: a command started during the export would
	// start only after it (born frozen).
	size := func() int64 {
		fi, err := c.Stat(ctx, "/work/counter")
		if err != nil {
			return 0
		}
		return fi.Size
	}
	waitGrow := func(what string) {
		t.Helper()
		first := size()
		deadline := time.Now().Add(30 * time.Second) // a hang detector
		for size() == first {
			if time.Now().After(deadline) {
				t.Fatalf("the guest's writer does not run %s", what)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	waitGrow("before the export")

	wl, err := b.WritableLayer(h)
	if err != nil || wl.Export == nil || wl.Dir != "" {
		t.Fatalf("writable layer %+v, %v: want an export", wl, err)
	}
	rc, err := wl.Export(ctx, 256)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	tr := tar.NewReader(rc)
	if _, err := tr.Next(); err != nil {
		t.Fatal(err)
	}
	// The agent is sending: the writer stands.
	s1 := size()
	time.Sleep(300 * time.Millisecond)
	if s2 := size(); s2 != s1 {
		t.Errorf("the guest's writer ran during the export: %d then %d bytes", s1, s2)
	}
	entries := map[string]*tar.Header{".": {Typeflag: tar.TypeDir}}
	var fresh, work string
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		entries[hdr.Name] = hdr
		if hdr.Name == "tmp/fresh" || hdr.Name == "work/exported.txt" {
			b, _ := io.ReadAll(tr)
			if hdr.Name == "tmp/fresh" {
				fresh = string(b)
			} else {
				work = string(b)
			}
		}
	}
	if e := entries["work/big"]; e == nil || e.Size != 4<<20 {
		t.Errorf("work/big: %+v", e)
	}
	if _, err := io.Copy(io.Discard, rc); err != nil {
		t.Errorf("the end of the stream: %v", err)
	}
	rc.Close()
	waitGrow("after the export")
	_, err = c.Stat(ctx, "/work/sigcont")
	if signalled := err == nil; signalled == frozen {
		t.Errorf("the guest's commands frozen in their group: %v; the writer saw a SIGCONT: %v", frozen, signalled)
	}

	if e := entries["etc/base-file"]; e == nil || e.Typeflag != tar.TypeChar || e.Devmajor != 0 || e.Devminor != 0 {
		t.Errorf("the deleted base file is not a whiteout: %+v", e)
	}
	if e := entries["tmp"]; e == nil || e.PAXRecords["SCHILY.xattr.trusted.overlay.opaque"] != "y" {
		t.Errorf("the remade /tmp is not opaque: %+v", e)
	}
	if fresh != "new\n" || work != "through the files API" {
		t.Errorf("contents: /tmp/fresh %q, /work/exported.txt %q", fresh, work)
	}
	if e := entries["work/exported.txt"]; e == nil || e.Mode != 0o640 {
		t.Errorf("work/exported.txt: %+v", e)
	}
}

// measureExport (with SHOAL_VM_EXPORT_MB=N): how long the export of a
// writable layer holding an N MiB file takes, end to end (the guest's walk
// and read, the channel, the host reading it).
func measureExport(t *testing.T, ctx context.Context, b *Backend, c *agent.Client, h sandbox.Handle) {
	mb, _ := strconv.Atoi(os.Getenv("SHOAL_VM_EXPORT_MB"))
	if mb <= 0 {
		return
	}
	run(t, ctx, c, "sh", "-c", "dd if=/dev/urandom of=/work/measure bs=1M count="+strconv.Itoa(mb)+" 2>/dev/null")
	wl, _ := b.WritableLayer(h)
	for i := 0; i < 3; i++ {
		start := time.Now()
		rc, err := wl.Export(ctx, 256)
		if err != nil {
			t.Fatal(err)
		}
		n, err := io.Copy(io.Discard, rc)
		rc.Close()
		if err != nil {
			t.Fatal(err)
		}
		d := time.Since(start)
		t.Logf("export of %d bytes: %s (%.1f MiB/s)", n, d, float64(n)/(1<<20)/d.Seconds())
	}
	run(t, ctx, c, "rm", "/work/measure")
}

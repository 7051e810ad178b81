package agent

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// pooledServer serves a pooled server (as after StartBoot with
// SHOAL_POOL=1) on a fresh socket. Its exit hook records the exit code
// instead of exiting.
func pooledServer(t *testing.T) (*Client, <-chan int) {
	t.Helper()
	srv := NewServer(Config{})
	allow := []unix.SockFilter{{Code: unix.BPF_RET | unix.BPF_K, K: 0x7fff0000}}
	if err := srv.AcceptClaims(&Boot{pooled: true, seccomp: allow}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { claimStates.Delete(srv) })
	// The agent answers a failed claim first and exits after, so tests wait
	// for the exit rather than read it right after Claim returns.
	exited := make(chan int, 1)
	v, _ := claimStates.Load(srv)
	v.(*claimState).exit = func(code int) { exited <- code }
	return serveOn(t, srv), exited
}

// waitExit waits (with a deadline) for the agent to exit with want.
func waitExit(t *testing.T, exited <-chan int, want int) {
	t.Helper()
	select {
	case got := <-exited:
		if got != want {
			t.Errorf("exit code %d, want %d", got, want)
		}
	case <-time.After(10 * time.Second):
		t.Errorf("the agent did not exit within 10s (want exit code %d)", want)
	}
}

func TestPooledServesOnlyPingAndClaim(t *testing.T) {
	c, _ := pooledServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := c.Ping(ctx); err != nil {
		t.Fatalf("ping: %v", err)
	}
	_, err := c.Exec(ctx, ExecRequest{Args: []string{"true"}})
	var ae *Error
	if !errors.As(err, &ae) || ae.Code != CodeUnsupported || !strings.Contains(ae.Msg, "not been claimed") {
		t.Errorf("exec before the claim: %v", err)
	}
	if _, err := c.Stat(ctx, "/"); err == nil {
		t.Error("stat before the claim succeeded")
	}
	if _, _, err := c.ReadFile(ctx, "/etc/hostname"); err == nil {
		t.Error("read before the claim succeeded")
	}
}

// TestClaimWithoutMountExits: a claim whose descriptor is not a mount fails
// at the first step; the agent answers and exits (it would not serve a
// half-claimed sandbox), and nothing was claimed.
func TestClaimWithoutMountExits(t *testing.T) {
	c, exited := pooledServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	_, err = c.Claim(ctx, int(f.Fd()), ClaimRequest{Hostname: "x", Env: []string{"A=1"}})
	if err == nil || !strings.Contains(err.Error(), "attach root") {
		t.Fatalf("claim with /dev/null: %v", err)
	}
	waitExit(t, exited, 1)
	if _, err := c.Exec(ctx, ExecRequest{Args: []string{"true"}}); err == nil {
		t.Error("exec after a failed claim succeeded")
	}
}

// TestClaimBadEnv: the request is checked before the root moves (a root
// switch would fail the test process here); the agent still exits.
func TestClaimBadEnv(t *testing.T) {
	c, exited := pooledServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	f, _ := os.Open(os.DevNull)
	defer f.Close()
	_, err := c.Claim(ctx, int(f.Fd()), ClaimRequest{Env: []string{"NOEQUALS"}})
	if err == nil || !strings.Contains(err.Error(), "environment") {
		t.Fatalf("claim with a bad env: %v", err)
	}
	waitExit(t, exited, 1)
}

func TestClaimRefusedByColdAgent(t *testing.T) {
	c := startAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	f, _ := os.Open(os.DevNull)
	defer f.Close()
	_, err := c.Claim(ctx, int(f.Fd()), ClaimRequest{})
	var ae *Error
	if !errors.As(err, &ae) || ae.Code != CodeUnsupported {
		t.Errorf("claim of a cold agent: %v", err)
	}
	// It still serves.
	if _, err := c.Stat(ctx, "/"); err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("stat after a refused claim: %v", err)
	}
}

func TestDecodeFilter(t *testing.T) {
	if _, err := decodeFilter(make([]byte, 7)); err == nil {
		t.Error("7 bytes accepted")
	}
	if _, err := decodeFilter(nil); err == nil {
		t.Error("empty filter accepted")
	}
	p, err := decodeFilter([]byte{6, 0, 1, 2, 0, 0, 0xff, 0x7f})
	if err != nil || len(p) != 1 || p[0].Code != 6 || p[0].Jt != 1 || p[0].Jf != 2 || p[0].K != 0x7fff0000 {
		t.Errorf("decode: %+v %v", p, err)
	}
}

// TestLifeline: an unclaimed pooled agent exits when the node's end of the
// lifeline closes.
func TestLifeline(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	srv := NewServer(Config{})
	allow := []unix.SockFilter{{Code: unix.BPF_RET | unix.BPF_K, K: 0x7fff0000}}
	exited := make(chan int, 1)
	st, err := newClaimState(allow, r, func(code int) { exited <- code })
	if err != nil {
		t.Fatal(err)
	}
	claimStates.Store(srv, st)
	t.Cleanup(func() { claimStates.Delete(srv) })
	go srv.watchLifeline(st)
	select {
	case code := <-exited:
		t.Fatalf("exited (%d) while the node lives", code)
	case <-time.After(100 * time.Millisecond):
	}
	w.Close() // the node dies
	select {
	case code := <-exited:
		if code != 0 {
			t.Errorf("exit code %d", code)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("did not exit after the lifeline closed")
	}
}

// TestLifelineClaimWithBlockingPipe: the lifeline's open file description
// is shared with the node, whose start of each new pool container makes it
// blocking. A claim must still end the watch at once, and the agent must
// not exit. (The watch used to read the pipe, and the claim to close it:
// with the description blocking, the read sat in the kernel and the close
// waited for it forever; the claim was never answered.)
func TestLifelineClaimWithBlockingPipe(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	exited := make(chan int, 1)
	st, err := newClaimState(nil, r, func(code int) { exited <- code })
	if err != nil {
		t.Fatal(err)
	}
	srv := NewServer(Config{})
	done := make(chan struct{})
	go func() {
		srv.watchLifeline(st)
		close(done)
	}()
	// What the node's os/exec does to the shared description (File.Fd).
	w.Fd()
	if err := unix.SetNonblock(int(r.Fd()), false); err != nil {
		t.Fatal(err)
	}
	// The claim, as becomeSandbox ends it.
	st.mu.Lock()
	st.claimed.Store(true)
	st.stopWatch()
	st.mu.Unlock()
	select {
	case <-done:
	case code := <-exited:
		t.Fatalf("a claimed agent exited (%d)", code)
	case <-time.After(10 * time.Second):
		t.Fatal("the lifeline watch did not end within 10s of the claim")
	}
	// The node dying later does not matter any more.
	w.Close()
	select {
	case code := <-exited:
		t.Fatalf("a claimed agent exited (%d) when the node died", code)
	default:
	}
}

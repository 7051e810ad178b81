package vminit

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/yamux"
	"golang.org/x/sys/unix"
)

// linkPair starts a guest portListener on one end of a socket pair (the
// port) and, on the other, a relay that stands for QEMU's socket chardev:
// one host connection at a time is joined to the port, bytes the guest
// writes while none is are dropped, and the port outlives the host's
// connections. It returns the socket the host dials.
func linkPair(t *testing.T) string {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	guest := os.NewFile(uintptr(fds[0]), "port")
	port := os.NewFile(uintptr(fds[1]), "chardev")
	l := &portListener{path: "test", conns: make(chan net.Conn), done: make(chan struct{}), port: guest}
	go l.serve(&eofWait{r: guest, done: l.done})
	// The agent's server: each stream echoes one line.
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				line, err := r.ReadString('\n')
				if err == nil {
					io.WriteString(c, "echo "+line)
				}
				if line == "half\n" {
					// Ends its own direction (as the agent passes on a
					// TCP half-close) and reads on.
					hc, ok := c.(interface{ CloseWrite() error })
					if !ok {
						halfGot <- "no CloseWrite"
						return
					}
					hc.CloseWrite()
					rest, _ := io.ReadAll(r)
					halfGot <- string(rest)
				}
			}()
		}
	}()
	sock := filepath.Join(t.TempDir(), "agent.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var cur net.Conn
	go func() {
		buf := make([]byte, 32<<10)
		for {
			n, err := port.Read(buf)
			if err != nil {
				return
			}
			mu.Lock()
			if cur != nil {
				cur.Write(buf[:n])
			}
			mu.Unlock()
		}
	}()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			cur = c
			mu.Unlock()
			io.Copy(port, c)
			mu.Lock()
			cur = nil
			mu.Unlock()
			c.Close()
		}
	}()
	t.Cleanup(func() { l.Close(); ln.Close(); port.Close(); guest.Close() })
	return sock
}

// halfGot receives what a "half" stream of linkPair's guest read after
// it ended its own direction.
var halfGot = make(chan string, 1)

// A stream's directions end on their own: the guest ends its direction
// (the host reads its end) and still reads what the host sends after;
// then the host ends its own.
func TestLinkHalfClose(t *testing.T) {
	sock := linkPair(t)
	c := host(t, sock)
	defer c.Close()
	s := hostSession(t, c)
	st, err := s.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	st.SetDeadline(time.Now().Add(20 * time.Second))
	io.WriteString(st, "half\n")
	got, err := io.ReadAll(st)
	if err != nil || string(got) != "echo half\n" {
		t.Fatalf("the guest's direction: %q, %v", got, err)
	}
	io.WriteString(st, "after the guest's end\n")
	st.Close()
	select {
	case rest := <-halfGot:
		if rest != "after the guest's end\n" {
			t.Fatalf("the guest read %q after ending its direction", rest)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the guest's read did not end")
	}
}

// host dials the channel; the previous host's connection must be gone
// (the chardev takes one at a time).
func host(t *testing.T, sock string) net.Conn {
	t.Helper()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// hostSession is one host's session on the channel.
func hostSession(t *testing.T, c net.Conn) *yamux.Session {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	lc, err := DialLink(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	s, err := yamux.Client(lc, MuxConfig())
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func echo(t *testing.T, s *yamux.Session, msg string) {
	t.Helper()
	st, err := s.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	st.SetDeadline(time.Now().Add(20 * time.Second))
	io.WriteString(st, msg+"\n")
	got, err := bufio.NewReader(st).ReadString('\n')
	if err != nil || got != "echo "+msg+"\n" {
		t.Fatalf("echo %q: %q, %v", msg, got, err)
	}
}

// Hosts that go away without the guest being told (their streams still
// open, bytes of them in flight both ways), one that wrote frames before
// any handshake, one that died in the middle of a frame and one that
// wrote garbage: each next host's session works from its first stream
// (whose number the old sessions also used).
func TestLinkNewHostSessions(t *testing.T) {
	sock := linkPair(t)
	gone := func(c net.Conn) {
		c.Close()
		time.Sleep(20 * time.Millisecond) // the chardev notices
	}

	// Frames of a host that never synced: no session takes them.
	c := host(t, sock)
	stale := make([]byte, yamuxHeader+3)
	stale[1] = yamuxData
	stale[11] = 3
	c.Write(stale)
	gone(c)

	c = host(t, sock)
	s1 := hostSession(t, c)
	echo(t, s1, "one")
	left, err := s1.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	io.WriteString(left, "half a req")
	unread, _ := s1.OpenStream()
	io.WriteString(unread, "never read\n")
	time.Sleep(20 * time.Millisecond) // the session's writer sends them
	gone(c)

	c = host(t, sock)
	s2 := hostSession(t, c)
	echo(t, s2, "two")
	echo(t, s2, "three")
	// Dies in the middle of a frame: a data frame's header announcing 256
	// bytes, and 100 of them.
	partial := make([]byte, yamuxHeader+100)
	partial[1] = yamuxData
	partial[10] = 1
	c.Write(partial)
	gone(c)

	c = host(t, sock)
	echo(t, hostSession(t, c), "four")
	c.Write([]byte{7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7})
	gone(c)

	c = host(t, sock)
	echo(t, hostSession(t, c), "five")
	gone(c)
}

// The host's side of the handshake waits no longer than its context when
// no guest answers (a VM still booting).
func TestDialLinkBounded(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	go io.Copy(io.Discard, b)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := DialLink(ctx, a); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("DialLink with no guest: %v", err)
	}
}

// The guest's answer is found after any number of stale bytes (output of
// an old session), wherever it falls in the host's scanning window.
func TestDialLinkFindsAnswer(t *testing.T) {
	for stale := 0; stale < 4*recordLen; stale++ {
		a, b := net.Pipe()
		go func() {
			rec := make([]byte, recordLen)
			if _, err := io.ReadFull(b, rec); err != nil {
				return
			}
			go io.Copy(io.Discard, b) // the repeated records
			out := append(bytes.Repeat([]byte{'S'}, stale), ackMagic[:]...)
			b.Write(append(out, rec[len(syncMagic):]...))
			b.Write([]byte("after"))
		}()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		c, err := DialLink(ctx, a)
		cancel()
		if err != nil {
			t.Fatalf("%d stale bytes: %v", stale, err)
		}
		got := make([]byte, 5)
		if _, err := io.ReadFull(c, got); err != nil || string(got) != "after" {
			t.Fatalf("%d stale bytes: read after the answer %q, %v", stale, got, err)
		}
		a.Close()
		b.Close()
	}
}

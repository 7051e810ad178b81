package e2b

// One port for plain HTTP and TLS. With E2B_SANDBOX_URL the SDK speaks
// plain HTTP; without it, it insists on https://49983-SANDBOXID.DOMAIN. So
// the E2B listener looks at each connection's first byte: a TLS handshake
// record is served with a certificate Shoal signs with its own CA
// (generated at first start in DATA/e2b/tls; clients trust ca.pem, e.g.
// NODE_EXTRA_CA_CERTS=DATA/e2b/tls/ca.pem for Node), anything else as
// plain HTTP.

import (
	"crypto/tls"
	"errors"
	"io"
	"net"
	"path/filepath"
	"sync"
	"time"

	"github.com/shoal-sandbox/shoal/internal/pki"
)

// CAFile is the CA certificate clients trust, relative to the data dir.
const CAFile = "e2b/tls/ca.pem"

// Serve wraps ln to serve both plain HTTP and TLS connections. The TLS
// certificate covers localhost, loopback, the address of ln, and domain (a
// host, possibly with a port) with its wildcard *.domain, which is where
// PORT-SANDBOXID.domain names land. Closing the returned listener closes
// ln.
func Serve(ln net.Listener, dataDir, domain string) (net.Listener, error) {
	hosts := []string{"localhost", "127.0.0.1", "::1"}
	if a, ok := ln.Addr().(*net.TCPAddr); ok && !a.IP.IsUnspecified() && !a.IP.IsLoopback() {
		hosts = append(hosts, a.IP.String())
	}
	if domain != "" {
		d := domain
		if h, _, err := splitHostPort(domain); err == nil {
			d = h
		}
		if net.ParseIP(d) != nil {
			hosts = append(hosts, d)
		} else {
			hosts = append(hosts, d, "*."+d)
		}
	}
	cert, err := pki.LoadOrCreateCert(filepath.Join(dataDir, "e2b", "tls"), "Shoal local CA (E2B endpoint)", "Shoal E2B endpoint", hosts)
	if err != nil {
		return nil, err
	}
	sl := &sniffListener{
		Listener: ln,
		tls:      &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2", "http/1.1"}, MinVersion: tls.VersionTLS12},
		conns:    make(chan net.Conn),
		done:     make(chan struct{}),
	}
	go sl.acceptLoop()
	return sl, nil
}

// sniffListener hands out plain connections and *tls.Conn ones (which
// net/http serves as HTTPS), told apart by their first byte.
type sniffListener struct {
	net.Listener
	tls   *tls.Config
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
	err   error // set before done is closed
}

func (l *sniffListener) acceptLoop() {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				time.Sleep(10 * time.Millisecond)
				continue
			}
			l.once.Do(func() { l.err = err; close(l.done) })
			return
		}
		go l.sniff(c)
	}
}

func (l *sniffListener) sniff(c net.Conn) {
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	var b [1]byte
	if _, err := io.ReadFull(c, b[:]); err != nil {
		c.Close()
		return
	}
	c.SetReadDeadline(time.Time{})
	var out net.Conn = &peekedConn{Conn: c, first: b[:]}
	if b[0] == 0x16 { // TLS handshake record
		out = tls.Server(out, l.tls)
	}
	select {
	case l.conns <- out:
	case <-l.done:
		c.Close()
	}
}

func (l *sniffListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, l.err
	}
}

func (l *sniffListener) Close() error {
	err := l.Listener.Close()
	l.once.Do(func() { l.err = net.ErrClosed; close(l.done) })
	return err
}

// peekedConn gives back the byte read to tell TLS from plain HTTP.
type peekedConn struct {
	net.Conn
	first []byte
}

func (c *peekedConn) Read(p []byte) (int, error) {
	if len(c.first) > 0 {
		n := copy(p, c.first)
		c.first = c.first[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}

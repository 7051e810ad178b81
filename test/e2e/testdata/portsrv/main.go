// Command portsrv is a test server the e2e tests run inside a sandbox to
// check the API's port proxy and tunnel:
//
//	portsrv http ADDR   HTTP: POST /echo (the body back), GET /ws (a
//	                    WebSocket that answers each text message m with
//	                    "echo: m"), any other request: the request as JSON
//	portsrv tcp ADDR    raw TCP: reads until the client's half-close, then
//	                    writes "N:" and the bytes reversed, and closes
package main

import (
	"bufio"
	"crypto/sha1"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
)

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: portsrv http|tcp ADDR")
		os.Exit(2)
	}
	l, err := net.Listen("tcp", os.Args[2])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println("listening", l.Addr())
	switch os.Args[1] {
	case "http":
		mux := http.NewServeMux()
		mux.HandleFunc("/", info)
		mux.HandleFunc("POST /echo", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/octet-stream")
			io.Copy(w, r.Body)
		})
		mux.HandleFunc("GET /ws", websocket)
		err = http.Serve(l, mux)
	case "tcp":
		for {
			c, err := l.Accept()
			if err != nil {
				break
			}
			go func() {
				defer c.Close()
				b, err := io.ReadAll(c)
				if err != nil {
					return
				}
				out := []byte(fmt.Sprintf("%d:", len(b)))
				for i := len(b) - 1; i >= 0; i-- {
					out = append(out, b[i])
				}
				c.Write(out)
			}()
		}
	}
	fmt.Fprintln(os.Stderr, err)
	os.Exit(1)
}

func info(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(map[string]any{
		"method":   r.Method,
		"host":     r.Host,
		"uri":      r.RequestURI,
		"path":     r.URL.Path,
		"query":    r.URL.RawQuery,
		"headers":  r.Header,
		"has_auth": r.Header.Get("Authorization") != "" || r.Header.Get("X-API-Key") != "",
	})
}

// websocket is a minimal RFC 6455 echo server (text frames, unfragmented).
func websocket(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Sec-WebSocket-Key")
	if r.Header.Get("Upgrade") != "websocket" || key == "" {
		http.Error(w, "not a websocket request", http.StatusBadRequest)
		return
	}
	h := sha1.Sum([]byte(key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"))
	c, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		return
	}
	defer c.Close()
	fmt.Fprintf(brw, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: %s\r\n\r\n",
		base64.StdEncoding.EncodeToString(h[:]))
	brw.Flush()
	for {
		op, msg, err := ReadFrame(brw.Reader)
		if err != nil {
			return
		}
		if op == 8 { // close
			WriteFrame(c, 8, nil, false)
			return
		}
		if err := WriteFrame(c, 1, append([]byte("echo: "), msg...), false); err != nil {
			return
		}
	}
}

// ReadFrame reads one WebSocket frame and unmasks its payload.
func ReadFrame(r *bufio.Reader) (op byte, payload []byte, err error) {
	var hdr [2]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return 0, nil, err
	}
	op = hdr[0] & 0x0f
	masked := hdr[1]&0x80 != 0
	n := uint64(hdr[1] & 0x7f)
	switch n {
	case 126:
		var b [2]byte
		if _, err := io.ReadFull(r, b[:]); err != nil {
			return 0, nil, err
		}
		n = uint64(binary.BigEndian.Uint16(b[:]))
	case 127:
		var b [8]byte
		if _, err := io.ReadFull(r, b[:]); err != nil {
			return 0, nil, err
		}
		n = binary.BigEndian.Uint64(b[:])
	}
	var mask [4]byte
	if masked {
		if _, err := io.ReadFull(r, mask[:]); err != nil {
			return 0, nil, err
		}
	}
	payload = make([]byte, n)
	if _, err := io.ReadFull(r, payload); err != nil {
		return 0, nil, err
	}
	if masked {
		for i := range payload {
			payload[i] ^= mask[i%4]
		}
	}
	return op, payload, nil
}

// WriteFrame writes one final frame (masked, as a client must).
func WriteFrame(w io.Writer, op byte, payload []byte, mask bool) error {
	b := []byte{0x80 | op}
	m := byte(0)
	if mask {
		m = 0x80
	}
	switch n := len(payload); {
	case n < 126:
		b = append(b, m|byte(n))
	case n < 1<<16:
		b = append(b, m|126, byte(n>>8), byte(n))
	default:
		b = append(b, m|127)
		b = binary.BigEndian.AppendUint64(b, uint64(n))
	}
	if mask {
		key := [4]byte{0x12, 0x34, 0x56, 0x78}
		b = append(b, key[:]...)
		for i, c := range payload {
			b = append(b, c^key[i%4])
		}
	} else {
		b = append(b, payload...)
	}
	_, err := w.Write(b)
	return err
}

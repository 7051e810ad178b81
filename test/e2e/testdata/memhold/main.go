// Command memhold holds memory and a TCP connection for the pause tests:
// `memhold MIB DIR` fills MIB MiB of anonymous memory with a pseudo-random
// pattern, writes its SHA-256 to DIR/sum0, and opens a TCP connection to
// itself over the loopback. Then, every 20 ms, it writes a tick count to
// DIR/tick; and whenever DIR/go exists, it removes it, hashes the memory
// again, sends a message through the connection and reads it back, and
// writes "SUM MESSAGE" to DIR/out.
package main

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"math/rand"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"time"
)

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: memhold MIB DIR")
		os.Exit(2)
	}
	mib, _ := strconv.Atoi(os.Args[1])
	dir := os.Args[2]
	mem := make([]byte, mib<<20)
	rand.New(rand.NewSource(42)).Read(mem)
	sum := func() string { s := sha256.Sum256(mem); return hex.EncodeToString(s[:]) }
	write := func(name, s string) {
		tmp := filepath.Join(dir, name+".tmp")
		os.WriteFile(tmp, []byte(s), 0o644)
		os.Rename(tmp, filepath.Join(dir, name))
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		io.Copy(c, c) // echo
	}()
	conn, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	rd := bufio.NewReader(conn)
	write("sum0", sum())
	for tick := 0; ; tick++ {
		write("tick", strconv.Itoa(tick))
		if _, err := os.Stat(filepath.Join(dir, "go")); err == nil {
			os.Remove(filepath.Join(dir, "go"))
			msg := "ping-" + strconv.Itoa(tick)
			reply := "no-connection"
			conn.SetDeadline(time.Now().Add(5 * time.Second))
			if _, err := fmt.Fprintln(conn, msg); err == nil {
				if line, err := rd.ReadString('\n'); err == nil && line == msg+"\n" {
					reply = "echoed"
				}
			}
			write("out", sum()+" "+reply)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/spf13/cobra"

	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

func portForwardCmd() *cobra.Command {
	var address string
	cmd := &cobra.Command{
		Use:   "port-forward ID [LOCAL:]REMOTE...",
		Short: "Forward local TCP ports to ports inside a sandbox",
		Long: `Listens on ADDRESS:LOCAL (default 127.0.0.1) and tunnels each connection
through the API to REMOTE on the sandbox's loopback. "8080" forwards 8080 to
8080; ":8080" picks a free local port (printed). Runs until interrupted.

For HTTP, the API also proxies directly: {URL}/v1/sandboxes/ID/ports/PORT/...`,
		Args: cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			id := args[0]
			type mapping struct{ local, remote int }
			var maps []mapping
			for _, a := range args[1:] {
				local, remote, err := parsePortMapping(a)
				if err != nil {
					return err
				}
				maps = append(maps, mapping{local, remote})
			}
			ctx, cancel := cmdContext()
			defer cancel()
			if _, err := c.Get(ctx, id); err != nil {
				return err
			}
			var listeners []net.Listener
			defer func() {
				for _, l := range listeners {
					l.Close()
				}
			}()
			for _, m := range maps {
				l, err := net.Listen("tcp", net.JoinHostPort(address, strconv.Itoa(m.local)))
				if err != nil {
					return err
				}
				listeners = append(listeners, l)
				fmt.Printf("Forwarding %s -> %s:%d\n", l.Addr(), id, m.remote)
			}
			var wg sync.WaitGroup
			for i, l := range listeners {
				wg.Add(1)
				go func() {
					defer wg.Done()
					forwardLoop(ctx, c, l, id, maps[i].remote)
				}()
			}
			<-ctx.Done()
			for _, l := range listeners {
				l.Close()
			}
			wg.Wait()
			return nil
		},
	}
	cmd.Flags().StringVar(&address, "address", "127.0.0.1", "local address to listen on")
	return cmd
}

// parsePortMapping reads "LOCAL:REMOTE", "PORT" (the same both sides) or
// ":REMOTE" (any free local port).
func parsePortMapping(s string) (local, remote int, err error) {
	l, r, ok := strings.Cut(s, ":")
	if !ok {
		r = l
	}
	bad := func() (int, int, error) {
		return 0, 0, fmt.Errorf("port mapping %q must look like LOCAL:REMOTE, PORT or :REMOTE (ports 1-65535)", s)
	}
	remote, err = strconv.Atoi(r)
	if err != nil || remote < 1 || remote > 65535 {
		return bad()
	}
	if l == "" {
		return 0, remote, nil
	}
	local, err = strconv.Atoi(l)
	if err != nil || local < 1 || local > 65535 {
		return bad()
	}
	return local, remote, nil
}

// forwardLoop accepts local connections until l is closed and tunnels each
// to the remote port.
func forwardLoop(ctx context.Context, c *shoal.Client, l net.Listener, id string, remote int) {
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		local, err := l.Accept()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				fmt.Fprintln(os.Stderr, "shoal: port-forward:", err)
			}
			return
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer local.Close()
			up, err := c.DialPort(ctx, id, remote)
			if err != nil {
				fmt.Fprintf(os.Stderr, "shoal: port-forward %s -> %d: %s\n", local.RemoteAddr(), remote, errMessage(err))
				return
			}
			defer up.Close()
			stop := context.AfterFunc(ctx, func() {
				local.Close()
				up.Close()
			})
			defer stop()
			pipeBoth(local, up)
		}()
	}
}

// pipeBoth copies both ways until both directions have ended, passing each
// end of stream on as a half-close; a broken direction closes both.
func pipeBoth(a, b net.Conn) {
	done := make(chan struct{})
	half := func(dst, src net.Conn) {
		if _, err := io.Copy(dst, src); err == nil {
			if cw, ok := dst.(interface{ CloseWrite() error }); ok && cw.CloseWrite() == nil {
				return
			}
		}
		a.Close()
		b.Close()
	}
	go func() {
		defer close(done)
		half(b, a)
	}()
	half(a, b)
	<-done
}

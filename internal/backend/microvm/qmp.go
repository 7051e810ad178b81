package microvm

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// qmp runs one QMP command on the monitor socket of a VM and decodes its
// "return" value into ret (nil: ignored). One connection per call: QEMU's
// monitor serves one client at a time, and the calls are rare (a failed
// boot's console, a clean quit).
func qmp(ctx context.Context, sock, cmd string, args any, ret any) error {
	c, err := dialQMP(ctx, sock)
	if err != nil {
		return err
	}
	defer c.Close()
	return c.run(cmd, args, ret)
}

// qmpConn is a QMP connection for a sequence of commands (a snapshot's:
// an fd passed with getfd is known to the connection that passed it).
type qmpConn struct {
	c   *net.UnixConn
	dec *json.Decoder
}

// dialQMP connects to a VM's monitor socket and negotiates capabilities.
// The connection's deadline is ctx's (5 s without one).
func dialQMP(ctx context.Context, sock string) (*qmpConn, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", sock)
	if err != nil {
		return nil, fmt.Errorf("qmp: %w", err)
	}
	c := &qmpConn{c: nc.(*net.UnixConn), dec: json.NewDecoder(nc)}
	if dl, ok := ctx.Deadline(); ok {
		nc.SetDeadline(dl)
	} else {
		nc.SetDeadline(time.Now().Add(5 * time.Second))
	}
	var greeting map[string]any
	if err := c.dec.Decode(&greeting); err != nil {
		nc.Close()
		return nil, fmt.Errorf("qmp greeting: %w", err)
	}
	if err := c.run("qmp_capabilities", nil, nil); err != nil {
		nc.Close()
		return nil, err
	}
	return c, nil
}

func (c *qmpConn) Close() error { return c.c.Close() }

// run runs a command and decodes its "return" value into ret (nil:
// ignored).
func (c *qmpConn) run(cmd string, args any, ret any) error {
	return c.runFD(cmd, args, nil, ret)
}

// runFD runs a command sent with file f's descriptor (SCM_RIGHTS), as
// getfd wants; f nil sends none.
func (c *qmpConn) runFD(cmd string, args any, f *os.File, ret any) error {
	req := map[string]any{"execute": cmd}
	if args != nil {
		req["arguments"] = args
	}
	msg, err := json.Marshal(req)
	if err != nil {
		return err
	}
	msg = append(msg, '\n')
	var oob []byte
	if f != nil {
		oob = unix.UnixRights(int(f.Fd()))
	}
	n, _, err := c.c.WriteMsgUnix(msg, oob, nil)
	if err == nil && n < len(msg) {
		_, err = c.c.Write(msg[n:])
	}
	if err != nil {
		return fmt.Errorf("qmp %s: %w", cmd, err)
	}
	for {
		var rep struct {
			Return json.RawMessage `json:"return"`
			Error  *struct {
				Class string `json:"class"`
				Desc  string `json:"desc"`
			} `json:"error"`
			Event string `json:"event"`
		}
		if err := c.dec.Decode(&rep); err != nil {
			return fmt.Errorf("qmp %s: %w", cmd, err)
		}
		if rep.Event != "" {
			continue
		}
		if rep.Error != nil {
			return fmt.Errorf("qmp %s: %s: %s", cmd, rep.Error.Class, rep.Error.Desc)
		}
		if ret != nil {
			return json.Unmarshal(rep.Return, ret)
		}
		return nil
	}
}

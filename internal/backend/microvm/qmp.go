package microvm

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"time"
)

// qmp runs one QMP command on the monitor socket of a VM and decodes its
// "return" value into ret (nil: ignored). One connection per call: QEMU's
// monitor serves one client at a time, and the calls are rare (a failed
// boot's console, a clean quit).
func qmp(ctx context.Context, sock, cmd string, args any, ret any) error {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", sock)
	if err != nil {
		return fmt.Errorf("qmp: %w", err)
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	} else {
		c.SetDeadline(time.Now().Add(5 * time.Second))
	}
	r := bufio.NewReader(c)
	dec := json.NewDecoder(r)
	var greeting map[string]any
	if err := dec.Decode(&greeting); err != nil {
		return fmt.Errorf("qmp greeting: %w", err)
	}
	send := func(cmd string, args any) (json.RawMessage, error) {
		req := map[string]any{"execute": cmd}
		if args != nil {
			req["arguments"] = args
		}
		if err := json.NewEncoder(c).Encode(req); err != nil {
			return nil, err
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
			if err := dec.Decode(&rep); err != nil {
				return nil, err
			}
			if rep.Event != "" {
				continue
			}
			if rep.Error != nil {
				return nil, fmt.Errorf("%s: %s", rep.Error.Class, rep.Error.Desc)
			}
			return rep.Return, nil
		}
	}
	if _, err := send("qmp_capabilities", nil); err != nil {
		return fmt.Errorf("qmp_capabilities: %w", err)
	}
	out, err := send(cmd, args)
	if err != nil {
		return fmt.Errorf("qmp %s: %w", cmd, err)
	}
	if ret != nil {
		return json.Unmarshal(out, ret)
	}
	return nil
}

// Command testagent stands in for shoal-agent in the container backend's
// tests: it accepts connections on the listening socket it inherits as fd
// $SHOAL_AGENT_FD and answers each request line with one JSON line.
//
// Requests: "pid", "hostname", "ifaces", "fds", "cgroup", "nofile",
// "status" (/proc/self/status), "write <path> <text>", "exec <shell command>",
// "log <text>" (a line on its log, as shoal-agent logs).
//
// Like shoal-agent it installs the seccomp filter it is given and reports
// on the ready pipe (agent.StartBoot).
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/forkserver"
)

type reply struct {
	Out string `json:"out"`
	Err string `json:"err,omitempty"`
}

func main() {
	forkserver.Serve() // as shoal-agent: the node's fork server when asked
	boot, err := agent.StartBoot()
	if err != nil {
		fmt.Fprintln(os.Stderr, "testagent: boot:", err)
		boot.Ready(err)
		os.Exit(2)
	}
	fd, err := strconv.Atoi(os.Getenv("SHOAL_AGENT_FD"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "testagent: SHOAL_AGENT_FD:", err)
		os.Exit(2)
	}
	ln, err := net.FileListener(os.NewFile(uintptr(fd), "agent.sock"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "testagent:", err)
		os.Exit(2)
	}
	boot.Ready(nil)
	for {
		c, err := ln.Accept()
		if err != nil {
			fmt.Fprintln(os.Stderr, "testagent:", err)
			os.Exit(1)
		}
		go serve(c)
	}
}

func serve(c net.Conn) {
	defer c.Close()
	sc := bufio.NewScanner(c)
	enc := json.NewEncoder(c)
	for sc.Scan() {
		out, err := handle(sc.Text())
		r := reply{Out: out}
		if err != nil {
			r.Err = err.Error()
		}
		if enc.Encode(r) != nil {
			return
		}
	}
}

func handle(line string) (string, error) {
	cmd, arg, _ := strings.Cut(line, " ")
	switch cmd {
	case "pid":
		return strconv.Itoa(os.Getpid()), nil
	case "hostname":
		return os.Hostname()
	case "ifaces":
		data, err := os.ReadFile("/proc/net/dev")
		if err != nil {
			return "", err
		}
		var names []string
		for _, l := range strings.Split(string(data), "\n") {
			if name, _, ok := strings.Cut(l, ":"); ok {
				names = append(names, strings.TrimSpace(name))
			}
		}
		return strings.Join(names, ","), nil
	case "fds":
		ents, err := os.ReadDir("/proc/self/fd")
		if err != nil {
			return "", err
		}
		var fds []string
		for _, e := range ents {
			target, _ := os.Readlink("/proc/self/fd/" + e.Name())
			fds = append(fds, e.Name()+"="+target)
		}
		return strings.Join(fds, ","), nil
	case "cgroup":
		data, err := os.ReadFile("/proc/self/cgroup")
		return strings.TrimSpace(string(data)), err
	case "status":
		data, err := os.ReadFile("/proc/self/status")
		return string(data), err
	case "nofile":
		var rl syscall.Rlimit
		err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl)
		return fmt.Sprintf("%d %d", rl.Cur, rl.Max), err
	case "write":
		path, text, _ := strings.Cut(arg, " ")
		return "ok", os.WriteFile(path, []byte(text), 0o644)
	case "log":
		agent.StderrLogger{}.Warn(arg)
		return "ok", nil
	case "exec":
		out, err := exec.Command("/bin/sh", "-c", arg).CombinedOutput()
		return string(out), err
	}
	return "", fmt.Errorf("unknown request %q", cmd)
}

package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"syscall"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

func execCmd() *cobra.Command {
	var (
		cwd        string
		envVars    []string
		stdin, tty bool
		detach     bool
		timeout    time.Duration
		trajectory string
		step       int64
		user       string
		imageCmd   bool
	)
	cmd := &cobra.Command{
		Use:   "exec [--cwd DIR] [--env K=V]... [--user U] [-i] [-t] [-d] ID -- CMD [ARG...] | exec --image-cmd ID [-- ARG...]",
		Short: "Run a command in a sandbox, streaming its output; exits with its exit code",
		Long: `Run a command in a sandbox. Its output streams to this terminal and shoal
exits with the command's exit code. The command is a server-side object: if
this client dies, the command goes on; "shoal attach" re-attaches to it.
-d prints the command ID and returns at once. -it gives an interactive
terminal (like docker exec -it). --trajectory/--step record the command as a
trajectory step: re-running a recorded step replays its result instead.
--image-cmd runs the command of the OCI image the sandbox was made from:
its ENTRYPOINT then its CMD, or the ARGs given instead of its CMD (as
docker run does).`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			env, err := keyValues(envVars, "--env")
			if err != nil {
				return err
			}
			argv := args[1:]
			if len(argv) > 0 && argv[0] == "--" { // flags stop at the ID, so "--" arrives as an argument
				argv = argv[1:]
			}
			ctx, cancel := cmdContext()
			defer cancel()
			if imageCmd {
				if argv, err = imageCommand(ctx, c, args[0], argv); err != nil {
					return err
				}
			}
			if len(argv) == 0 {
				return errors.New("no command given: shoal exec ID -- CMD [ARG...]")
			}
			req := &pb.ExecRequest{SandboxId: args[0], Args: argv, Env: env, Cwd: cwd, TimeoutMs: timeout.Milliseconds(), TrajectoryId: trajectory, Step: step, User: user}
			if detach {
				req.StdinOpen = stdin
				cm, err := c.Start(ctx, req)
				if err != nil {
					return err
				}
				fmt.Println(cm.Id)
				return nil
			}
			if tty {
				return interactive(cmd, c, req)
			}
			o := shoal.ExecOptions{Args: argv, Env: env, Cwd: cwd, Stdout: os.Stdout, Stderr: os.Stderr,
				Timeout: timeout, Trajectory: trajectory, Step: step, User: user}
			if stdin {
				o.Stdin = os.Stdin
			}
			st, err := c.Exec(ctx, args[0], o)
			if err != nil {
				return execFailed(err)
			}
			return exitWith(st, timeout)
		},
	}
	f := cmd.Flags()
	f.SetInterspersed(false)
	f.StringVar(&cwd, "cwd", "", "working directory (default: the image's WORKDIR for a sandbox of an image; else /, or the --user's home)")
	f.StringVarP(&user, "user", "u", "", "run as this sandbox user (a name in its /etc/passwd, or a uid; default: the image's USER for a sandbox of an image; else root)")
	f.BoolVar(&imageCmd, "image-cmd", false, "run the image's ENTRYPOINT and CMD (ARGs given replace the CMD)")
	f.StringArrayVar(&envVars, "env", nil, "KEY=VALUE (repeatable)")
	f.BoolVarP(&stdin, "interactive", "i", false, "pass stdin to the command")
	f.BoolVarP(&tty, "tty", "t", false, "run under a terminal (with -i: an interactive shell)")
	f.BoolVarP(&detach, "detach", "d", false, "print the command ID and return at once")
	f.DurationVar(&timeout, "timeout", 0, "kill the command after this long")
	f.StringVar(&trajectory, "trajectory", "", "record as a step of this trajectory")
	f.Int64Var(&step, "step", 0, "the trajectory step number (>= 1)")
	return cmd
}

// imageCommand is the command of the image a sandbox was made from: its
// entrypoint, then args if any, else its cmd.
func imageCommand(ctx context.Context, c *shoal.Client, id string, args []string) ([]string, error) {
	sb, err := c.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	im := sb.Image
	if im == nil {
		return nil, fmt.Errorf("sandbox %s was not made from an OCI image: --image-cmd has no command to run", id)
	}
	if len(args) == 0 {
		args = im.Cmd
	}
	argv := append(slices.Clone(im.Entrypoint), args...)
	if len(argv) == 0 {
		return nil, fmt.Errorf("the image of sandbox %s has neither ENTRYPOINT nor CMD: give the command", id)
	}
	return argv, nil
}

// execFailed gives a command that could not start the exit code a shell
// (and docker exec) would: 127 when its executable does not exist, 126
// when it cannot be executed, after printing the reason.
func execFailed(err error) error {
	code := 0
	switch {
	case errors.Is(err, shoal.ErrCommandNotFound):
		code = 127
	case errors.Is(err, shoal.ErrCommandNotExecutable):
		code = 126
	default:
		return err
	}
	fmt.Fprintln(os.Stderr, "shoal:", errMessage(err))
	return exitCode(code)
}

func exitWith(st shoal.ExitStatus, timeout time.Duration) error {
	if st.TimedOut {
		fmt.Fprintf(os.Stderr, "shoal: command timed out after %s\n", timeout)
	}
	if st.Dropped > 0 {
		fmt.Fprintf(os.Stderr, "shoal: %d bytes of output were dropped past the log cap\n", st.Dropped)
	}
	if st.Code != 0 {
		return exitCode(st.Code)
	}
	return nil
}

// interactive runs req under a pty sized like this terminal, in raw mode,
// forwarding keystrokes and window size changes.
func interactive(cmd *cobra.Command, c *shoal.Client, req *pb.ExecRequest) error {
	fd := int(os.Stdin.Fd())
	rows, cols := 24, 80
	isTTY := term.IsTerminal(fd)
	if isTTY {
		if w, h, err := term.GetSize(fd); err == nil {
			cols, rows = w, h
		}
	}
	req.Pty = &pb.Pty{Rows: uint32(rows), Cols: uint32(cols)}
	req.StdinOpen = true
	ctx, cancel := cmdContext()
	defer cancel()
	cm, err := c.Start(ctx, req)
	if err != nil {
		return execFailed(err)
	}
	if isTTY {
		old, err := term.MakeRaw(fd)
		if err != nil {
			return err
		}
		defer term.Restore(fd, old)
		winch := make(chan os.Signal, 1)
		signal.Notify(winch, syscall.SIGWINCH)
		defer signal.Stop(winch)
		go func() {
			for range winch {
				if w, h, err := term.GetSize(fd); err == nil {
					c.Commands.ResizePty(ctx, connect.NewRequest(&pb.ResizePtyRequest{
						SandboxId: req.SandboxId, CommandId: cm.Id, Size: &pb.Pty{Rows: uint32(h), Cols: uint32(w)},
					}))
				}
			}
		}()
	}
	go func() {
		buf := make([]byte, 32<<10)
		for {
			n, err := os.Stdin.Read(buf)
			if n > 0 {
				if _, err := c.Commands.SendStdin(ctx, connect.NewRequest(&pb.SendStdinRequest{
					SandboxId: req.SandboxId, CommandId: cm.Id, Data: buf[:n],
				})); err != nil {
					return
				}
			}
			if err != nil {
				c.Commands.SendStdin(ctx, connect.NewRequest(&pb.SendStdinRequest{SandboxId: req.SandboxId, CommandId: cm.Id, Close: true}))
				return
			}
		}
	}()
	st, err := c.Attach(ctx, req.SandboxId, cm.Id, 0, os.Stdout, os.Stdout)
	if err != nil {
		return err
	}
	if st.Code != 0 {
		return exitCode(st.Code)
	}
	return nil
}

func attachCmd() *cobra.Command {
	var offset int64
	cmd := &cobra.Command{
		Use:   "attach [--offset N] ID COMMAND-ID",
		Short: "Stream a command's output from a byte offset of its log; exits with its exit code",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			st, err := c.Attach(ctx, args[0], args[1], offset, os.Stdout, os.Stderr)
			if err != nil {
				return err
			}
			return exitWith(st, 0)
		},
	}
	cmd.Flags().Int64Var(&offset, "offset", 0, "log offset to start from (an offset the server sent)")
	return cmd
}

func psCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "ps ID",
		Short: "List a sandbox's commands",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			res, err := c.Commands.ListCommands(ctx, connect.NewRequest(&pb.ListCommandsRequest{SandboxId: args[0]}))
			if err != nil {
				return err
			}
			if asJSON {
				printJSONList(res.Msg.Commands)
				return nil
			}
			tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "COMMAND\tPID\tSTATE\tEXIT\tLOG\tSTARTED\tARGS")
			for _, cm := range res.Msg.Commands {
				exit := ""
				if cm.Exit != nil {
					exit = fmt.Sprint(cm.Exit.Code)
				}
				fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%q\n", cm.Id, cm.Pid, commandState(cm.State), exit,
					humanBytes(cm.LogBytes), cm.StartedAt.AsTime().Local().Format(time.TimeOnly), cm.Args)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func commandState(s pb.CommandState) string {
	switch s {
	case pb.CommandState_COMMAND_STATE_RUNNING:
		return "running"
	case pb.CommandState_COMMAND_STATE_EXITED:
		return "exited"
	case pb.CommandState_COMMAND_STATE_LOST:
		return "lost"
	}
	return "?"
}

func killCmd() *cobra.Command {
	var sig string
	cmd := &cobra.Command{
		Use:   "kill [--signal SIGTERM] ID COMMAND-ID",
		Short: "Send a signal to a command's process group",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			_, err = c.Commands.SignalCommand(ctx, connect.NewRequest(&pb.SignalCommandRequest{SandboxId: args[0], CommandId: args[1], Signal: sig}))
			return err
		},
	}
	cmd.Flags().StringVarP(&sig, "signal", "s", "SIGKILL", "signal name")
	return cmd
}

package main

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
)

func shellCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "shell",
		Short: "Named persistent shell sessions (cwd, env and variables carry over)",
	}
	var (
		cwd, shell, user string
		envVars          []string
	)
	create := &cobra.Command{
		Use:   "create [--cwd DIR] [--env K=V]... [--user U] ID NAME",
		Short: "Start a shell session",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			env, err := keyValues(envVars, "--env")
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			_, err = c.Commands.CreateShell(ctx, connect.NewRequest(&pb.CreateShellRequest{
				SandboxId: args[0], Name: args[1], Cwd: cwd, Env: env, Shell: shell, User: user,
			}))
			return err
		},
	}
	create.Flags().StringVar(&cwd, "cwd", "", "starting directory")
	create.Flags().StringVarP(&user, "user", "u", "", "run the shell as this sandbox user (default root)")
	create.Flags().StringArrayVar(&envVars, "env", nil, "KEY=VALUE (repeatable)")
	create.Flags().StringVar(&shell, "shell", "", "bash or sh (default: bash if the sandbox has it)")

	var timeout time.Duration
	runc := &cobra.Command{
		Use:   "run [--timeout D] ID NAME -- COMMAND-LINE",
		Short: "Run a command line in a shell session; prints its output, exits with its code",
		Args:  cobra.MinimumNArgs(3),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			line := args[2:]
			if line[0] == "--" {
				line = line[1:]
			}
			if len(line) == 0 {
				return errors.New("no command line given")
			}
			ctx, cancel := cmdContext()
			defer cancel()
			res, err := c.Commands.RunInShell(ctx, connect.NewRequest(&pb.RunInShellRequest{
				SandboxId: args[0], Name: args[1], Command: strings.Join(line, " "), TimeoutMs: timeout.Milliseconds(),
			}))
			if err != nil {
				return err
			}
			fmt.Print(res.Msg.Output)
			if res.Msg.TimedOut {
				fmt.Fprintf(os.Stderr, "shoal: interrupted after %s\n", timeout)
			}
			if res.Msg.ExitCode != 0 {
				return exitCode(res.Msg.ExitCode)
			}
			return nil
		},
	}
	runc.Flags().SetInterspersed(false)
	runc.Flags().DurationVar(&timeout, "timeout", 0, "interrupt the command (not the shell) after this long (default 10m)")

	var lsJSON bool
	ls := &cobra.Command{
		Use:   "ls ID",
		Short: "List a sandbox's shell sessions",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			res, err := c.Commands.ListShells(ctx, connect.NewRequest(&pb.ListShellsRequest{SandboxId: args[0]}))
			if err != nil {
				return err
			}
			if lsJSON {
				printJSONList(res.Msg.Shells)
				return nil
			}
			for _, sh := range res.Msg.Shells {
				fmt.Printf("%s\t%s\n", sh.Name, sh.CommandId)
			}
			return nil
		},
	}
	ls.Flags().BoolVar(&lsJSON, "json", false, "print JSON")
	rm := &cobra.Command{
		Use:   "rm ID NAME",
		Short: "End a shell session",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			_, err = c.Commands.DeleteShell(ctx, connect.NewRequest(&pb.DeleteShellRequest{SandboxId: args[0], Name: args[1]}))
			return err
		},
	}
	cmd.AddCommand(create, runc, ls, rm)
	return cmd
}

//go:build client

package main

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"

	"github.com/spf13/cobra"
)

// serverBinary is the whole shoal binary, which the CLI-only build
// executes for the commands that run server code.
const serverBinary = "shoal-server"

// serverCmds stand in for `serve`, `bench`, `vm` and `tls` in the CLI-only build: each
// executes shoal-server (beside this executable, else on $PATH) with the
// same arguments, in this process (exec: same PID, signals and exit code).
func serverCmds() []*cobra.Command {
	proxy := func(use, short string) *cobra.Command {
		return &cobra.Command{
			Use:                use,
			Short:              short,
			DisableFlagParsing: true, // shoal-server parses them
			RunE: func(cmd *cobra.Command, args []string) error {
				path, err := findServer()
				if err != nil {
					return err
				}
				argv := append([]string{"shoal"}, os.Args[1:]...)
				return fmt.Errorf("execute %s: %w", path, syscall.Exec(path, argv, os.Environ()))
			},
		}
	}
	return []*cobra.Command{
		proxy("serve", "Run the API, a node agent and the local layer store (all in one): executes shoal-server"),
		proxy("bench", "Benchmarks (JSON on stdout): executes shoal-server"),
		proxy("vm", "The VM backends' images (shoal vm image build): executes shoal-server"),
		proxy("tls", "Make a private CA and certificates (serve --tls-cert, --cluster-cert): executes shoal-server"),
	}
}

func findServer() (string, error) {
	var cands []string
	if exe, err := os.Executable(); err == nil {
		cands = append(cands, filepath.Join(filepath.Dir(exe), serverBinary))
	}
	if p, err := exec.LookPath(serverBinary); err == nil {
		cands = append(cands, p)
	}
	for _, c := range cands {
		if st, err := os.Stat(c); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
			return c, nil
		}
	}
	return "", errors.New("this shoal is the CLI alone; serve and bench need " + serverBinary +
		" (the whole binary: go build -o shoal-server ./cmd/shoal) beside it or on $PATH; scripts/up installs both")
}

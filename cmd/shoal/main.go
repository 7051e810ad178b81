// Command shoal is Shoal's CLI and server: `shoal serve` runs the API, a node
// agent, the embedded store and the local layer store in one process; every
// other subcommand is a client of that API.
//
// Built as it is, it is the whole thing. Built with `-tags client` it is
// the CLI alone, without the server's packages (which cost a client
// invocation ~5x its start-up time in package initialisation and page
// faults): its `serve` and `bench` execute the whole binary, installed
// beside it as shoal-server (scripts/deps.sh builds both). See server.go
// and server_exec.go.
package main

import (
	"errors"
	"fmt"
	"os"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
)

func main() {
	root := &cobra.Command{
		Use:           "shoal",
		Short:         "Shoal: elastic sandboxes for agentic RL",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.PersistentFlags().String("url", "", "API URL (default $SHOAL_URL or http://127.0.0.1:7480)")
	root.PersistentFlags().String("api-key", "", "API key (default $SHOAL_API_KEY or /var/lib/shoal/admin.key)")
	root.PersistentFlags().String("ca", "", "for an https:// URL: the CA (PEM) that signed the server's certificate (default $SHOAL_CA, else the system's)")
	root.PersistentFlags().String("cert", "", "a client certificate (PEM) to present, with --cert-key (default $SHOAL_CERT)")
	root.PersistentFlags().String("cert-key", "", "the private key of --cert (default $SHOAL_CERT_KEY)")
	root.AddCommand(serverCmds()...)
	root.AddCommand(layerCmd(), envCmd(), createCmd(), execCmd(), attachCmd(), psCmd(), killCmd(), shellCmd(), cpCmd(), lsCmd(), filesCmd(), watchCmd(), portForwardCmd(), inspectCmd(), pauseCmd(), resumeCmd(), resetCmd(), rmCmd(), runCmd(), keyCmd(), tenantCmd(), auditCmd(), whoamiCmd(), topCmd())
	completeSandboxIDs(root) // completion.go
	if err := root.Execute(); err != nil {
		var exit exitCode
		if errors.As(err, &exit) {
			os.Exit(int(exit))
		}
		fmt.Fprintln(os.Stderr, "shoal:", errMessage(err))
		os.Exit(1)
	}
}

// exitCode makes the process exit with a given code without a message
// (used by `shoal exec` to pass on the command's exit code).
type exitCode int

func (e exitCode) Error() string { return fmt.Sprintf("exit code %d", int(e)) }

// errMessage shows API errors as "code: message".
func errMessage(err error) string {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return fmt.Sprintf("%s: %s", ce.Code(), ce.Message())
	}
	return err.Error()
}

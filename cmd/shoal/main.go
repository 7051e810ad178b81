// Command shoal is Shoal's CLI and server: `shoal serve` runs the API, a node
// agent, the embedded store and the local layer store in one process; every
// other subcommand is a client of that API.
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
	root.AddCommand(serveCmd(), layerCmd(), envCmd(), createCmd(), execCmd(), attachCmd(), psCmd(), killCmd(), shellCmd(), cpCmd(), lsCmd(), filesCmd(), watchCmd(), portForwardCmd(), inspectCmd(), pauseCmd(), resumeCmd(), rmCmd(), benchCmd(), runCmd(), keyCmd(), tenantCmd(), auditCmd(), whoamiCmd(), topCmd(), vmCmd())
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

//go:build !client

package main

import "github.com/spf13/cobra"

// serverCmds are the commands that run server code: the whole binary has
// them (server_exec.go stands in for them in the CLI-only build).
func serverCmds() []*cobra.Command {
	return []*cobra.Command{serveCmd(), benchCmd(), vmCmd(), tlsCmd()}
}

package main

import (
	"context"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"
)

// completeSandboxIDs gives the commands whose first argument is a sandbox
// ID ("exec ID ...", "rm ID...") shell completion of the IDs the server
// has (cobra's `shoal completion bash|zsh|fish|powershell` scripts ask
// `shoal __complete`, which runs this).
func completeSandboxIDs(root *cobra.Command) {
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		f := strings.Fields(c.Use)
		if (slices.Contains(f, "ID") || slices.Contains(f, "ID...")) && c.ValidArgsFunction == nil {
			many := slices.Contains(f, "ID...")
			c.ValidArgsFunction = func(cmd *cobra.Command, args []string, toComplete string) ([]string, cobra.ShellCompDirective) {
				if len(args) > 0 && !many {
					return nil, cobra.ShellCompDirectiveDefault
				}
				return sandboxIDs(cmd, toComplete), cobra.ShellCompDirectiveNoFileComp
			}
		}
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(root)
}

func sandboxIDs(cmd *cobra.Command, prefix string) []string {
	c, err := client(cmd)
	if err != nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	sbs, err := c.List(ctx)
	if err != nil {
		return nil
	}
	var out []string
	for _, s := range sbs {
		if strings.HasPrefix(s.Id, prefix) {
			out = append(out, s.Id+"\t"+stateString(s.State))
		}
	}
	return out
}

// Command swapper exchanges pairs of paths (renameat2 RENAME_EXCHANGE: both
// names always exist, their types flip) in a loop, forever:
// `swapper A1 B1 [A2 B2 ...]`. The e2e tests run it in a sandbox to race
// the node's reading of the sandbox's writable layer, as an attacker would.
package main

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

func main() {
	args := os.Args[1:]
	if len(args) == 0 || len(args)%2 != 0 {
		fmt.Fprintln(os.Stderr, "usage: swapper A1 B1 [A2 B2 ...]")
		os.Exit(2)
	}
	for {
		for i := 0; i < len(args); i += 2 {
			if err := unix.Renameat2(unix.AT_FDCWD, args[i], unix.AT_FDCWD, args[i+1], unix.RENAME_EXCHANGE); err != nil {
				fmt.Fprintln(os.Stderr, "swapper:", err)
				os.Exit(1)
			}
		}
	}
}

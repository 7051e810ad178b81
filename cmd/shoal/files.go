package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

func filesCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "files",
		Short: "List files in a sandbox",
	}
	cmd.AddCommand(filesLsCmd())
	return cmd
}

func filesLsCmd() *cobra.Command {
	var (
		depth  int
		user   string
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "ls ID PATH",
		Short: "List a directory in a sandbox (--depth N: N levels, at most 10,000 entries)",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			if depth < 1 {
				return errors.New("--depth must be at least 1")
			}
			ctx, cancel := cmdContext()
			defer cancel()
			ents, err := c.ListDirAs(ctx, args[0], args[1], user, depth)
			if err != nil {
				return err
			}
			if asJSON {
				printJSONList(ents)
				return nil
			}
			tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
			for _, e := range ents {
				name := e.Path
				if depth == 1 {
					name = e.Name
				}
				if e.IsDir {
					name += "/"
				}
				if e.Symlink != "" {
					name += " -> " + e.Symlink
				}
				mode := fs.FileMode(e.Mode)
				switch {
				case e.IsDir:
					mode |= fs.ModeDir
				case e.Symlink != "":
					mode |= fs.ModeSymlink
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\n", mode, e.Owner, e.Group, e.Size, e.ModifiedAt.AsTime().Local().Format(time.DateTime), name)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().IntVar(&depth, "depth", 1, "levels to list (1: the directory's own entries)")
	cmd.Flags().StringVarP(&user, "user", "u", "", "list as this sandbox user (default root)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func watchCmd() *cobra.Command {
	var recursive, asJSON bool
	var user string
	cmd := &cobra.Command{
		Use:   "watch ID PATH",
		Short: "Print changes under a path in a sandbox, one line per event, until interrupted",
		Long: `Prints one line per change: "OP PATH", with OP one of create, write,
remove, rename (printed as "rename OLD -> NEW"), chmod, overflow (events were
lost: re-scan PATH); directories end in "/". The first line, on stderr, says
when the watch is armed. It ends when PATH itself is removed or moved.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			w, err := c.WatchAs(ctx, args[0], args[1], user, recursive)
			if err != nil {
				return err
			}
			defer w.Close()
			fmt.Fprintf(os.Stderr, "watching %s\n", args[1])
			for {
				ev, err := w.Next()
				if errors.Is(err, shoal.ErrWatchEnded) {
					return nil
				}
				if err != nil {
					if ctx.Err() != nil {
						return nil // interrupted
					}
					return err
				}
				if asJSON {
					b, _ := json.Marshal(jsonView(ev.ProtoReflect()))
					fmt.Println(string(b))
				} else {
					fmt.Println(watchLine(ev))
				}
			}
		},
	}
	cmd.Flags().BoolVarP(&recursive, "recursive", "r", false, "watch subdirectories too, including new ones")
	cmd.Flags().StringVarP(&user, "user", "u", "", "watch as this sandbox user (default root)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print each event as a JSON object")
	return cmd
}

func watchLine(ev *pb.WatchDirEvent) string {
	op := strings.ToLower(strings.TrimPrefix(ev.Op.String(), "OP_"))
	suffix := ""
	if ev.IsDir {
		suffix = "/"
	}
	if ev.Op == pb.WatchDirEvent_OP_RENAME && ev.OldPath != "" {
		return op + " " + ev.OldPath + suffix + " -> " + ev.Path + suffix
	}
	return op + " " + ev.Path + suffix
}

package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

func layerCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "layer", Short: "Build, tag, list, commit, export, import and remove layers"}
	cmd.AddCommand(layerBuildCmd(), layerCommitCmd(), layerLsCmd(), layerInspectCmd(), layerTagCmd(),
		layerRmCmd(), layerGCCmd(), layerExportCmd(), layerImportCmd(), layerPushCmd(), layerPullCmd())
	return cmd
}

func parseKindFlag(kind string, allowed ...string) (pb.LayerKind, error) {
	k, ok := map[string]pb.LayerKind{"base": pb.LayerKind_LAYER_KIND_BASE, "workspace": pb.LayerKind_LAYER_KIND_WORKSPACE, "toolkit": pb.LayerKind_LAYER_KIND_TOOLKIT}[kind]
	if !ok || (len(allowed) > 0 && !contains(allowed, kind)) {
		if len(allowed) == 0 {
			allowed = []string{"base", "workspace", "toolkit"}
		}
		return 0, fmt.Errorf("--kind must be %s (got %q)", strings.Join(allowed, " or "), kind)
	}
	return k, nil
}

func contains(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}

func layerBuildCmd() *cobra.Command {
	var compression, kind, image string
	var serverPath, push bool
	var df dockerfileFlags
	cmd := &cobra.Command{
		Use:   "build --kind base|workspace|toolkit NAME:VERSION SRC | build --dockerfile PATH CONTEXT NAME:VERSION",
		Short: "Build an EROFS layer (prints NAME@sha256:...)",
		Long: `Build an EROFS layer from SRC, a path on this machine, which is uploaded:
  a directory (sent as a tar made on the fly: owners, modes, symlinks,
  hard links and xattrs kept; it gives the layer a build from the same
  directory on the server gives); or a file, sent as it is: a tarball of a
  root file system (tar, tar.gz, tar.zst), an OCI image layout as a tar, a
  docker-archive (docker save).
With --server-path, SRC is a path on the server's machine instead, read in
place (a directory, an OCI layout directory, or any of those files); the
server allows that only inside the directories it was started with
--build-root.
The format is detected from the content. Images are flattened with their
whiteouts applied; --image picks one image of an archive that holds several.
Progress goes to stderr (a bar on a terminal); the layer's ref to stdout.

With --dockerfile PATH (inside CONTEXT), builds that Dockerfile with the
directory CONTEXT as its build context (uploaded; its .dockerignore
honoured by the server): RUN in sandboxes of the stack so far (no network
unless --internet/--allow-out), COPY/ADD from the context, each step's
layer cached (a rebuild runs only the steps after a change). The result is
an environment (--env, default NAME) with the image config the Dockerfile
set (ENV, WORKDIR, USER, ENTRYPOINT, CMD), and its top layer tagged
NAME:VERSION. The build log goes to stderr.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			if df.path != "" {
				return runDockerfileBuild(c, args[0], args[1], df)
			}
			k, err := parseKindFlag(kind)
			if err != nil {
				return err
			}
			src, err := absPath(args[1])
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			bar := newProgressBar(os.Stderr)
			req := &pb.BuildLayerRequest{Kind: k, Ref: args[0], Source: src, Compression: compression, Image: image}
			var l *pb.Layer
			if serverPath {
				l, err = c.BuildLayerProgress(ctx, req, bar.update)
			} else {
				l, err = c.BuildLayerFrom(ctx, req, src, bar.update)
			}
			bar.clear()
			if err != nil {
				return err
			}
			fmt.Printf("%s@%s\n", l.Name, l.Digest)
			if push {
				return pushBuilt(ctx, c, l.Name+":"+l.Version)
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&kind, "kind", "", "layer kind: base, workspace or toolkit")
	cmd.Flags().StringVar(&compression, "compression", "", "none (default), plain (uncompressed, every file in whole blocks: DAX for all of it in a microVM's pmem layer; a little bigger), lz4 or lz4hc")
	cmd.Flags().StringVar(&image, "image", "", "for an image archive with several images: which one (e.g. debian:12)")
	cmd.Flags().BoolVar(&push, "push", false, "then push it to the server's layer store (shoal serve --layer-store), so every node of the fleet resolves it")
	cmd.Flags().BoolVar(&serverPath, "server-path", false, "SRC is a path on the server, inside one of its --build-root directories (read in place, not uploaded)")
	df.register(cmd)
	return cmd
}

func layerCommitCmd() *cobra.Command {
	var compression, kind string
	var push bool
	cmd := &cobra.Command{
		Use:   "commit ID --kind workspace|toolkit NAME:VERSION",
		Short: "Turn a sandbox's changes (its writable layer) into a new layer (prints NAME@sha256:...)",
		Long: `Turn what a running sandbox changed (its writable upper layer) into a new
workspace or toolkit layer. Files it deleted become overlay whiteouts and
directories it replaced become opaque, so a sandbox created from the same
layers plus the new one sees what this sandbox saw. The usual way to make a
workspace: create from a base, run the setup commands, commit.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			k, err := parseKindFlag(kind, "workspace", "toolkit")
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			bar := newProgressBar(os.Stderr)
			l, err := c.CommitLayer(ctx, &pb.CommitLayerRequest{SandboxId: args[0], Kind: k, Ref: args[1], Compression: compression}, bar.update)
			bar.clear()
			if err != nil {
				return err
			}
			fmt.Printf("%s@%s\n", l.Name, l.Digest)
			if push {
				return pushBuilt(ctx, c, l.Name+":"+l.Version)
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&kind, "kind", "", "layer kind: workspace or toolkit")
	cmd.Flags().StringVar(&compression, "compression", "", "none (default), plain (uncompressed, every file in whole blocks: DAX for all of it in a microVM's pmem layer; a little bigger), lz4 or lz4hc")
	cmd.Flags().BoolVar(&push, "push", false, "then push it to the server's layer store (shoal serve --layer-store)")
	cmd.MarkFlagRequired("kind")
	return cmd
}

func layerLsCmd() *cobra.Command {
	var asJSON, all bool
	cmd := &cobra.Command{
		Use:   "ls [--all] [--json]",
		Short: "List layers (--all: also untagged images kept for sandboxes or until gc)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			res, err := c.Layers.ListLayers(ctx, connect.NewRequest(&pb.ListLayersRequest{All: all}))
			if err != nil {
				return err
			}
			if asJSON {
				printJSONList(res.Msg.Layers)
				return nil
			}
			tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "REF\tOWNER\tKIND\tDIGEST\tSIZE\tCOMPRESSION\tCREATED")
			for _, l := range res.Msg.Layers {
				ref := l.Ref
				if ref == "" {
					ref = "<none> (" + l.Name + ")"
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", ref, ownerString(l.Tenant), kindString(l.Kind), shortDigest(l.Digest), humanBytes(l.Size),
					l.Compression, l.CreatedAt.AsTime().Local().Format(time.DateTime))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	cmd.Flags().BoolVarP(&all, "all", "a", false, "also list untagged images")
	return cmd
}

// ownerString names the owner of a layer or an environment: its tenant,
// or "shared" (the admin's, read-only to tenants).
func ownerString(tenant string) string {
	if tenant == "" {
		return "shared"
	}
	return tenant
}

func layerInspectCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "inspect REF",
		Short: "Show a layer as JSON: digest, size, source, tags, and the sandboxes and environments using it",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			res, err := c.Layers.GetLayer(ctx, connect.NewRequest(&pb.GetLayerRequest{Ref: args[0]}))
			if err != nil {
				return err
			}
			printJSON(res.Msg)
			return nil
		},
	}
}

func layerPushCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "push REF [STORE]",
		Short: "Copy a layer to the server's layer store (shoal serve --layer-store); STORE, if given, must be that store's URL",
		Long: `Copy a layer of the server to the server's layer store (shoal serve
--layer-store): its image and chunk list unless the store has them, then its
tag. Progress goes to stderr (a bar on a terminal, a line per quarter
elsewhere); the result, as JSON, to stdout. STORE, if given, must be the
server's store URL.`,
		Args: cobra.RangeArgs(1, 2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			req := &pb.PushLayerRequest{Ref: args[0]}
			if len(args) == 2 {
				req.Store = args[1]
			}
			ctx, cancel := cmdContext()
			defer cancel()
			bar := newProgressBar(os.Stderr)
			res, err := c.PushLayer(ctx, req, bar.update)
			bar.clear()
			if err != nil {
				return err
			}
			printJSON(res)
			return nil
		},
	}
}

func layerPullCmd() *cobra.Command {
	var env string
	var image, replace bool
	cmd := &cobra.Command{
		Use:   "pull IMAGE | REF",
		Short: "Pull an image from an OCI registry (or a layer from the server's layer store)",
		Long: `Pull an image from an OCI registry into the server's layers:
[REGISTRY/]REPOSITORY[:TAG|@sha256:DIGEST], Docker Hub's names as docker
reads them (python:3.12 is docker.io/library/python:3.12); an index is
resolved to linux on the server's architecture. Each OCI layer becomes a
layer of its own (oci-base:sha256-<hex> for the bottom one,
oci-layer:sha256-<hex> for the others), fetched only if the server (or its
layer store) does not have it yet. Your login for the image's registry
(~/.docker/config.json and its credential helpers, as docker keeps them)
is forwarded for this pull; the server's own (serve --registry-auth) serves
registries you have no login for. With --env NAME the image is also saved
as an environment (create --template NAME), its Env, WorkingDir and User
the defaults of its sandboxes.

REF: a layer reference (NAME:VERSION, NAME@sha256:..., sha256:...) is first
copied whole from the server's layer store (serve --layer-store), as
before; one the store does not have (or a server without a store) is
pulled as an image. --image skips the layer store.
Progress goes to stderr (a bar on a terminal); the result to stdout (JSON).`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			ref := args[0]
			if !image && env == "" && isLayerRef(ref) {
				res, err := c.Layers.PullLayer(ctx, connect.NewRequest(&pb.PullLayerRequest{Ref: ref}))
				if err == nil {
					printJSON(res.Msg)
					return nil
				}
				if code := connect.CodeOf(err); code != connect.CodeNotFound && code != connect.CodeFailedPrecondition {
					return err
				}
			}
			creds, err := shoal.DockerCredentials(ref)
			if err != nil {
				return fmt.Errorf("read your registry login for %s: %w", ref, err)
			}
			bar := newProgressBar(os.Stderr)
			im, err := c.PullImage(ctx, &pb.PullImageRequest{Image: ref, Credentials: creds, Environment: env, Replace: replace}, bar.update)
			bar.clear()
			if err != nil {
				return err
			}
			printJSON(im)
			return nil
		},
	}
	cmd.Flags().BoolVar(&image, "image", false, "REF is an image: pull it from its registry, not from the layer store")
	cmd.Flags().StringVar(&env, "env", "", "also save the image as an environment of this name")
	cmd.Flags().BoolVar(&replace, "replace", false, "with --env: replace an environment of that name")
	return cmd
}

// pullIfImage pulls base first, with your registry login, when it reads
// only as an image (a registry or a path in it): the server would pull it
// itself, with its own logins only. Other bases are left to the server
// (a layer; or an image it pulls, python:3.12 say).
func pullIfImage(ctx context.Context, c *shoal.Client, base string) error {
	if base == "" || isLayerRef(base) {
		return nil
	}
	creds, err := shoal.DockerCredentials(base)
	if err != nil {
		return fmt.Errorf("read your registry login for %s: %w", base, err)
	}
	bar := newProgressBar(os.Stderr)
	_, err = c.PullImage(ctx, &pb.PullImageRequest{Image: base, Credentials: creds}, bar.update)
	bar.clear()
	return err
}

// isLayerRef says whether ref reads as a layer reference (NAME:VERSION,
// NAME@sha256:..., sha256:...) rather than only as an image (a registry,
// a path, no tag).
func isLayerRef(ref string) bool {
	if strings.HasPrefix(ref, "sha256:") {
		return true
	}
	if strings.Contains(ref, "/") {
		return false
	}
	return strings.ContainsAny(ref, ":@")
}

func layerTagCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "tag SRC NAME:VERSION",
		Short: "Point a tag at the layer SRC names, atomically (moves the tag if it exists)",
		Long: `Point a tag at the layer SRC names, atomically (moves the tag if it exists).
A tenant's key tags in its tenant's namespace (its own NAME:VERSION, whatever
other tenants or the admin have under that name); the admin's tags are shared,
read-only to tenants, and the admin names a tenant's as TENANT/NAME:VERSION
(tagging one as NAME:VERSION publishes it as shared).`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			res, err := c.Layers.TagLayer(ctx, connect.NewRequest(&pb.TagLayerRequest{Source: args[0], Target: args[1]}))
			if err != nil {
				return err
			}
			l := res.Msg.Layer
			if old := res.Msg.PreviousDigest; old != "" && old != l.Digest {
				fmt.Fprintf(os.Stderr, "moved %s from %s\n", args[1], shortDigest(old))
			}
			fmt.Printf("%s@%s\n", l.Name, l.Digest)
			return nil
		},
	}
}

func layerRmCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "rm REF...",
		Short: "Remove tags (and their images when nothing else uses them), or untagged images by digest",
		Long: `Remove layer references. NAME:VERSION removes the tag, and its image too
unless another tag, an environment or a sandbox still uses it (the image then
stays, reachable by digest, until it is unused and 'shoal layer gc' runs).
NAME@sha256:... or sha256:... removes an untagged, unused image. A layer in
use is never removed: that is a failed_precondition error. A tenant's key
removes its own tags only (shared ones are the admin's: permission_denied);
the admin names a tenant's as TENANT/NAME:VERSION.`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			failed := 0
			for _, ref := range args {
				res, err := c.Layers.DeleteLayer(ctx, connect.NewRequest(&pb.DeleteLayerRequest{Ref: ref}))
				if err != nil {
					fmt.Fprintf(os.Stderr, "shoal: rm %s: %s\n", ref, errMessage(err))
					failed++
					continue
				}
				for _, t := range res.Msg.Untagged {
					fmt.Printf("untagged %s\n", t)
				}
				for _, l := range res.Msg.Removed {
					fmt.Printf("deleted %s (%s)\n", l.Digest, humanBytes(l.Size))
				}
			}
			if failed > 0 {
				return exitCode(1)
			}
			return nil
		},
	}
}

func layerGCCmd() *cobra.Command {
	var dryRun, asJSON bool
	cmd := &cobra.Command{
		Use:   "gc [--dry-run] [--json]",
		Short: "Remove every image no tag, environment or sandbox uses and that is not mounted",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			res, err := c.Layers.GarbageCollectLayers(ctx, connect.NewRequest(&pb.GarbageCollectLayersRequest{DryRun: dryRun}))
			if err != nil {
				return err
			}
			if asJSON {
				printJSON(res.Msg)
				return nil
			}
			verb := "deleted"
			if dryRun {
				verb = "would delete"
			}
			for _, l := range res.Msg.Removed {
				what := l.Name
				if l.Version != "" {
					what += " (last built as " + l.Name + ":" + l.Version + ")"
				}
				fmt.Printf("%s %s %s %s\n", verb, l.Digest, humanBytes(l.Size), what)
			}
			fmt.Fprintf(os.Stderr, "%s %d images, %s; kept %d\n", verb, len(res.Msg.Removed), humanBytes(res.Msg.FreedBytes), res.Msg.Kept)
			return nil
		},
	}
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "only report what would be deleted")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func layerExportCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "export REF FILE",
		Short: "Save a layer (EROFS image + metadata, a tar) to FILE (- for stdout)",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			if args[1] == "-" {
				_, err := c.ExportLayer(ctx, args[0], os.Stdout)
				return err
			}
			// Written beside FILE and renamed when complete: a failed
			// export never leaves a truncated FILE.
			f, err := os.CreateTemp(filepath.Dir(args[1]), "."+filepath.Base(args[1])+".*")
			if err != nil {
				return err
			}
			defer os.Remove(f.Name())
			defer f.Close()
			n, err := c.ExportLayer(ctx, args[0], f)
			if err != nil {
				return err
			}
			if err := f.Chmod(0o644); err != nil {
				return err
			}
			if err := f.Close(); err != nil {
				return err
			}
			if err := os.Rename(f.Name(), args[1]); err != nil {
				return err
			}
			fmt.Fprintf(os.Stderr, "exported %s to %s (%s)\n", args[0], args[1], humanBytes(n))
			return nil
		},
	}
}

func layerImportCmd() *cobra.Command {
	var tag string
	var push bool
	cmd := &cobra.Command{
		Use:   "import FILE [--tag NAME:VERSION]",
		Short: "Load a layer saved by 'layer export' (- for stdin); its digest is verified (prints NAME@sha256:...)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			var r io.Reader = os.Stdin
			if args[0] != "-" {
				f, err := os.Open(args[0])
				if err != nil {
					return err
				}
				defer f.Close()
				if fi, err := f.Stat(); err == nil && fi.IsDir() {
					return errors.New(args[0] + " is a directory: give the file written by shoal layer export")
				}
				r = f
			}
			ctx, cancel := cmdContext()
			defer cancel()
			l, err := c.ImportLayer(ctx, r, tag)
			if err != nil {
				return err
			}
			fmt.Printf("%s@%s\n", l.Name, l.Digest)
			if push {
				return pushBuilt(ctx, c, l.Name+":"+l.Version)
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&tag, "tag", "", "tag to import it as, instead of the one recorded in the file")
	cmd.Flags().BoolVar(&push, "push", false, "then push it to the server's layer store (shoal serve --layer-store)")
	return cmd
}

// pushBuilt pushes a layer just built or imported to the server's layer
// store and says so on stderr.
func pushBuilt(ctx context.Context, c *shoal.Client, ref string) error {
	bar := newProgressBar(os.Stderr)
	res, err := c.PushLayer(ctx, &pb.PushLayerRequest{Ref: ref}, bar.update)
	bar.clear()
	if err != nil {
		return fmt.Errorf("built, but not pushed: %w", err)
	}
	_ = res // the stream's last line said where it went and what it sent
	return nil
}

package main

import (
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// dockerfileFlags are layer build's flags for a Dockerfile build.
type dockerfileFlags struct {
	path, env, target   string
	buildArgs, allowOut []string
	noCache, internet   bool
	runTimeout          time.Duration
}

func (d *dockerfileFlags) register(cmd *cobra.Command) {
	f := cmd.Flags()
	f.StringVar(&d.path, "dockerfile", "", "build this Dockerfile (a path inside CONTEXT); the arguments are then CONTEXT NAME:VERSION")
	f.StringVar(&d.env, "env", "", "with --dockerfile: the environment to save the result as (default: NAME)")
	f.StringVar(&d.target, "target", "", "with --dockerfile: the stage to build (default: the last)")
	f.StringArrayVar(&d.buildArgs, "build-arg", nil, "with --dockerfile: NAME=VALUE for an ARG (repeatable)")
	f.BoolVar(&d.noCache, "no-cache", false, "with --dockerfile: run every step, ignoring cached step layers")
	f.BoolVar(&d.internet, "internet", false, "with --dockerfile: RUN steps may reach the public internet (default: no network)")
	f.StringArrayVar(&d.allowOut, "allow-out", nil, "with --dockerfile: CIDR[:PORTS] RUN steps may reach (repeatable)")
	f.DurationVar(&d.runTimeout, "run-timeout", 0, "with --dockerfile: the most one RUN may take (default 30m, at most 6h)")
}

func runDockerfileBuild(c *shoal.Client, contextDir, ref string, d dockerfileFlags) error {
	rel, err := shoal.DockerfileInContext(contextDir, d.path)
	if err != nil {
		return err
	}
	o := shoal.DockerfileOptions{Dockerfile: rel, Environment: d.env, Target: d.target, NoCache: d.noCache,
		RunTimeout: d.runTimeout, BuildArgs: map[string]string{}}
	for _, kv := range d.buildArgs {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			v, ok = os.LookupEnv(k) // docker's --build-arg NAME: from the environment
		}
		if ok {
			o.BuildArgs[k] = v
		}
	}
	if d.internet || len(d.allowOut) > 0 {
		o.Network = &pb.NetworkPolicy{Internet: d.internet, AllowOut: d.allowOut}
	}
	o.Log = func(ev shoal.DockerfileEvent) {
		switch {
		case ev.Step > 0:
			fmt.Fprintf(os.Stderr, "step %d/%d (line %d): %s\n", ev.Step, ev.Steps, ev.Line, ev.Text)
		case ev.Output != "":
			os.Stderr.WriteString(ev.Output)
		case ev.Text != "":
			fmt.Fprintf(os.Stderr, "  %s\n", ev.Text)
		}
	}
	ctx, cancel := cmdContext()
	defer cancel()
	res, err := c.BuildDockerfile(ctx, contextDir, ref, o)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "%d steps run, %d cached\n", res.StepsRun, res.StepsCached)
	fmt.Printf("environment %s: %s@%s\n", res.Environment.Name, res.Layer.Name+":"+res.Layer.Version, res.Layer.Digest)
	return nil
}

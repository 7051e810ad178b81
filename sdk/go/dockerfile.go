package shoal

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/sdk/go/dockerignore"
)

// DockerfileOptions says how to build a Dockerfile (Client.BuildDockerfile).
type DockerfileOptions struct {
	// Dockerfile is its path relative to the context ("": "Dockerfile").
	Dockerfile  string
	Environment string            // the environment saved ("": the result's NAME)
	BuildArgs   map[string]string // ARG values
	Target      string            // the stage to build ("": the last)
	NoCache     bool
	RunTimeout  time.Duration // of each RUN (0: the server's default, 30 minutes)
	// The RUN sandboxes' egress (none by default), as a create's.
	Network *pb.NetworkPolicy
	// Log, if not nil, receives the build's log: each step as it starts,
	// and RUN's output.
	Log func(DockerfileEvent)
}

// DockerfileEvent is a line of a Dockerfile build's log: a step starting
// (Step > 0), a note (Text), or a RUN's output (Output, on Stream).
type DockerfileEvent struct {
	Step   int    `json:"step"`
	Steps  int    `json:"steps"`
	Line   int    `json:"line"`
	Text   string `json:"text"`
	Cached bool   `json:"cached"`
	Stream string `json:"stream"`
	Output string `json:"output"`
}

// DockerfileResult is a built Dockerfile: the environment saved (its
// stack and image config), the top layer tagged NAME:VERSION, and how
// many steps made a layer now or found theirs in the cache.
type DockerfileResult struct {
	Environment *pb.Environment
	Layer       *pb.Layer
	StepsRun    int
	StepsCached int
}

// BuildDockerfile builds the Dockerfile of the directory contextDir (sent
// as a tar) into the environment and layer ref (NAME:VERSION): RUN steps
// in sandboxes, COPY and ADD from the context, each step's layer cached.
func (c *Client) BuildDockerfile(ctx context.Context, contextDir, ref string, o DockerfileOptions) (*DockerfileResult, error) {
	fi, err := os.Stat(contextDir)
	if err != nil {
		return nil, err
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("build context %s is not a directory", contextDir)
	}
	q := url.Values{"ref": {ref}}
	if o.Dockerfile != "" {
		q.Set("dockerfile", filepath.ToSlash(o.Dockerfile))
	}
	if o.Environment != "" {
		q.Set("env", o.Environment)
	}
	if o.Target != "" {
		q.Set("target", o.Target)
	}
	if o.NoCache {
		q.Set("no_cache", "true")
	}
	if o.RunTimeout > 0 {
		q.Set("run_timeout", strconv.FormatFloat(o.RunTimeout.Seconds(), 'f', -1, 64))
	}
	for k, v := range o.BuildArgs {
		q.Add("build_arg", k+"="+v)
	}
	if n := o.Network; n != nil {
		if n.Internet {
			q.Set("internet", "true")
		}
		q["allow_out"], q["deny_out"] = n.AllowOut, n.DenyOut
	}
	skip, err := ignoreFilter(contextDir, o.Dockerfile)
	if err != nil {
		return nil, err
	}
	pr, pw := io.Pipe()
	defer pr.Close()
	go func() { pw.CloseWithError(writeTar(pw, contextDir, skip)) }()
	res, err := c.postTar(ctx, "/v1/layers/dockerfile?"+q.Encode(), pr, -1)
	if err != nil {
		return nil, err
	}
	defer res.Body.Close()
	sc := bufio.NewScanner(res.Body)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if len(bytes.TrimSpace(line)) == 0 {
			continue
		}
		var ev struct {
			Log    *DockerfileEvent `json:"log"`
			Result *struct {
				Layer       json.RawMessage `json:"layer"`
				Environment json.RawMessage `json:"environment"`
				StepsRun    int             `json:"steps_run"`
				StepsCached int             `json:"steps_cached"`
			} `json:"result"`
			Error *struct{ Code, Message string } `json:"error"`
		}
		if err := json.Unmarshal(line, &ev); err != nil {
			return nil, fmt.Errorf("build reply: %w", err)
		}
		switch {
		case ev.Error != nil:
			var code connect.Code
			if code.UnmarshalText([]byte(ev.Error.Code)) != nil {
				code = connect.CodeUnknown
			}
			return nil, connect.NewError(code, errors.New(ev.Error.Message))
		case ev.Log != nil:
			if o.Log != nil {
				o.Log(*ev.Log)
			}
		case ev.Result != nil:
			out := &DockerfileResult{Layer: &pb.Layer{}, Environment: &pb.Environment{}, StepsRun: ev.Result.StepsRun, StepsCached: ev.Result.StepsCached}
			u := protojson.UnmarshalOptions{DiscardUnknown: true}
			if err := u.Unmarshal(ev.Result.Layer, out.Layer); err != nil {
				return nil, fmt.Errorf("build reply: %w", err)
			}
			if err := u.Unmarshal(ev.Result.Environment, out.Environment); err != nil {
				return nil, fmt.Errorf("build reply: %w", err)
			}
			return out, nil
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return nil, errors.New("Dockerfile build reply ended without a result")
}

// DockerfileInContext returns the path of dockerfile relative to
// contextDir, or an error if it is not inside it.
func DockerfileInContext(contextDir, dockerfile string) (string, error) {
	ac, err := filepath.Abs(contextDir)
	if err != nil {
		return "", err
	}
	ad, err := filepath.Abs(dockerfile)
	if err != nil {
		return "", err
	}
	rel, err := filepath.Rel(ac, ad)
	if err != nil || !filepath.IsLocal(rel) || strings.HasPrefix(rel, "..") {
		return "", fmt.Errorf("the Dockerfile %s must be inside the build context %s", dockerfile, contextDir)
	}
	return rel, nil
}

// dockerignore returns what the context's .dockerignore leaves out of the
// upload (the server leaves it out too: this only saves sending it). The
// Dockerfile and the .dockerignore are always sent; directories are
// pruned only when no "!" pattern could take something below them back.
func ignoreFilter(contextDir, dockerfilePath string) (func(string, bool) bool, error) {
	data, err := os.ReadFile(filepath.Join(contextDir, ".dockerignore"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	ig, err := dockerignore.Parse(data)
	if err != nil {
		return nil, err
	}
	if dockerfilePath == "" {
		dockerfilePath = "Dockerfile"
	}
	keep := filepath.ToSlash(filepath.Clean(dockerfilePath))
	return func(name string, isDir bool) bool {
		if name == keep || name == ".dockerignore" || strings.HasPrefix(keep, name+"/") {
			return false
		}
		if isDir && ig.HasExceptions() {
			return false
		}
		return ig.Excluded(name)
	}, nil
}

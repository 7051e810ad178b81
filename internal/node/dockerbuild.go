package node

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/dockerfile"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/netpolicy"
	"github.com/shoal-sandbox/shoal/sdk/go/dockerignore"
)

// StepLayerName names the layers a Dockerfile build makes: one per step
// that changes the file system, tagged dockerfile-step:<cache key>.
const StepLayerName = "dockerfile-step"

// Bounds of a Dockerfile build.
const (
	DefaultRunTimeout = 30 * time.Minute
	MaxRunTimeout     = 6 * time.Hour
	maxBuildArgs      = 64
	maxStages         = 16
	maxStepLog        = 4 << 20 // output of one RUN forwarded to the build log
	maxCopySources    = 4096    // files one COPY may match by wildcard
)

// DockerfileBuild says what to build (see Manager.BuildDockerfile).
type DockerfileBuild struct {
	Dockerfile []byte
	// Context is the directory the build's COPY and ADD read (an
	// unpacked upload: layer.Store.ExtractContext); it is read through an
	// os.Root, never following a symlink out of it. Its .dockerignore, if
	// any, leaves files out.
	Context     string
	Name        string // the result's tag NAME:VERSION, and environment NAME unless Environment says
	Version     string
	Environment string
	BuildArgs   map[string]string
	Target      string             // the stage to build ("": the last)
	Network     *netpolicy.Request // the RUN sandboxes' egress (nil: none)
	Tenant      string             // owns the RUN sandboxes (its quota applies)
	// Owner is whose names the build reads (FROM, an environment, its
	// cached steps) and writes (its steps' layers, the result's tag and
	// environment): a tenant's own namespace, the admin's shared one.
	Owner      layer.Owner
	RunTimeout time.Duration // of each RUN; 0: DefaultRunTimeout
	NoCache    bool
	// Log, if not nil, receives the build's events, from one goroutine
	// at a time.
	Log func(BuildEvent)
}

// BuildEvent is a line of a Dockerfile build's log: a step starting
// (Step > 0), or output of a RUN (Output, with its Stream).
type BuildEvent struct {
	Step   int    `json:"step,omitempty"` // 1-based, over the whole Dockerfile
	Steps  int    `json:"steps,omitempty"`
	Line   int    `json:"line,omitempty"`
	Text   string `json:"text,omitempty"` // the instruction, or a note
	Cached bool   `json:"cached,omitempty"`
	Stream string `json:"stream,omitempty"` // "stdout" or "stderr"
	Output string `json:"output,omitempty"`
}

// DockerfileResult is a built Dockerfile: the environment saved, the
// layer tagged NAME:VERSION (the stack's top), and what ran.
type DockerfileResult struct {
	Environment layer.Env   `json:"environment"`
	Layer       layer.Layer `json:"layer"`
	StepsRun    int         `json:"steps_run"`    // steps that made a layer now
	StepsCached int         `json:"steps_cached"` // steps whose layer was found in the cache
}

// stage is the state of one stage of a build.
type stage struct {
	name  string
	base  string
	ws    []string // top first, as CreateRequest.Workspaces
	cfg   layer.ImageConfig
	shell []string
	args  map[string]string // ARGs declared in the stage, with their values
	key   string
}

func (st *stage) lookup(k string) (string, bool) {
	for i := len(st.cfg.Env) - 1; i >= 0; i-- {
		if n, v, _ := strings.Cut(st.cfg.Env[i], "="); n == k {
			return v, true
		}
	}
	v, ok := st.args[k]
	return v, ok
}

func (st *stage) setEnv(k, v string) {
	st.cfg.Env = slices.DeleteFunc(st.cfg.Env, func(kv string) bool { n, _, _ := strings.Cut(kv, "="); return n == k })
	st.cfg.Env = append(st.cfg.Env, k+"="+v)
}

type dockerBuilder struct {
	m       *Manager
	o       DockerfileBuild
	escape  byte
	ctxRoot *os.Root
	ignore  *dockerignore.Matcher
	stages  []*stage
	run     int
	cached  int
}

// view is the layer store as the build's owner sees it.
func (b *dockerBuilder) view() layer.View { return b.m.layers.As(b.o.Owner) }

// home is the namespace the build's layers are tagged in ("": shared,
// the admin's).
func (b *dockerBuilder) home() string {
	if b.o.Owner.Admin {
		return ""
	}
	return b.o.Owner.Tenant
}

// BuildDockerfile builds a Dockerfile: FROM a layer, an environment, an
// image (pulled if need be) or an earlier stage; RUN in a sandbox of the
// stack so far (with o.Network's egress, none by default), its writable
// layer committed as the step's layer; COPY and ADD (local files only)
// from o.Context or, with --from, from an earlier stage, written into an
// overlay of the stack on the host (through an os.Root: the stack's
// symlinks are never followed out of it) whose upper is committed; ENV,
// ARG, WORKDIR, USER, SHELL, ENTRYPOINT and CMD kept as the result's
// image config. Each step's layer is cached under a key of its parent's,
// the step's text and the digests of the context files it reads, so a
// rebuild runs only the steps after a change. The result is saved as an
// environment (replacing one of that name) and its top layer tagged
// NAME:VERSION. Errors name the Dockerfile's line.
func (m *Manager) BuildDockerfile(ctx context.Context, o DockerfileBuild) (DockerfileResult, error) {
	if !o.Owner.Admin && o.Owner.Tenant == "" {
		return DockerfileResult{}, errdefs.New(errdefs.ErrPermissionDenied, "a key without a tenant cannot own layers: build with a tenant's key or the admin's")
	}
	if o.Environment == "" {
		o.Environment = o.Name
	}
	if err := layer.CheckEnv(layer.Env{Name: o.Environment, Base: "x"}); err != nil {
		return DockerfileResult{}, err
	}
	if _, _, err := layer.ParseTag(o.Name + ":" + o.Version); err != nil {
		return DockerfileResult{}, errdefs.Mark(errdefs.ErrInvalidArgument, fmt.Errorf("build %s:%s: %w", o.Name, o.Version, err))
	}
	if len(o.BuildArgs) > maxBuildArgs {
		return DockerfileResult{}, errdefs.New(errdefs.ErrInvalidArgument, "%d build args: at most %d", len(o.BuildArgs), maxBuildArgs)
	}
	if o.RunTimeout == 0 {
		o.RunTimeout = DefaultRunTimeout
	}
	if o.RunTimeout < 0 || o.RunTimeout > MaxRunTimeout {
		return DockerfileResult{}, errdefs.New(errdefs.ErrInvalidArgument, "RUN timeout %s: want at most %s", o.RunTimeout, MaxRunTimeout)
	}
	f, err := dockerfile.Parse(o.Dockerfile)
	if err != nil {
		return DockerfileResult{}, err
	}
	root, err := os.OpenRoot(o.Context)
	if err != nil {
		return DockerfileResult{}, fmt.Errorf("build context: %w", err)
	}
	defer root.Close()
	b := &dockerBuilder{m: m, o: o, escape: f.Escape, ctxRoot: root}
	if data, err := readRootFile(root, ".dockerignore", 1<<20); err == nil {
		if b.ignore, err = dockerignore.Parse(data); err != nil {
			return DockerfileResult{}, errdefs.Mark(errdefs.ErrInvalidArgument, err)
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return DockerfileResult{}, errdefs.Mark(errdefs.ErrInvalidArgument, fmt.Errorf(".dockerignore: %w", err))
	}
	st, err := b.build(ctx, f.Instructions)
	if err != nil {
		return DockerfileResult{}, err
	}
	top := st.base
	if len(st.ws) > 0 {
		top = st.ws[0]
	}
	l, _, err := m.layers.As(o.Owner).Tag(top, o.Name+":"+o.Version)
	if err != nil {
		return DockerfileResult{}, fmt.Errorf("tag the result %s:%s: %w", o.Name, o.Version, err)
	}
	cfg := st.cfg
	env, err := m.layers.As(o.Owner).CreateEnv(layer.Env{Name: o.Environment, Base: st.base, Workspaces: slices.Clone(st.ws), Image: &cfg}, true)
	if err != nil {
		return DockerfileResult{}, err
	}
	return DockerfileResult{Environment: env, Layer: l, StepsRun: b.run, StepsCached: b.cached}, nil
}

func (b *dockerBuilder) log(ev BuildEvent) {
	if b.o.Log != nil {
		b.o.Log(ev)
	}
}

func (b *dockerBuilder) build(ctx context.Context, ins []dockerfile.Instruction) (*stage, error) {
	global := map[string]string{} // ARGs before the first FROM
	var st *stage
	for i, in := range ins {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		b.log(BuildEvent{Step: i + 1, Steps: len(ins), Line: in.Line, Text: in.Original})
		fail := func(err error) error {
			return fmt.Errorf("Dockerfile line %d (%s): %w", in.Line, in.Cmd, err)
		}
		if st == nil && in.Cmd != "FROM" && in.Cmd != "ARG" {
			return nil, fail(errdefs.New(errdefs.ErrInvalidArgument, "the first instruction must be FROM (or ARG)"))
		}
		var err error
		switch in.Cmd {
		case "FROM":
			if st != nil && b.o.Target != "" && st.name == strings.ToLower(b.o.Target) {
				return st, nil // the target stage is complete: what follows is not built
			}
			st, err = b.from(ctx, in, global)
		case "ARG":
			err = b.arg(in, st, global)
		case "ENV":
			err = b.env(in, st)
		case "WORKDIR":
			err = b.workdir(ctx, in, st)
		case "USER":
			var u string
			if u, err = b.expand(in, st); err == nil {
				st.cfg.User = u
				st.key = dockerfile.StepKey(st.key, "USER "+u)
			}
		case "SHELL":
			if len(in.Args) == 0 {
				err = errdefs.New(errdefs.ErrInvalidArgument, "SHELL needs a command")
			}
			st.shell = slices.Clone(in.Args)
			st.key = dockerfile.StepKey(st.key, "SHELL "+jsonString(in.Args))
		case "CMD", "ENTRYPOINT":
			args := in.Args
			if !in.JSON && len(args) > 0 {
				args = append(slices.Clone(st.shell), args[0])
			}
			if in.Cmd == "CMD" {
				st.cfg.Cmd = args
			} else {
				st.cfg.Entrypoint = args
			}
			st.key = dockerfile.StepKey(st.key, in.Cmd+" "+jsonString(args))
		case "RUN":
			err = b.runStep(ctx, in, st)
		case "COPY", "ADD":
			err = b.copyStep(ctx, in, st)
		case "LABEL", "EXPOSE", "VOLUME", "HEALTHCHECK", "ONBUILD", "STOPSIGNAL", "MAINTAINER":
			b.log(BuildEvent{Line: in.Line, Text: fmt.Sprintf("%s is not kept (ignored)", in.Cmd)})
		default:
			err = fmt.Errorf("%s is not supported", in.Cmd)
		}
		if err != nil {
			return nil, fail(err)
		}
	}
	if b.o.Target != "" && (st == nil || st.name != strings.ToLower(b.o.Target)) {
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "target stage %.64q: no such stage", b.o.Target)
	}
	if st == nil {
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "Dockerfile: no FROM")
	}
	return st, nil
}

func (b *dockerBuilder) expand(in dockerfile.Instruction, st *stage) (string, error) {
	if len(in.Args) != 1 {
		return "", errdefs.New(errdefs.ErrInvalidArgument, "%s takes one argument", in.Cmd)
	}
	return dockerfile.Expand(in.Args[0], b.escape, st.lookup)
}

func jsonString(v any) string {
	j, _ := json.Marshal(v)
	return string(j)
}

func (b *dockerBuilder) from(ctx context.Context, in dockerfile.Instruction, global map[string]string) (*stage, error) {
	if err := in.CheckFlags(); err != nil {
		return nil, err
	}
	if len(b.stages) >= maxStages {
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "more than %d stages", maxStages)
	}
	var words []string
	if len(in.Args) == 1 {
		words = strings.Fields(in.Args[0])
	}
	if len(words) != 1 && (len(words) != 3 || !strings.EqualFold(words[1], "AS")) {
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "want FROM REF [AS NAME]")
	}
	ref, err := dockerfile.Expand(words[0], b.escape, func(k string) (string, bool) { v, ok := global[k]; return v, ok })
	if err != nil {
		return nil, err
	}
	st := &stage{shell: []string{"/bin/sh", "-c"}, args: map[string]string{}}
	if len(words) == 3 {
		st.name = strings.ToLower(words[2])
		if b.stage(st.name) != nil {
			return nil, errdefs.New(errdefs.ErrInvalidArgument, "a second stage named %q", st.name)
		}
	}
	switch {
	case ref == "scratch":
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "FROM scratch is not supported: a stack needs a base layer; build one with shoal layer build --kind base")
	case b.stage(ref) != nil:
		p := b.stage(ref)
		st.base, st.ws, st.cfg, st.shell = p.base, slices.Clone(p.ws), cloneConfig(p.cfg), slices.Clone(p.shell)
		st.key = p.key
	default:
		if err := b.resolveFrom(ctx, ref, st); err != nil {
			return nil, err
		}
		digests := []string{}
		for _, r := range append(slices.Clone(st.ws), st.base) {
			l, err := b.view().Resolve(r)
			if err != nil {
				return nil, err
			}
			digests = append(digests, l.Digest)
		}
		st.key = dockerfile.StepKey("FROM", jsonString(digests), jsonString(st.cfg))
	}
	b.stages = append(b.stages, st)
	return st, nil
}

// resolveFrom fills st from what FROM names: an environment, a base
// layer, or an image (by the create's rule: layer.Store.ImageForBase).
func (b *dockerBuilder) resolveFrom(ctx context.Context, ref string, st *stage) error {
	store := b.view()
	if !strings.ContainsAny(ref, ":/@") {
		if e, err := store.GetEnv(ref); err == nil {
			st.base, st.ws = e.Base, slices.Clone(e.Workspaces)
			if len(e.Toolkits) > 0 {
				return errdefs.New(errdefs.ErrInvalidArgument, "environment %s has toolkits: a build's stack is a base and workspaces", ref)
			}
			if e.Image != nil {
				st.cfg = cloneConfig(*e.Image)
			}
			return nil
		}
	}
	if image, pull := store.ImageForBase(ref); image != "" {
		var im layer.PulledImage
		var err error
		if pull {
			b.log(BuildEvent{Text: "pulling " + image})
			im, err = store.PullImage(ctx, layer.PullOptions{Image: image})
		} else {
			im, err = store.LookupPulledImage(image)
		}
		if err != nil {
			return err
		}
		st.base, st.ws = im.Stack()
		st.cfg = cloneConfig(im.Config)
		return nil
	}
	l, err := store.Resolve(ref)
	if err != nil {
		return fmt.Errorf("FROM %s: not a stage, an environment, a layer or a pulled image: %w", ref, err)
	}
	if l.Kind != layer.KindBase {
		return errdefs.New(errdefs.ErrInvalidArgument, "FROM %s: a %s layer; FROM takes a base layer, an environment, an image or a stage", ref, l.Kind)
	}
	st.base = ref
	return nil
}

func cloneConfig(c layer.ImageConfig) layer.ImageConfig {
	return layer.ImageConfig{Env: slices.Clone(c.Env), WorkingDir: c.WorkingDir, User: c.User, Entrypoint: slices.Clone(c.Entrypoint), Cmd: slices.Clone(c.Cmd)}
}

func (b *dockerBuilder) stage(name string) *stage {
	if name == "" {
		return nil
	}
	for i, s := range b.stages {
		if s.name == strings.ToLower(name) || strconv.Itoa(i) == name {
			return s
		}
	}
	return nil
}

func (b *dockerBuilder) arg(in dockerfile.Instruction, st *stage, global map[string]string) error {
	if len(in.Args) != 1 {
		return errdefs.New(errdefs.ErrInvalidArgument, "want ARG NAME[=DEFAULT]")
	}
	words, err := dockerfile.Words(in.Args[0], b.escape)
	if err != nil {
		return err
	}
	for _, w := range words {
		name, def, hasDef := strings.Cut(w, "=")
		if !dockerfile.ValidName(name) {
			return errdefs.New(errdefs.ErrInvalidArgument, "bad ARG name %.64q", name)
		}
		v, given := b.o.BuildArgs[name]
		if st == nil {
			if !given {
				v = def
			}
			global[name] = v
			continue
		}
		if hasDef {
			if def, err = dockerfile.Expand(def, b.escape, st.lookup); err != nil {
				return err
			}
		}
		switch {
		case given:
		case hasDef:
			v = def
		default:
			v = global[name]
		}
		st.args[name] = v
		st.key = dockerfile.StepKey(st.key, "ARG "+name+"="+v)
	}
	return nil
}

func (b *dockerBuilder) env(in dockerfile.Instruction, st *stage) error {
	if len(in.Args) != 1 {
		return errdefs.New(errdefs.ErrInvalidArgument, "want ENV NAME=VALUE ...")
	}
	words, err := dockerfile.Words(in.Args[0], b.escape)
	if err != nil {
		return err
	}
	if len(words) > 0 && !strings.Contains(words[0], "=") {
		// The legacy form: ENV NAME the rest of the line.
		_, rest, _ := strings.Cut(strings.TrimSpace(in.Args[0]), words[0])
		words = []string{words[0] + "=" + strings.TrimSpace(rest)}
	}
	if len(words) == 0 {
		return errdefs.New(errdefs.ErrInvalidArgument, "want ENV NAME=VALUE ...")
	}
	// Every value is expanded with the environment before this ENV.
	prev := &stage{cfg: cloneConfig(st.cfg), args: st.args}
	for _, w := range words {
		k, v, ok := strings.Cut(w, "=")
		if !ok || !dockerfile.ValidName(k) {
			return errdefs.New(errdefs.ErrInvalidArgument, "bad ENV entry %.64q: want NAME=VALUE", w)
		}
		if v, err = dockerfile.Expand(v, b.escape, prev.lookup); err != nil {
			return err
		}
		st.setEnv(k, v)
		st.key = dockerfile.StepKey(st.key, "ENV "+k+"="+v)
	}
	return nil
}

func (b *dockerBuilder) workdir(ctx context.Context, in dockerfile.Instruction, st *stage) error {
	d, err := b.expand(in, st)
	if err != nil {
		return err
	}
	if !path.IsAbs(d) {
		d = path.Join("/", st.cfg.WorkingDir, d)
	}
	d = path.Clean(d)
	st.cfg.WorkingDir = d
	st.key = dockerfile.StepKey(st.key, "WORKDIR "+d)
	// The directory is made if the stack has none.
	return b.hostStep(ctx, in, st, st.key, func(root *os.Root) (bool, error) {
		if fi, err := root.Stat(strings.TrimPrefix(d, "/") + "/."); err == nil && fi.IsDir() {
			return false, nil
		}
		if d == "/" {
			return false, nil
		}
		return true, root.MkdirAll(strings.TrimPrefix(d, "/"), 0o755)
	})
}

// stepLayer returns the cached layer of a step, if there is one.
func (b *dockerBuilder) stepLayer(key string) (string, bool) {
	if b.o.NoCache {
		return "", false
	}
	ref := StepLayerName + ":" + key
	if _, err := b.view().Resolve(ref); err != nil {
		return "", false
	}
	return ref, true
}

func (b *dockerBuilder) push(st *stage, ref string) { st.ws = append([]string{ref}, st.ws...) }

func (b *dockerBuilder) runStep(ctx context.Context, in dockerfile.Instruction, st *stage) error {
	if err := in.CheckFlags(); err != nil {
		return err
	}
	if len(in.Args) == 0 {
		return errdefs.New(errdefs.ErrInvalidArgument, "RUN needs a command")
	}
	argv := in.Args
	if !in.JSON {
		argv = append(slices.Clone(st.shell), in.Args[0])
	}
	st.key = dockerfile.StepKey(st.key, "RUN "+jsonString(argv))
	if ref, ok := b.stepLayer(st.key); ok {
		b.cached++
		b.log(BuildEvent{Line: in.Line, Text: "cached", Cached: true})
		b.push(st, ref)
		return nil
	}
	env := map[string]string{}
	for _, kv := range st.cfg.Env {
		k, v, _ := strings.Cut(kv, "=")
		env[k] = v
	}
	for k, v := range st.args { // ARGs are in RUN's environment, under ENV's
		if _, ok := env[k]; !ok {
			env[k] = v
		}
	}
	m := b.m
	// Its commands go to its agent directly, which is no activity the
	// idle policy sees: never paused, and alive for the RUN's timeout.
	never := time.Duration(0)
	rec, err := m.Create(ctx, CreateRequest{
		Base: st.base, Workspaces: slices.Clone(st.ws), Env: env, Network: b.o.Network,
		Tenant: b.o.Tenant, Owner: b.o.Owner, Timeout: min(b.o.RunTimeout+10*time.Minute, m.cfg.MaxTimeout), AutoPause: &never,
		Metadata: map[string]string{"shoal.dockerfile": b.o.Name + ":" + b.o.Version},
	})
	if err != nil {
		return fmt.Errorf("a sandbox for RUN: %w", err)
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		if err := m.Delete(dctx, rec.ID); err != nil {
			m.log.Warn("delete a Dockerfile build's sandbox", "sandbox_id", rec.ID, "err", err)
		}
	}()
	ag, err := m.Agent(rec.ID)
	if err != nil {
		return err
	}
	user := st.cfg.User
	if user == "root" || user == "0" || strings.HasPrefix(user, "root:") || strings.HasPrefix(user, "0:") {
		user = ""
	}
	user, _, _ = strings.Cut(user, ":")
	cwd := st.cfg.WorkingDir
	if cwd == "" {
		cwd = "/"
	}
	p, err := ag.Exec(ctx, agent.ExecRequest{Args: argv, Cwd: cwd, User: user, Timeout: b.o.RunTimeout})
	if err != nil {
		return fmt.Errorf("start RUN: %w", err)
	}
	defer p.Close()
	var logged int
	var tail []byte
	for {
		ev, err := p.Recv()
		if err != nil {
			return fmt.Errorf("RUN: %w", err)
		}
		if ev.Kind == agent.EventExit {
			if ev.Exit.TimedOut {
				return fmt.Errorf("RUN did not finish in %s (the build's RUN timeout): %w", b.o.RunTimeout, context.DeadlineExceeded)
			}
			if ev.Exit.Code != 0 {
				return errdefs.New(errdefs.ErrFailedPrecondition, "RUN exited with code %d; its last output: %s", ev.Exit.Code, strings.TrimSpace(string(tail)))
			}
			break
		}
		tail = append(tail, ev.Data...)
		if len(tail) > 1024 {
			tail = tail[len(tail)-1024:]
		}
		if logged < maxStepLog {
			d := ev.Data
			if len(d) > maxStepLog-logged {
				d = d[:maxStepLog-logged]
			}
			logged += len(d)
			b.log(BuildEvent{Line: in.Line, Stream: ev.Kind.String(), Output: string(d)})
		}
	}
	l, err := m.CommitLayer(ctx, rec.ID, layer.CommitOptions{Kind: layer.KindWorkspace, Name: StepLayerName, Version: st.key, Tenant: b.home()})
	if err != nil {
		return fmt.Errorf("commit RUN's changes: %w", err)
	}
	b.run++
	b.push(st, l.Ref())
	return nil
}

// hostStep makes a step's layer from changes fn writes into an overlay
// of st's stack mounted on the host (the step's cache key is key): fn
// gets the overlay's root as an os.Root and says whether it changed
// anything; the overlay's upper becomes the layer, as a sandbox's
// writable layer does. Nothing is made if fn changed nothing.
func (b *dockerBuilder) hostStep(ctx context.Context, in dockerfile.Instruction, st *stage, key string, fn func(root *os.Root) (bool, error)) error {
	if ref, ok := b.stepLayer(key); ok {
		b.cached++
		b.log(BuildEvent{Line: in.Line, Text: "cached", Cached: true})
		b.push(st, ref)
		return nil
	}
	changed := false
	upper, cleanup, err := b.withStack(st, func(root *os.Root) error {
		var err error
		changed, err = fn(root)
		return err
	})
	if err != nil {
		return err
	}
	defer cleanup()
	if !changed {
		return nil
	}
	l, err := b.m.layers.Commit(ctx, layer.CommitOptions{Kind: layer.KindWorkspace, Name: StepLayerName, Version: key, Upper: upper, Tenant: b.home(),
		Origin: fmt.Sprintf("Dockerfile %s:%s line %d", b.o.Name, b.o.Version, in.Line)})
	if err != nil {
		return fmt.Errorf("commit %s's changes: %w", in.Cmd, err)
	}
	b.run++
	b.push(st, l.Ref())
	return nil
}

// withStack mounts an overlay of st's stack (its layers as lowers, an
// empty upper in the store's scratch space), calls fn with its root, and
// unmounts it. It returns the upper (and a cleanup removing it).
func (b *dockerBuilder) withStack(st *stage, fn func(root *os.Root) error) (upper string, cleanup func(), err error) {
	store := b.m.layers
	var lowers []string
	var digests []string
	defer func() {
		for _, d := range digests {
			store.Release(d)
		}
	}()
	for _, r := range append(slices.Clone(st.ws), st.base) {
		l, err := b.view().Resolve(r)
		if err != nil {
			return "", nil, err
		}
		p, err := store.Acquire(l.Digest)
		if err != nil {
			return "", nil, fmt.Errorf("mount layer %s: %w", r, err)
		}
		digests = append(digests, l.Digest)
		lowers = append(lowers, p)
	}
	dir, err := store.ScratchDir("step-")
	if err != nil {
		return "", nil, err
	}
	cleanup = func() { os.RemoveAll(dir) }
	target := filepath.Join(dir, "root")
	upper = filepath.Join(dir, "upper")
	if err := layer.Compose(target, lowers, upper, filepath.Join(dir, "work"), true); err != nil {
		cleanup()
		return "", nil, err
	}
	root, err := os.OpenRoot(target)
	if err == nil {
		err = fn(root)
		root.Close()
	}
	if uerr := layer.Unmount(target); uerr != nil && err == nil {
		err = uerr
	}
	if err != nil {
		cleanup()
		return "", nil, err
	}
	return upper, cleanup, nil
}

func readRootFile(root *os.Root, name string, max int64) ([]byte, error) {
	f, err := root.Open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, max+1))
	if err != nil {
		return nil, err
	}
	if int64(len(data)) > max {
		return nil, fmt.Errorf("%s is larger than %d bytes", name, max)
	}
	return data, nil
}

// hashTree digests what a COPY reads at rel of root (files' paths,
// modes, link targets and contents), leaving out what ignore excludes.
func hashTree(root *os.Root, rel string, ignore func(string) bool) (string, error) {
	h := sha256.New()
	var walk func(rel string, depth int) error
	walk = func(rel string, depth int) error {
		if depth > layer.DefaultCommitMaxDepth {
			return fmt.Errorf("%s: too deep", rel)
		}
		if ignore(rel) {
			return nil
		}
		fi, err := root.Lstat(rel)
		if err != nil {
			return err
		}
		fmt.Fprintf(h, "%q %o %d\n", rel, fi.Mode(), fi.Size())
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			t, err := root.Readlink(rel)
			if err != nil {
				return err
			}
			fmt.Fprintf(h, "-> %q\n", t)
		case fi.Mode().IsRegular():
			f, err := root.OpenFile(rel, os.O_RDONLY|syscallNoFollow, 0)
			if err != nil {
				return err
			}
			_, err = io.Copy(h, f)
			f.Close()
			return err
		case fi.IsDir():
			d, err := root.Open(rel)
			if err != nil {
				return err
			}
			names, err := d.Readdirnames(-1)
			d.Close()
			if err != nil {
				return err
			}
			slices.Sort(names)
			for _, n := range names {
				if err := walk(path.Join(rel, n), depth+1); err != nil {
					return err
				}
			}
		}
		return nil
	}
	if err := walk(rel, 0); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

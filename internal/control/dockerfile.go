package control

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/shoal-sandbox/shoal/internal/dockerfile"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/netpolicy"
	"github.com/shoal-sandbox/shoal/internal/node"
	"github.com/shoal-sandbox/shoal/internal/tenant"
)

// buildDockerfile builds a Dockerfile in sandboxes (node.Manager.BuildDockerfile):
//
//	POST /v1/layers/dockerfile?ref=NAME:VER[&dockerfile=PATH][&env=NAME]
//	     [&build_arg=K=V]...[&target=STAGE][&no_cache=true][&run_timeout=SECONDS]
//	     [&internet=true][&allow_out=CIDR]...[&deny_out=CIDR]...
//	<- the build context as a tar (plain, gzip, zstd; at most the server's
//	   --build-upload-max), PATH (default "Dockerfile") inside it
//	-> NDJSON: {"log": {step, steps, line, text, cached, stream, output}}
//	   lines, then {"result": {environment, layer, steps_run, steps_cached}}
//	   or {"error": {"code", "message"}}
//
// The RUN sandboxes belong to the caller's tenant (its quota applies) and
// get the egress asked for, none by default.
func (s *Server) buildDockerfile(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	name, version, err := layer.ParseTag(q.Get("ref"))
	if err != nil {
		writeConnectError(w, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("result reference %q must be NAME:VERSION: %w", q.Get("ref"), err)))
		return
	}
	if s.envs != nil {
		writeConnectError(w, errdefs.New(errdefs.ErrFailedPrecondition, "Dockerfile builds are for a single server (the result is an environment of this server); in a cluster, build on one and push its layers"))
		return
	}
	dfPath := q.Get("dockerfile")
	if dfPath == "" {
		dfPath = "Dockerfile"
	}
	if !fs.ValidPath(path.Clean(dfPath)) || len(dfPath) > 1024 {
		writeConnectError(w, errdefs.New(errdefs.ErrInvalidArgument, "dockerfile %.128q: a relative path inside the build context", dfPath))
		return
	}
	o := node.DockerfileBuild{Name: name, Version: version, Environment: q.Get("env"), Target: q.Get("target"),
		Tenant: tenant.FromContext(r.Context()).Tenant, Owner: layerOwner(r.Context()), BuildArgs: map[string]string{}}
	for _, kv := range q["build_arg"] {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || !dockerfile.ValidName(k) || len(v) > 64<<10 {
			writeConnectError(w, errdefs.New(errdefs.ErrInvalidArgument, "build arg %.64q: want NAME=VALUE (a value of at most 64 KiB)", kv))
			return
		}
		o.BuildArgs[k] = v
	}
	o.NoCache, _ = strconv.ParseBool(q.Get("no_cache"))
	if t := q.Get("run_timeout"); t != "" {
		sec, err := strconv.ParseFloat(t, 64)
		if err != nil || sec <= 0 || sec > node.MaxRunTimeout.Seconds() {
			writeConnectError(w, errdefs.New(errdefs.ErrInvalidArgument, "run_timeout %.32q: seconds, at most %d", t, int(node.MaxRunTimeout.Seconds())))
			return
		}
		o.RunTimeout = time.Duration(sec * float64(time.Second))
	}
	internet, _ := strconv.ParseBool(q.Get("internet"))
	if internet || len(q["allow_out"]) > 0 || len(q["deny_out"]) > 0 {
		o.Network = &netpolicy.Request{Internet: internet, AllowOut: q["allow_out"], DenyOut: q["deny_out"]}
	}
	max := s.builds.UploadMax
	if max <= 0 {
		max = layer.DefaultUploadMax
	}
	if r.ContentLength > max {
		refuseUpload(w, r, false, fmt.Errorf("the build context (%d bytes) is larger than %d bytes, the most this server takes (shoal serve --build-upload-max)", r.ContentLength, max))
		return
	}
	store := s.node.Layers()
	dir, remove, err := store.ExtractContext(r.Context(), r.Body, max)
	if err != nil {
		if errors.Is(err, errdefs.ErrResourceExhausted) {
			refuseUpload(w, r, true, err)
			return
		}
		writeConnectError(w, err)
		return
	}
	defer remove()
	root, err := os.OpenRoot(dir)
	if err == nil {
		var f *os.File
		if f, err = root.Open(path.Clean(dfPath)); err == nil {
			var fi os.FileInfo
			if fi, err = f.Stat(); err == nil && (!fi.Mode().IsRegular() || fi.Size() > dockerfile.MaxBytes) {
				err = errdefs.New(errdefs.ErrInvalidArgument, "dockerfile %s: a regular file of at most %d bytes", dfPath, dockerfile.MaxBytes)
			}
			if err == nil {
				o.Dockerfile = make([]byte, fi.Size())
				_, err = f.ReadAt(o.Dockerfile, 0)
			}
			f.Close()
		}
		root.Close()
	}
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			err = errdefs.New(errdefs.ErrInvalidArgument, "dockerfile %s: not in the build context", dfPath)
		}
		writeConnectError(w, err)
		return
	}
	o.Context = dir
	var mu sync.Mutex // serializes writes to w
	started := false
	send := func(v any) error {
		b, err := json.Marshal(v)
		if err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		if !started {
			w.Header().Set("Content-Type", "application/x-ndjson")
			started = true
		}
		if _, err := w.Write(append(b, '\n')); err != nil {
			return err
		}
		return http.NewResponseController(w).Flush()
	}
	o.Log = func(ev node.BuildEvent) { send(map[string]any{"log": ev}) }
	res, err := s.node.BuildDockerfile(r.Context(), o)
	if err == nil {
		l, _ := protojson.Marshal(layerPB(res.Layer))
		e, _ := protojson.Marshal(s.environmentPB(r.Context(), res.Environment))
		err = send(map[string]any{"result": map[string]any{
			"layer": json.RawMessage(l), "environment": json.RawMessage(e),
			"steps_run": res.StepsRun, "steps_cached": res.StepsCached,
		}})
		if err == nil {
			return
		}
	}
	s.log.Info("Dockerfile build", "ref", name+":"+version, "err", err)
	mu.Lock()
	defer mu.Unlock()
	if !started {
		writeConnectError(w, err)
		return
	}
	ce := toConnect(err).(*connect.Error)
	b, _ := json.Marshal(map[string]any{"error": map[string]string{"code": ce.Code().String(), "message": ce.Message()}})
	w.Write(append(b, '\n'))
}

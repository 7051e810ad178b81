package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/procfs"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// LazyOptions configure `shoal bench lazy`: N sandboxes of a Debian base
// plus a workspace, each running a workload that reads part of the base,
// on a node that takes its layers from an S3 server behind a shaped link,
// once pulling whole images first (eager) and once lazily.
type LazyOptions struct {
	N           int
	Concurrency int           // creates + workloads in flight
	BaseTree    string        // root file system of the base; made with debootstrap if absent
	Mirror      string        // Debian mirror for debootstrap
	WorkDir     string        // S3 data, nodes' data dirs
	Rate        string        // tc rate of the link from the S3 server, e.g. 200mbit
	Delay       string        // one-way delay added on that link (netem), e.g. 1ms; "" none
	Latency     time.Duration // the S3 server's time to first byte
	ChunkSize   string        // --lazy-chunk-size of the pushing node
	Modes       []string
	MemoryMiB   int64
	Shoal       string // the shoal binary run as server and S3 server
	Progress    func(format string, args ...any)
}

// LazyModeResult is one mode's run.
type LazyModeResult struct {
	Mode      string `json:"mode"`
	Sandboxes int    `json:"sandboxes"`
	Failed    int    `json:"failed"`
	// WallSeconds: from the first create until the last workload ended.
	WallSeconds float64 `json:"wall_seconds"`
	// PerSandbox: create + workload of each sandbox; Create and Workload
	// its two parts.
	PerSandbox Dist `json:"per_sandbox"`
	Create     Dist `json:"create"`
	Workload   Dist `json:"workload"`
	// FirstCreateSeconds: until the first create returned (eager: the
	// pull of the images).
	FirstCreateSeconds float64 `json:"first_create_seconds"`
	// BytesFetched: bytes received from the S3 server's link (rx of the
	// veth), HTTP included.
	BytesFetched int64 `json:"bytes_fetched"`
	// LayerBytesWritten: bytes of layer data written to the node's disk:
	// whole images pulled (eager), chunks cached (lazy).
	LayerBytesWritten int64 `json:"layer_bytes_written"`
	// ServeWriteBytes: write_bytes of the serve process (/proc/PID/io):
	// layer data plus its own logs and databases.
	ServeWriteBytes int64 `json:"serve_write_bytes"`
	// Lazy mode: the base's lazy counters, touched = distinct bytes of
	// the image the kernel read (4 KiB pages).
	BaseTouchedBytes   int64    `json:"base_touched_bytes,omitempty"`
	BaseFetchedBytes   int64    `json:"base_fetched_bytes,omitempty"`
	FetchedOverTouched float64  `json:"fetched_over_touched,omitempty"`
	Errors             []string `json:"errors,omitempty"`
}

// LazyResult is the JSON printed by `shoal bench lazy`.
type LazyResult struct {
	Bench       string  `json:"bench"`
	N           int     `json:"n"`
	Concurrency int     `json:"concurrency"`
	CPUs        int     `json:"cpus"`
	Rate        string  `json:"link_rate"`
	Delay       string  `json:"link_delay,omitempty"`
	LatencyMs   float64 `json:"s3_latency_ms"`
	ChunkSize   string  `json:"chunk_size"`
	Base        struct {
		Tree       string `json:"tree"`
		Files      int    `json:"files"`
		TreeBytes  int64  `json:"tree_bytes"`
		ImageBytes int64  `json:"image_bytes"`
	} `json:"base"`
	WorkspaceBytes int64            `json:"workspace_image_bytes"`
	Workload       string           `json:"workload"`
	SetupSeconds   float64          `json:"setup_seconds"`
	Modes          []LazyModeResult `json:"modes"`
	// Lazy against eager.
	TimeLazyOverEager    float64 `json:"time_lazy_over_eager,omitempty"`
	WrittenEagerOverLazy float64 `json:"written_eager_over_lazy,omitempty"`
}

const (
	lazyBucket  = "lazybench"
	lazyBaseRef = "benchbase:1"
	lazyWSRef   = "benchws:1"
	lazyCmd     = "cd /work && python3 bench.py && gcc -O2 -o /tmp/hello hello.c -lm && /tmp/hello"
)

// The workspace: a script importing a set of standard modules and a C file.
var lazyWorkspace = map[string]string{
	"work/bench.py": `import importlib, sys
mods = """json email.mime.multipart email.parser http.client http.server xml.dom.minidom
xml.etree.ElementTree sqlite3 asyncio decimal unittest argparse logging.handlers
urllib.request csv difflib tarfile zipfile gzip bz2 lzma hashlib multiprocessing
concurrent.futures dataclasses typing pathlib shutil subprocess statistics fractions
random pickle pprint textwrap html.parser ctypes uuid socket selectors inspect ast dis
tokenize configparser calendar smtplib imaplib ftplib mailbox plistlib sched queue
heapq bisect copy enum functools itertools operator string re struct codecs locale
gettext glob fnmatch tempfile filecmp zoneinfo ipaddress secrets hmac base64 binascii
quopri uu wave colorsys sndhdr xmlrpc.client xmlrpc.server wsgiref.simple_server
unittest.mock doctest pdb profile cProfile timeit trace tracemalloc venv zipapp
""".split()
for m in mods:
    importlib.import_module(m)
print(len(sys.modules), "modules")
`,
	"work/hello.c": `#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>
#include <errno.h>
#include <unistd.h>
#include <pthread.h>
int main(void) {
	double s = 0;
	for (int i = 1; i < 1000; i++) s += sqrt((double)i);
	char buf[64];
	snprintf(buf, sizeof buf, "%.3f", s);
	printf("%s %zu\n", buf, strlen(buf));
	return 0;
}
`,
}

// Lazy runs the benchmark. It needs root, ip, tc, debootstrap (unless
// BaseTree exists), runc and a kernel with EROFS, FUSE and loop devices.
func Lazy(ctx context.Context, o LazyOptions) (*LazyResult, error) {
	if o.N <= 0 {
		o.N = 64
	}
	if o.Concurrency <= 0 {
		o.Concurrency = min(o.N, 32)
	}
	if o.Rate == "" {
		o.Rate = "200mbit"
	}
	if o.ChunkSize == "" {
		o.ChunkSize = "16K"
	}
	if len(o.Modes) == 0 {
		o.Modes = []string{"eager", "lazy"}
	}
	if o.MemoryMiB <= 0 {
		o.MemoryMiB = 256
	}
	if o.WorkDir == "" {
		o.WorkDir = "/var/tmp/shoal-bench-lazy"
	}
	if o.BaseTree == "" {
		o.BaseTree = filepath.Join(o.WorkDir, "base-tree")
	}
	if o.Mirror == "" {
		o.Mirror = "http://deb.debian.org/debian"
	}
	if o.Progress == nil {
		o.Progress = func(string, ...any) {}
	}
	if o.Shoal == "" {
		exe, err := os.Executable()
		if err != nil {
			return nil, err
		}
		o.Shoal = exe
	}
	for _, m := range o.Modes {
		if m != "eager" && m != "lazy" {
			return nil, fmt.Errorf("mode %q: want eager or lazy", m)
		}
	}
	res := &LazyResult{Bench: "lazy", N: o.N, Concurrency: o.Concurrency, CPUs: runtime.NumCPU(), Rate: o.Rate, Delay: o.Delay, LatencyMs: float64(o.Latency.Microseconds()) / 1000, ChunkSize: o.ChunkSize, Workload: lazyCmd}
	setupStart := time.Now()
	if err := os.MkdirAll(o.WorkDir, 0o755); err != nil {
		return nil, err
	}
	if err := ensureBaseTree(ctx, o); err != nil {
		return nil, err
	}
	res.Base.Tree = o.BaseTree
	res.Base.Files, res.Base.TreeBytes = treeSize(o.BaseTree)
	o.Progress("base tree %s: %d files, %d MB", o.BaseTree, res.Base.Files, res.Base.TreeBytes>>20)

	link, err := newShapedLink(o.Rate, o.Delay)
	if err != nil {
		return nil, err
	}
	defer link.Close()
	s3dir := filepath.Join(o.WorkDir, "s3")
	if err := os.MkdirAll(s3dir, 0o755); err != nil {
		return nil, err
	}
	s3, err := link.startS3(ctx, o.Shoal, s3dir, o.Latency)
	if err != nil {
		return nil, err
	}
	defer s3.stop()
	storeArgs := []string{"--layer-store", "s3://" + lazyBucket + "/layers", "--s3-endpoint", "http://" + s3.addr, "--s3-path-style", "--s3-region", "us-east-1", "--lazy-chunk-size", o.ChunkSize}

	// A builder node builds the two layers and pushes them (write-through).
	b, err := startNode(ctx, o, "builder", append(storeArgs, "--layer-store-write-through"))
	if err != nil {
		return nil, err
	}
	wsDir := filepath.Join(o.WorkDir, "workspace")
	for name, body := range lazyWorkspace {
		p := filepath.Join(wsDir, name)
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			b.stop()
			return nil, err
		}
	}
	o.Progress("building and pushing %s and %s", lazyBaseRef, lazyWSRef)
	bl, err := b.c.BuildLayerFrom(ctx, &pb.BuildLayerRequest{Kind: pb.LayerKind_LAYER_KIND_BASE, Ref: lazyBaseRef}, o.BaseTree, nil)
	if err == nil {
		var wl *pb.Layer
		wl, err = b.c.BuildLayerFrom(ctx, &pb.BuildLayerRequest{Kind: pb.LayerKind_LAYER_KIND_WORKSPACE, Ref: lazyWSRef}, wsDir, nil)
		if err == nil {
			res.WorkspaceBytes = wl.Size
		}
	}
	b.stop()
	if err != nil {
		return nil, fmt.Errorf("build: %w", err)
	}
	res.Base.ImageBytes = bl.Size
	res.SetupSeconds = time.Since(setupStart).Seconds()

	for _, mode := range o.Modes {
		args := append([]string(nil), storeArgs...)
		if mode == "eager" {
			args = append(args, "--lazy=false")
		}
		o.Progress("%s: starting a node", mode)
		n, err := startNode(ctx, o, mode, args)
		if err != nil {
			return nil, err
		}
		mr := runLazyMode(ctx, o, mode, n, link)
		n.stop()
		o.Progress("%s: %.1f s, fetched %d MB, wrote %d MB of layers", mode, mr.WallSeconds, mr.BytesFetched>>20, mr.LayerBytesWritten>>20)
		res.Modes = append(res.Modes, mr)
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
	}
	var eager, lz *LazyModeResult
	for i := range res.Modes {
		switch res.Modes[i].Mode {
		case "eager":
			eager = &res.Modes[i]
		case "lazy":
			lz = &res.Modes[i]
		}
	}
	if eager != nil && lz != nil && eager.WallSeconds > 0 && lz.LayerBytesWritten > 0 {
		res.TimeLazyOverEager = round3(lz.WallSeconds / eager.WallSeconds)
		res.WrittenEagerOverLazy = round3(float64(eager.LayerBytesWritten) / float64(lz.LayerBytesWritten))
	}
	return res, nil
}

// runLazyMode creates N sandboxes, Concurrency at a time, each running the
// workload and deleted when it ends (the first one only at the end, so
// that the base stays mounted for its counters).
func runLazyMode(ctx context.Context, o LazyOptions, mode string, n *node, link *shapedLink) LazyModeResult {
	mr := LazyModeResult{Mode: mode, Sandboxes: o.N}
	rx0 := link.rxBytes()
	w0 := procWriteBytes(n.cmd.Process.Pid)
	var mu sync.Mutex
	var took, creates, works []time.Duration
	var firstCreate time.Duration
	var failed atomic.Int64
	var keep string
	fail := func(err error) {
		failed.Add(1)
		mu.Lock()
		if len(mr.Errors) < 5 {
			mr.Errors = append(mr.Errors, err.Error())
		}
		mu.Unlock()
	}
	start := time.Now()
	parallel(o.N, o.Concurrency, func(i int) {
		if ctx.Err() != nil {
			fail(ctx.Err())
			return
		}
		t0 := time.Now()
		sb, err := n.c.Create(ctx, &pb.CreateSandboxRequest{Base: lazyBaseRef, Workspaces: []string{lazyWSRef}, MemoryBytes: o.MemoryMiB << 20, TimeoutSeconds: 3600})
		if err != nil {
			fail(fmt.Errorf("create: %w", err))
			return
		}
		tc := time.Since(t0)
		mu.Lock()
		creates = append(creates, tc)
		if firstCreate == 0 || time.Since(start) < firstCreate {
			firstCreate = time.Since(start)
		}
		mu.Unlock()
		var out strings.Builder
		st, err := n.c.Exec(ctx, sb.Id, shoal.ExecOptions{Args: []string{"sh", "-c", lazyCmd}, Stdout: &out, Stderr: &out, Timeout: 30 * time.Minute})
		if err == nil && st.Code != 0 {
			err = fmt.Errorf("workload exited %d: %.300s", st.Code, out.String())
		}
		if err != nil {
			fail(err)
		} else {
			mu.Lock()
			took = append(took, time.Since(t0))
			works = append(works, time.Since(t0)-tc)
			mu.Unlock()
		}
		if i == 0 {
			mu.Lock()
			keep = sb.Id
			mu.Unlock()
			return
		}
		n.c.Delete(context.Background(), sb.Id)
	})
	mr.WallSeconds = round3(time.Since(start).Seconds())
	mr.Failed = int(failed.Load())
	mr.PerSandbox = dist(took)
	mr.Create = dist(creates)
	mr.Workload = dist(works)
	mr.FirstCreateSeconds = round3(firstCreate.Seconds())
	mr.BytesFetched = link.rxBytes() - rx0
	if mode == "lazy" {
		if l, err := n.c.Layers.GetLayer(ctx, connect.NewRequest(&pb.GetLayerRequest{Ref: lazyBaseRef})); err == nil && l.Msg.Lazy != nil {
			mr.BaseTouchedBytes = l.Msg.Lazy.BytesTouched
			mr.BaseFetchedBytes = l.Msg.Lazy.BytesFetched
			if mr.BaseTouchedBytes > 0 {
				mr.FetchedOverTouched = round3(float64(mr.BaseFetchedBytes) / float64(mr.BaseTouchedBytes))
			}
		} else if err != nil {
			mr.Errors = append(mr.Errors, "inspect base: "+err.Error())
		}
	}
	if keep != "" {
		n.c.Delete(context.Background(), keep)
	}
	layers := filepath.Join(n.data, "layers")
	_, blobs := treeSize(filepath.Join(layers, "blobs"))
	_, chunks := treeSize(filepath.Join(layers, "lazy-cache", "chunks"))
	mr.LayerBytesWritten = blobs + chunks
	mr.ServeWriteBytes = procWriteBytes(n.cmd.Process.Pid) - w0
	return mr
}

// ensureBaseTree makes o.BaseTree with debootstrap (Debian 12 minbase with
// python3, gcc and libc6-dev, about 330 MB) unless it holds a python3.
func ensureBaseTree(ctx context.Context, o LazyOptions) error {
	if _, err := os.Stat(filepath.Join(o.BaseTree, "usr/bin/python3")); err == nil {
		return nil
	}
	if _, err := exec.LookPath("debootstrap"); err != nil {
		return fmt.Errorf("no base tree at %s and no debootstrap to make one (apt-get install debootstrap, or --base-tree DIR): %w", o.BaseTree, err)
	}
	tmp := o.BaseTree + ".tmp"
	os.RemoveAll(tmp)
	o.Progress("making the base tree with debootstrap (a few minutes): %s", o.BaseTree)
	cmd := exec.CommandContext(ctx, "debootstrap", "--variant=minbase", "--include=python3,gcc,libc6-dev", "bookworm", tmp, o.Mirror)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("debootstrap: %w: %s", err, tail(out, 2000))
	}
	// /dev comes from the runtime (a layer holds no device nodes); the
	// downloaded packages and lists are dead weight.
	for _, g := range []string{"dev/*", "var/cache/apt/archives/*.deb", "var/lib/apt/lists/*"} {
		found, _ := filepath.Glob(filepath.Join(tmp, g))
		for _, p := range found {
			os.RemoveAll(p)
		}
	}
	return os.Rename(tmp, o.BaseTree)
}

func tail(b []byte, n int) string {
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// treeSize counts the regular files under dir and their bytes; it does not
// cross into other file systems (mounts).
func treeSize(dir string) (files int, bytes int64) {
	var dev uint64
	if fi, err := os.Lstat(dir); err == nil {
		dev = fi.Sys().(*syscall.Stat_t).Dev
	}
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		fi, err := d.Info()
		if err != nil {
			return nil
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Dev != dev {
			return filepath.SkipDir
		}
		if fi.Mode().IsRegular() {
			files++
			bytes += fi.Size()
		}
		return nil
	})
	return files, bytes
}

func procWriteBytes(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/io", pid))
	if err != nil {
		return 0
	}
	sc := bufio.NewScanner(strings.NewReader(string(b)))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "write_bytes: "); ok {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	return 0
}

// shapedLink is a network namespace joined to the host by a veth pair
// whose namespace side sends at most Rate (tc tbf) after Delay (netem):
// what the S3 server in the namespace sends the node is shaped.
type shapedLink struct {
	ns, host, peer string
	hostIP, nsIP   string
}

func newShapedLink(rate, delay string) (*shapedLink, error) {
	id := os.Getpid() % 100000
	l := &shapedLink{ns: fmt.Sprintf("shoalbl%d", id), host: fmt.Sprintf("sblh%d", id), peer: fmt.Sprintf("sbln%d", id)}
	oct := 16 + id%200
	l.hostIP, l.nsIP = fmt.Sprintf("10.213.%d.1", oct), fmt.Sprintf("10.213.%d.2", oct)
	steps := [][]string{
		{"ip", "netns", "add", l.ns},
		{"ip", "link", "add", l.host, "type", "veth", "peer", "name", l.peer},
		{"ip", "link", "set", l.peer, "netns", l.ns},
		{"ip", "addr", "add", l.hostIP + "/30", "dev", l.host},
		{"ip", "link", "set", l.host, "up"},
		{"ip", "-n", l.ns, "addr", "add", l.nsIP + "/30", "dev", l.peer},
		{"ip", "-n", l.ns, "link", "set", l.peer, "up"},
		{"ip", "-n", l.ns, "link", "set", "lo", "up"},
		{"ip", "netns", "exec", l.ns, "tc", "qdisc", "add", "dev", l.peer, "root", "handle", "1:", "tbf", "rate", rate, "burst", "256kb", "latency", "400ms"},
	}
	if delay != "" && delay != "0" { // needs sch_netem
		steps = append(steps, []string{"ip", "netns", "exec", l.ns, "tc", "qdisc", "add", "dev", l.peer, "parent", "1:1", "handle", "10:", "netem", "delay", delay, "limit", "100000"})
	}
	for _, s := range steps {
		if out, err := exec.Command(s[0], s[1:]...).CombinedOutput(); err != nil {
			l.Close()
			return nil, fmt.Errorf("shaped link: %s: %w: %s", strings.Join(s, " "), err, out)
		}
	}
	return l, nil
}

func (l *shapedLink) rxBytes() int64 {
	b, _ := os.ReadFile("/sys/class/net/" + l.host + "/statistics/rx_bytes")
	n, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	return n
}

func (l *shapedLink) Close() {
	exec.Command("ip", "link", "del", l.host).Run()
	exec.Command("ip", "netns", "del", l.ns).Run()
}

type s3proc struct {
	addr string
	cmd  *exec.Cmd
}

// startS3 runs `shoal bench s3-server` in the namespace.
func (l *shapedLink) startS3(ctx context.Context, shoalBin, dir string, latency time.Duration) (*s3proc, error) {
	addr := l.nsIP + ":9000"
	cmd := exec.Command("ip", "netns", "exec", l.ns, shoalBin, "bench", "s3-server", "--dir", dir, "--bucket", lazyBucket, "--listen", addr, "--latency", latency.String())
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	logf, err := os.Create(filepath.Join(dir, "..", "s3-server.log"))
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &s3proc{addr: addr, cmd: cmd}
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			return p, nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			p.stop()
			return nil, fmt.Errorf("s3 server not listening on %s: %v", addr, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (p *s3proc) stop() {
	p.cmd.Process.Kill()
	p.cmd.Wait()
}

// node is a `shoal serve` this benchmark started, on a data dir of its own.
type node struct {
	cmd  *exec.Cmd
	data string
	c    *shoal.Client
}

func startNode(ctx context.Context, o LazyOptions, name string, extra []string) (*node, error) {
	data := filepath.Join(o.WorkDir, "node-"+name)
	if err := cleanDataDir(data); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(data, 0o700); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	addr := ln.Addr().String()
	ln.Close()
	args := append([]string{"serve", "--data", data, "--listen", addr, "--e2b-listen=", "--pool-size", "0"}, extra...)
	cmd := exec.Command(o.Shoal, args...)
	cmd.Env = append(os.Environ(), "AWS_ACCESS_KEY_ID=bench", "AWS_SECRET_ACCESS_KEY=bench")
	logf, err := os.Create(filepath.Join(o.WorkDir, "node-"+name+".log"))
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	n := &node{cmd: cmd, data: data}
	deadline := time.Now().Add(60 * time.Second)
	for {
		if res, err := http.Get("http://" + addr + "/healthz"); err == nil {
			res.Body.Close()
			break
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			n.stop()
			return nil, fmt.Errorf("node %s not healthy (log: %s)", name, logf.Name())
		}
		time.Sleep(50 * time.Millisecond)
	}
	key, err := os.ReadFile(filepath.Join(data, "admin.key"))
	if err != nil {
		n.stop()
		return nil, err
	}
	if n.c, err = shoal.New(shoal.Options{URL: "http://" + addr, APIKey: strings.TrimSpace(string(key))}); err != nil {
		n.stop()
		return nil, err
	}
	return n, nil
}

// stop ends the node (SIGTERM, then SIGKILL after a minute).
func (n *node) stop() {
	n.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { n.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(time.Minute):
		n.cmd.Process.Kill()
		<-done
	}
}

// cleanDataDir removes a data dir an earlier run left, refusing if
// anything is still mounted under it.
func cleanDataDir(dir string) error {
	mounts, err := procfs.Mountinfo("self")
	if err != nil {
		return err
	}
	for _, m := range mounts {
		if m.Point == dir || strings.HasPrefix(m.Point, dir+"/") {
			return fmt.Errorf("%s is still mounted (an earlier run's node?): unmount it first", m.Point)
		}
	}
	if err := os.RemoveAll(dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

package container

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

func validSpec() sandbox.Spec {
	return sandbox.Spec{
		ID:          "sb-1",
		Dir:         "/var/lib/shoal/sb-1",
		Layers:      []sandbox.Layer{{Digest: "sha256:aa", Kind: "base", MountPath: "/var/lib/shoal/layers/aa"}},
		AgentBinary: "/usr/libexec/shoal-agent",
	}
}

func TestCheckSpec(t *testing.T) {
	for _, tc := range []struct {
		name   string
		modify func(*sandbox.Spec)
		want   string // "" = valid
	}{
		{"valid", func(*sandbox.Spec) {}, ""},
		{"empty id", func(s *sandbox.Spec) { s.ID = "" }, "invalid sandbox id"},
		{"id with slash", func(s *sandbox.Spec) { s.ID = "a/b" }, "invalid sandbox id"},
		{"id dot dot", func(s *sandbox.Spec) { s.ID = ".." }, "invalid sandbox id"},
		{"no dir", func(s *sandbox.Spec) { s.Dir = "" }, "no state dir"},
		{"no layers", func(s *sandbox.Spec) { s.Layers = nil }, "no layers"},
		{"layer not mounted", func(s *sandbox.Spec) { s.Layers[0].MountPath = "" }, "not mounted"},
		{"relative layer", func(s *sandbox.Spec) { s.Layers[0].MountPath = "layers/aa" }, "not absolute"},
		{"no agent", func(s *sandbox.Spec) { s.AgentBinary = "" }, "no agent"},
		{"bad env", func(s *sandbox.Spec) { s.Env = []string{"NOVALUE"} }, "KEY=value"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := validSpec()
			tc.modify(&s)
			err := checkSpec(s)
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("unexpected error %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("error %v, want one containing %q", err, tc.want)
			}
			if tc.name == "network" && !errors.Is(err, sandbox.ErrUnsupported) {
				t.Errorf("network: %v is not ErrUnsupported", err)
			}
		})
	}
}

// testAgentCopies is a backend's agentCopies in a temporary directory (no
// tmpfs), and an agent binary to copy into it.
func testAgentCopies(t *testing.T) (*agentCopies, string) {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "shoal-agent")
	if err := os.WriteFile(bin, []byte("\x7fELF an agent"), 0o755); err != nil {
		t.Fatal(err)
	}
	return &agentCopies{dir: t.TempDir(), byID: map[agentID]string{}}, bin
}

func TestOCISpec(t *testing.T) {
	copies, bin := testAgentCopies(t)
	b := &Backend{cgroupParent: "shoal", agents: copies}
	s := validSpec()
	s.AgentBinary = bin
	s.Env = []string{"HOME=/work", "FOO=bar", "SHOAL_AGENT_FD=7", "SHOAL_POOL=1", "SHOAL_SECCOMP_FD=9"}
	cfg, err := b.ociSpec(s, "/var/lib/shoal/sb-1/rootfs", nil)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Root.Path != "/var/lib/shoal/sb-1/rootfs" || cfg.Root.Readonly {
		t.Errorf("root %+v", cfg.Root)
	}
	if !slices.Equal(cfg.Process.Args, []string{"/.shoal/agent"}) || cfg.Process.Cwd != "/" || cfg.Process.User.UID != 0 {
		t.Errorf("process %+v", cfg.Process)
	}
	wantEnv := []string{
		"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
		"HOME=/work", "TERM=xterm", "FOO=bar", "SHOAL_SANDBOX_ID=sb-1", "SHOAL_AGENT_FD=3", "SHOAL_READY_FD=4",
	}
	if !slices.Equal(cfg.Process.Env, wantEnv) {
		t.Errorf("env %q, want %q", cfg.Process.Env, wantEnv)
	}
	if cfg.Process.NoNewPrivileges || cfg.Process.OOMScoreAdj != nil {
		t.Errorf("noNewPrivileges %v, oomScoreAdj %v", cfg.Process.NoNewPrivileges, cfg.Process.OOMScoreAdj)
	}
	if c := cfg.Process.Capabilities; len(c.Bounding) != 14 || !slices.Equal(c.Bounding, c.Effective) || !slices.Equal(c.Bounding, c.Permitted) || len(c.Inheritable)+len(c.Ambient) != 0 {
		t.Errorf("capabilities %+v", c)
	}
	if cfg.Hostname != "sb-1" || cfg.Linux.CgroupsPath != "/shoal/sb-1" {
		t.Errorf("hostname %q, cgroups path %q", cfg.Hostname, cfg.Linux.CgroupsPath)
	}
	var ns []specs.LinuxNamespaceType
	for _, n := range cfg.Linux.Namespaces {
		if n.Path != "" {
			t.Errorf("namespace %s joins %s", n.Type, n.Path)
		}
		ns = append(ns, n.Type)
	}
	for _, want := range []specs.LinuxNamespaceType{specs.PIDNamespace, specs.MountNamespace, specs.IPCNamespace, specs.UTSNamespace, specs.NetworkNamespace} {
		if !slices.Contains(ns, want) {
			t.Errorf("no %s namespace", want)
		}
	}
	r := cfg.Linux.Resources
	if *r.Memory.Limit != DefaultMemoryBytes || *r.Memory.Swap != DefaultMemoryBytes || *r.Pids.Limit != DefaultPids || r.CPU != nil {
		t.Errorf("default resources %+v", r)
	}
	if cfg.Linux.Seccomp == nil || cfg.Linux.Seccomp.DefaultAction != specs.ActErrno || len(cfg.Linux.Seccomp.Syscalls) < 10 {
		t.Errorf("seccomp %+v", cfg.Linux.Seccomp)
	}
	mounts := map[string]specs.Mount{}
	for _, m := range cfg.Mounts {
		mounts[m.Destination] = m
	}
	for _, d := range []string{"/proc", "/dev", "/dev/pts", "/dev/shm", "/dev/mqueue", "/sys", "/sys/fs/cgroup", "/.shoal/agent"} {
		if _, ok := mounts[d]; !ok {
			t.Errorf("no %s mount", d)
		}
	}
	if _, ok := mounts["/tmp"]; ok {
		t.Error("/tmp is a separate mount; it belongs to the overlay")
	}
	// Bound from the backend's private copy, never from the host's path.
	a := mounts["/.shoal/agent"]
	if filepath.Dir(a.Source) != copies.dir || !slices.Contains(a.Options, "ro") || !slices.Contains(a.Options, "bind") {
		t.Errorf("agent mount %+v, want a bind of a copy in %s", a, copies.dir)
	}
	if got, err := os.ReadFile(a.Source); err != nil || string(got) != "\x7fELF an agent" {
		t.Errorf("the agent's copy: %q %v", got, err)
	}
	if !slices.Contains(cfg.Linux.MaskedPaths, "/proc/kcore") || !slices.Contains(cfg.Linux.ReadonlyPaths, "/proc/sys") {
		t.Errorf("masked %v, readonly %v", cfg.Linux.MaskedPaths, cfg.Linux.ReadonlyPaths)
	}

	s.Resources = sandbox.Resources{MemoryBytes: 1 << 30, MilliCPU: 1500, Pids: 64}
	cfg, err = b.ociSpec(s, "/r", nil)
	if err != nil {
		t.Fatal(err)
	}
	r = cfg.Linux.Resources
	if *r.Memory.Limit != 1<<30 || *r.Memory.Swap != 1<<30 || *r.Pids.Limit != 64 || *r.CPU.Quota != 150000 || *r.CPU.Period != 100000 {
		t.Errorf("resources %+v %+v %+v", r.Memory, r.CPU, r.Pids)
	}
	s.Resources.MemoryBytes = -1
	if _, err := b.ociSpec(s, "/r", nil); err == nil {
		t.Error("negative memory accepted")
	}
}

// TestOCISpecCompiledSeccomp: with the node's compiled filter, runc loads
// no profile; the agent gets the filter as fd 4 and runs with
// CAP_SYS_ADMIN to install it (which it then drops) instead of
// no_new_privs, so that setuid binaries work. A pool container also has
// SHOAL_POOL.
func TestOCISpecCompiledSeccomp(t *testing.T) {
	prog, f, err := compileDockerFilter()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	copies, bin := testAgentCopies(t)
	b := &Backend{cgroupParent: "shoal", filter: f, filterProg: prog, agents: copies}
	spec := validSpec()
	spec.AgentBinary = bin
	cfg, err := b.ociSpec(spec, "/r", nil)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Linux.Seccomp != nil || cfg.Process.NoNewPrivileges {
		t.Errorf("seccomp %v, noNewPrivileges %v: want none, false", cfg.Linux.Seccomp != nil, cfg.Process.NoNewPrivileges)
	}
	if c := cfg.Process.Capabilities; !slices.Contains(c.Bounding, "CAP_SYS_ADMIN") || !slices.Contains(c.Effective, "CAP_SYS_ADMIN") || len(c.Bounding) != len(dockerCaps)+1 {
		t.Errorf("the agent cannot install its filter without no_new_privs: capabilities %+v", c)
	}
	for _, want := range []string{"SHOAL_AGENT_FD=3", "SHOAL_SECCOMP_FD=4", "SHOAL_READY_FD=5"} {
		if !slices.Contains(cfg.Process.Env, want) {
			t.Errorf("env %q lacks %s", cfg.Process.Env, want)
		}
	}
	if slices.Contains(cfg.Process.Env, "SHOAL_POOL=1") {
		t.Errorf("a sandbox container is set up like a pool container: %+v", cfg.Process)
	}

	pool, err := b.containerSpec(containerOptions{runcID: "pool-1", rootfs: "/r", hostname: "pool", env: baseEnv,
		agent: bin, caps: append(slices.Clone(dockerCaps), "CAP_SYS_ADMIN"), pooled: true})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(pool.Process.Env, "SHOAL_POOL=1") || !slices.Contains(pool.Process.Capabilities.Bounding, "CAP_SYS_ADMIN") ||
		pool.Linux.Seccomp != nil || pool.Process.NoNewPrivileges || len(pool.Process.Capabilities.Bounding) != len(dockerCaps)+1 || pool.Linux.CgroupsPath != "/shoal/pool-1" {
		t.Errorf("pool container %+v %+v", pool.Process, pool.Linux)
	}
	if len(pool.Linux.MaskedPaths) == 0 || len(pool.Linux.Namespaces) != len(cfg.Linux.Namespaces) {
		t.Errorf("pool container lacks masked paths or namespaces: %+v", pool.Linux)
	}
}

func TestHostname(t *testing.T) {
	for id, want := range map[string]string{
		"sb-1":                        "sb-1",
		"SB_2.x":                      "sb-2-x",
		"__":                          "sandbox",
		strings.Repeat("a", 100):      strings.Repeat("a", 63),
		"a" + strings.Repeat("-", 70): "a",
	} {
		if got := hostname(id); got != want {
			t.Errorf("hostname(%q) = %q, want %q", id, got, want)
		}
	}
}

func TestMergeEnv(t *testing.T) {
	got := mergeEnv([]string{"A=1", "B=2"}, []string{"B=3", "C=4"}, []string{"A=5"})
	if want := []string{"A=5", "B=3", "C=4"}; !slices.Equal(got, want) {
		t.Errorf("mergeEnv = %q, want %q", got, want)
	}
}

func TestUnescapeMountinfo(t *testing.T) {
	if got := unescapeMountinfo(`/a\040b\134c\01`); got != `/a b\c\01` {
		t.Errorf("got %q", got)
	}
}

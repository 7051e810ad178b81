package e2e

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// dockerfileBuild runs shoal layer build --dockerfile and returns its
// stdout, stderr and exit code.
func dockerfileBuild(dir, ref string, extra ...string) (string, string, int) {
	return run3(nil, append([]string{"layer", "build", "--dockerfile", filepath.Join(dir, "Dockerfile"), dir, ref}, extra...)...)
}

var stepsRe = regexp.MustCompile(`(\d+) steps run, (\d+) cached`)

func steps(t *testing.T, stderr string) string {
	t.Helper()
	m := stepsRe.FindStringSubmatch(stderr)
	if m == nil {
		t.Fatalf("no step count in %q", stderr)
	}
	return m[1] + " run, " + m[2] + " cached"
}

// TestDockerfileBuild: a two-stage Dockerfile FROM a local layer, built
// in sandboxes; a rebuild after changing the last step runs only that
// step; a sandbox of the result sees the files, env, workdir and user.
func TestDockerfileBuild(t *testing.T) {
	need(t)
	dir := t.TempDir()
	files := map[string]string{
		"app/main.sh":   "echo hello from main\n",
		"app/data.txt":  "data\n",
		"app/debug.log": "left out by .dockerignore\n",
		".dockerignore": "**/*.log\n",
	}
	for p, c := range files {
		os.MkdirAll(filepath.Join(dir, filepath.Dir(p)), 0o755)
		if err := os.WriteFile(filepath.Join(dir, p), []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// A symlink out of the context is copied as the symlink it is, never
	// followed on the host.
	if err := os.Symlink("/etc/shadow", filepath.Join(dir, "app/hostlink")); err != nil {
		t.Fatal(err)
	}
	dockerfile := func(last string) {
		df := `# two stages
FROM ` + baseRef + ` AS build
ARG GREETING=hi
RUN mkdir -p /out && echo "$GREETING built" > /out/artifact \
    && echo made-in-build > /out/extra

FROM ` + baseRef + `
ENV APP_HOME=/srv/app MODE="test run"
WORKDIR $APP_HOME
COPY app/ ./
COPY --from=build /out/artifact /opt/artifact
RUN cat main.sh > copied.sh && chown 1000:1000 /srv/app
USER user
CMD ["sh", "-c", "echo cmd ran"]
` + last + "\n"
		if err := os.WriteFile(filepath.Join(dir, "Dockerfile"), []byte(df), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	dockerfile("RUN echo one > last.txt")
	out, stderr, code := dockerfileBuild(dir, "dfapp:1", "--build-arg", "GREETING=hello")
	if code != 0 {
		t.Fatalf("build: exit %d: %s %s", code, out, stderr)
	}
	// build: RUN; final: WORKDIR, COPY, COPY --from, RUN, RUN.
	if got := steps(t, stderr); got != "6 run, 0 cached" {
		t.Errorf("first build: %s\n%s", got, stderr)
	}
	if !strings.Contains(out, "environment dfapp: dfapp:1@sha256:") {
		t.Errorf("result line: %q", out)
	}

	id := createWith(t, "--template", "dfapp")
	got := sh(t, id, `echo "$(pwd) $(id -u) $APP_HOME $MODE"; cat last.txt copied.sh /opt/artifact; ls; readlink hostlink`)
	want := "/srv/app 1000 /srv/app test run\none\necho hello from main\nhello built\ncopied.sh\ndata.txt\nhostlink\nlast.txt\nmain.sh\n/etc/shadow\n"
	if got != want {
		t.Errorf("the result's sandbox:\n got %q\nwant %q", got, want)
	}
	if got := shoalOK(t, "exec", "--image-cmd", id); got != "cmd ran\n" {
		t.Errorf("exec --image-cmd: %q", got)
	}
	// The directories the steps wrote into keep their modes and owners.
	modes := "stat -c '%A %U %G %n' / /tmp /etc /root"
	if got, want := sh(t, id, "test -e /out || echo no-out; "+modes), "no-out\n"+sh(t, create(t), modes); got != want {
		t.Errorf("the first stage's files leaked or a directory's mode changed:\n got %q\nwant %q", got, want)
	}

	// --target: the first stage only, from the cache.
	_, stderr, code = dockerfileBuild(dir, "dfbuild:1", "--build-arg", "GREETING=hello", "--target", "build")
	if code != 0 {
		t.Fatalf("build --target: %s", stderr)
	}
	if got := steps(t, stderr); got != "0 run, 1 cached" {
		t.Errorf("build --target build: %s", got)
	}
	idb := createWith(t, "--template", "dfbuild")
	if got := sh(t, idb, "cat /out/artifact; test -e /srv/app || echo no-app"); got != "hello built\nno-app\n" {
		t.Errorf("the target stage's sandbox: %q", got)
	}

	// The same Dockerfile again: every step from the cache.
	_, stderr, code = dockerfileBuild(dir, "dfapp:1", "--build-arg", "GREETING=hello")
	if code != 0 {
		t.Fatalf("rebuild: %s", stderr)
	}
	if got := steps(t, stderr); got != "0 run, 6 cached" {
		t.Errorf("unchanged rebuild: %s", got)
	}
	// The last step changed: only it runs.
	dockerfile("RUN echo two > last.txt")
	_, stderr, code = dockerfileBuild(dir, "dfapp:2", "--build-arg", "GREETING=hello")
	if code != 0 {
		t.Fatalf("rebuild: %s", stderr)
	}
	if got := steps(t, stderr); got != "1 run, 5 cached" {
		t.Errorf("rebuild after changing the last step: %s\n%s", got, stderr)
	}
	// A context file changed: its COPY and what follows run again.
	os.WriteFile(filepath.Join(dir, "app/data.txt"), []byte("data 2\n"), 0o644)
	_, stderr, code = dockerfileBuild(dir, "dfapp:3", "--build-arg", "GREETING=hello")
	if code != 0 {
		t.Fatalf("rebuild: %s", stderr)
	}
	if got := steps(t, stderr); got != "4 run, 2 cached" {
		t.Errorf("rebuild after changing a copied file: %s\n%s", got, stderr)
	}
	id2 := createWith(t, "--template", "dfapp")
	if got := sh(t, id2, "cat data.txt last.txt"); got != "data 2\ntwo\n" {
		t.Errorf("the rebuilt result: %q", got)
	}
}

// TestDockerfileBadInput: clear errors naming the line, and nothing run.
func TestDockerfileBadInput(t *testing.T) {
	need(t)
	for _, tc := range []struct{ name, df, want string }{
		{"unknown instruction", "FROM " + baseRef + "\nFROBNICATE x\n", "line 2: unknown instruction"},
		{"outside the context", "FROM " + baseRef + "\nCOPY ../secret /x\n", "outside the build context"},
		{"missing stage", "FROM " + baseRef + "\nCOPY --from=nope /a /b\n", "COPY --from=nope: no earlier stage"},
		{"heredoc", "FROM " + baseRef + "\nRUN <<EOF\necho\nEOF\n", "line 2: RUN with a heredoc"},
		{"mount", "FROM " + baseRef + "\nRUN --mount=type=cache,target=/c true\n", "RUN --mount is not supported"},
		{"add url", "FROM " + baseRef + "\nADD https://example.com/x /x\n", "ADD of a URL"},
		{"failing run", "FROM " + baseRef + "\nRUN echo boom >&2; exit 3\n", "exited with code 3; its last output: boom"},
		{"no egress", "FROM " + baseRef + "\nRUN wget -T 3 -q -O- http://1.1.1.1/\n", "exited with code"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			os.WriteFile(filepath.Join(dir, "Dockerfile"), []byte(tc.df), 0o644)
			_, stderr, code := dockerfileBuild(dir, "dfbad:1")
			if code == 0 || !strings.Contains(stderr, tc.want) {
				t.Errorf("exit %d, stderr %q; want an error with %q", code, stderr, tc.want)
			}
		})
	}
}

// TestDockerfileTenant: a build needs the layers:write scope, and its
// RUN sandboxes are the caller's tenant's, under its quota.
func TestDockerfileTenant(t *testing.T) {
	need(t)
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "Dockerfile"), []byte("FROM "+baseRef+"\nRUN echo tenant-"+t.Name()+" > /x\n"), 0o644)
	ctx := context.Background()

	ro, _ := tenantClient(t, "df-ro", "df-t", "sandboxes", "layers:read")
	if _, err := ro.BuildDockerfile(ctx, dir, "dft:1", shoal.DockerfileOptions{}); connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Errorf("a build without layers:write: %v", err)
	}

	c, _ := tenantClient(t, "df-rw", "df-t", "sandboxes", "layers:read", "layers:write")
	if out, code := run(nil, "tenant", "set", "df-t", "--max-sandboxes", "1", "--max-memory", "8G"); code != 0 {
		t.Fatalf("tenant set: %s", out)
	}
	t.Cleanup(func() { sdk(t).SetQuota(context.Background(), "df-t", &pb.Quota{}) })
	sb, err := c.Create(ctx, &pb.CreateSandboxRequest{Base: baseRef})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.BuildDockerfile(ctx, dir, "dft:1", shoal.DockerfileOptions{})
	if connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "line 2") {
		t.Errorf("a RUN past the tenant's quota: %v", err)
	}
	c.Delete(ctx, sb.Id)
	if !eventually(time.Minute, func() bool {
		_, err = c.BuildDockerfile(ctx, dir, "dft:1", shoal.DockerfileOptions{})
		return err == nil
	}) {
		t.Errorf("the build within the quota: %v", err)
	}
}

package e2e

import (
	"context"
	"strings"
	"testing"
	"time"
)

// TestUsers: commands, shells and files as a user of the sandbox (its
// /etc/passwd: user, 1000:1000, also in group users 100, home /home/user),
// through the CLI and the Go SDK; root stays the default; a hostile
// /etc/passwd is refused with a clear error.
func TestUsers(t *testing.T) {
	need(t)
	id := create(t)
	c := sdk(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	script := `echo "$(id -u) $(id -g) $(id -G) $(pwd) $HOME $USER $LOGNAME"`
	if got := shoalOK(t, "exec", "--user", "user", id, "--", "sh", "-c", script); got != "1000 1000 1000 100 /home/user /home/user user user\n" {
		t.Fatalf("exec --user user: %q", got)
	}
	if got := shoalOK(t, "exec", id, "--", "sh", "-c", script); got != "0 0 0 / /root root root\n" && !strings.HasPrefix(got, "0 0 0 / ") {
		t.Fatalf("exec as the default user: %q", got)
	}
	// A uid with no name, and a cwd given.
	if got := shoalOK(t, "exec", "--user", "4321", "--cwd", "/tmp", id, "--", "sh", "-c", "id -u; pwd"); got != "4321\n/tmp\n" {
		t.Fatalf("exec --user 4321: %q", got)
	}
	if out, code := run(nil, "exec", "--user", "nosuch", id, "--", "true"); code == 0 || !strings.Contains(out, "no such user") {
		t.Fatalf("exec --user nosuch: %d %s", code, out)
	}

	// Files written as the user belong to it; its permissions are checked.
	if out, code := run([]byte("hello"), "cp", "--user", "user", "-", id+":/home/user/sub/a.txt"); code != 0 {
		t.Fatalf("cp --user: %s", out)
	}
	if got := sh(t, id, "stat -c '%u:%g %a' /home/user/sub/a.txt /home/user/sub"); got != "1000:1000 644\n1000:1000 755\n" {
		t.Fatalf("owner of what user wrote: %q", got)
	}
	if out, code := run([]byte("x"), "cp", "--user", "user", "-", id+":/etc/evil"); code == 0 || !strings.Contains(out, "permission") {
		t.Fatalf("cp --user into /etc: %d %s", code, out)
	}
	if out, code := run(nil, "cp", "--user", "user", id+":/etc/shadow-like", "-"); code == 0 {
		t.Fatalf("read of a missing file: %s", out)
	}
	sh(t, id, "echo secret > /root/secret && chmod 600 /root/secret")
	if out, code := run(nil, "cp", "--user", "user", id+":/root/secret", "-"); code == 0 || !strings.Contains(out, "permission") {
		t.Fatalf("cp --user of root's 0600 file: %d %s", code, out)
	}
	// Listings carry owners by name.
	ents, err := c.ListDir(ctx, id, "/home", 1)
	if err != nil || len(ents) != 1 || ents[0].Owner != "user" || ents[0].Group != "user" || ents[0].Uid != 1000 {
		t.Fatalf("list /home: %v %v", ents, err)
	}
	if out := shoalOK(t, "files", "ls", id, "/home/user/sub"); !strings.Contains(out, "user  user") {
		t.Fatalf("files ls: %q", out)
	}

	// A shell session as the user.
	shoalOK(t, "shell", "create", "--user", "user", id, "u")
	if got := shoalOK(t, "shell", "run", id, "u", "--", "id -un; pwd"); got != "user\n/home/user\n" {
		t.Fatalf("shell as user: %q", got)
	}

	// The workload owns /etc/passwd: a symlink into /proc, a huge file.
	sh(t, id, "cp /etc/passwd /tmp/pw && ln -sf /proc/self/environ /etc/passwd")
	if out, code := run(nil, "exec", "--user", "user", id, "--", "true"); code == 0 || !strings.Contains(out, "not a regular file") {
		t.Fatalf("passwd -> /proc: %d %s", code, out)
	}
	sh(t, id, "rm /etc/passwd && cp /tmp/pw /etc/passwd && dd if=/dev/zero bs=1M count=5 2>/dev/null | tr '\\0' x >> /etc/passwd")
	if out, code := run(nil, "exec", "--user", "user", id, "--", "true"); code == 0 || !strings.Contains(out, "larger than") {
		t.Fatalf("huge passwd: %d %s", code, out)
	}
	// Root needs no lookup.
	shoalOK(t, "exec", id, "--", "true")
}

package agent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// userDB points the agent's passwd and group files at a directory of the
// test's and restores them afterwards.
func userDB(t *testing.T, passwd, group string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "users")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	os.Chmod(dir, 0o755)
	if passwd != "" {
		os.WriteFile(filepath.Join(dir, "passwd"), []byte(passwd), 0o644)
	}
	if group != "" {
		os.WriteFile(filepath.Join(dir, "group"), []byte(group), 0o644)
	}
	op, og := passwdPath, groupPath
	passwdPath, groupPath = filepath.Join(dir, "passwd"), filepath.Join(dir, "group")
	t.Cleanup(func() { passwdPath, groupPath = op, og })
	return dir
}

func TestLookupUser(t *testing.T) {
	userDB(t, "root:x:0:0:root:/root:/bin/sh\n"+
		"garbage line\n"+
		"bad:x:notanumber:1:::\n"+
		"huge:x:4294967295:1::/h:/bin/sh\n"+
		"::::::\n"+
		"user:x:1000:1000:User:/home/user:/bin/bash\n"+
		"rel:x:1001:1001::relative/home:/bin/sh\n",
		"root:x:0:\nuser:x:1000:\nsudo:x:27:user,other\nmalformed\nusers:x:100:other,user\nsudo2:x:27:user\n")
	u, werr := lookupUser("user")
	if werr != nil {
		t.Fatal(werr.Msg)
	}
	if u.UID != 1000 || u.GID != 1000 || u.Home != "/home/user" || u.Shell != "/bin/bash" {
		t.Fatalf("user = %+v", u)
	}
	if want := []uint32{1000, 27, 100}; !equalU32(u.Groups, want) {
		t.Fatalf("groups = %v, want %v", u.Groups, want)
	}
	if u, werr := lookupUser("rel"); werr != nil || u.Home != "/" {
		t.Fatalf("relative home: %+v %v", u, werr)
	}
	if u, werr := lookupUser("4321"); werr != nil || u.UID != 4321 || u.GID != 4321 || u.Home != "/" {
		t.Fatalf("numeric user: %+v %v", u, werr)
	}
	for _, name := range []string{"bad", "huge", "nobody", "", "a:b", "x\n", strings.Repeat("a", 300)} {
		if _, werr := lookupUser(name); werr == nil {
			t.Errorf("lookupUser(%.20q) succeeded", name)
		}
	}
}

func equalU32(a, b []uint32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestLookupUserHostile: the sandbox's /etc/passwd is the workload's; a huge
// one, a fifo, a device or a symlink into /proc is refused, quickly.
func TestLookupUserHostile(t *testing.T) {
	notFile := "not a regular file"
	cases := map[string]struct {
		mk   func(p string) error
		want string // in the error
	}{
		"huge": {func(p string) error {
			f, err := os.Create(p)
			if err != nil {
				return err
			}
			defer f.Close()
			return f.Truncate(maxUserDB + 1) // sparse
		}, "larger than 4 MiB"},
		"fifo":      {func(p string) error { return syscall.Mkfifo(p, 0o644) }, notFile},
		"proc":      {func(p string) error { return os.Symlink("/proc/self/environ", p) }, notFile},
		"sys":       {func(p string) error { return os.Symlink("/sys/kernel/uevent_seqnum", p) }, notFile},
		"dev-zero":  {func(p string) error { return os.Symlink("/dev/zero", p) }, notFile},
		"directory": {func(p string) error { return os.Mkdir(p, 0o755) }, notFile},
		"self-loop": {func(p string) error { return os.Symlink(p, p) }, "too many levels"},
		"long-line": {func(p string) error {
			return os.WriteFile(p, []byte("other:x:1:1::/:"+strings.Repeat("x", 3<<20)+"\n"), 0o644)
		}, "no such user"},
		"no-newlines": {func(p string) error { return os.WriteFile(p, []byte(strings.Repeat(":", 1<<20)), 0o644) }, "no such user"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			dir := userDB(t, "", "")
			if err := tc.mk(filepath.Join(dir, "passwd")); err != nil {
				t.Skipf("cannot make the file: %v", err)
			}
			done := make(chan *wireError, 1)
			go func() { _, werr := lookupUser("user"); done <- werr }()
			select {
			case werr := <-done:
				if werr == nil || !strings.Contains(werr.Msg, tc.want) {
					t.Fatalf("lookup: %v, want an error saying %q", werr, tc.want)
				}
			case <-time.After(10 * time.Second): // hang detector
				t.Fatal("lookup hangs")
			}
		})
	}
}

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (setuid, chown)")
	}
}

// userFixture: a user "tuser" (4242:4242, also in group 4343 "extra") with
// a home of its own, and a directory only root may write.
func userFixture(t *testing.T) (home, rootOnly string) {
	t.Helper()
	requireRoot(t)
	dir, err := os.MkdirTemp("", "home")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	os.Chmod(dir, 0o755)
	home = filepath.Join(dir, "tuser")
	rootOnly = filepath.Join(dir, "rootonly")
	os.Mkdir(home, 0o700)
	os.Chown(home, 4242, 4242)
	os.Mkdir(rootOnly, 0o755)
	userDB(t, "root:x:0:0::/root:/bin/sh\ntuser:x:4242:4242::"+home+":/bin/sh\n",
		"root:x:0:\ntuser:x:4242:\nextra:x:4343:someone,tuser\n")
	return home, rootOnly
}

func TestExecAsUser(t *testing.T) {
	home, _ := userFixture(t)
	c := startAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	script := `echo "$(id -u) $(id -g) $(id -G) $(pwd) $HOME $USER $LOGNAME"`
	for _, cl := range []*Client{c.AsUser("tuser"), c} {
		req := ExecRequest{Args: []string{"/bin/sh", "-c", script}}
		if cl == c {
			req.User = "tuser" // the request's own user
		}
		p, err := cl.Exec(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		r := collect(t, p)
		want := "4242 4242 4242 4343 " + home + " " + home + " tuser tuser\n"
		if r.stdout != want || r.exit.Code != 0 {
			t.Fatalf("as tuser: %q (stderr %q, exit %d), want %q", r.stdout, r.stderr, r.exit.Code, want)
		}
	}
	// A durable command under a pty, too.
	att, err := c.AsUser("tuser").Start(ctx, StartRequest{ExecRequest: ExecRequest{Args: []string{"/bin/sh", "-c", "id -u; pwd"}}, PTY: &Winsize{Rows: 24, Cols: 80}})
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	for {
		rec, err := att.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if rec.Exit != nil {
			break
		}
		out.Write(rec.Data)
	}
	att.Close()
	if got := strings.ReplaceAll(out.String(), "\r", ""); got != "4242\n"+home+"\n" {
		t.Fatalf("pty as tuser: %q", got)
	}
	// Root stays the default.
	p, err := c.Exec(ctx, ExecRequest{Args: []string{"id", "-u"}})
	if err != nil {
		t.Fatal(err)
	}
	if r := collect(t, p); r.stdout != "0\n" {
		t.Fatalf("default user: %q", r.stdout)
	}
	if _, err := c.AsUser("nosuchuser").Exec(ctx, ExecRequest{Args: []string{"true"}}); !errors.Is(err, fs.ErrInvalid) || !strings.Contains(err.Error(), "no such user") {
		t.Fatalf("unknown user: %v", err)
	}
}

func TestFilesAsUser(t *testing.T) {
	home, rootOnly := userFixture(t)
	c := startAgent(t)
	u := c.AsUser("tuser")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	owner := func(p string) (uint32, uint32) {
		var st syscall.Stat_t
		if err := syscall.Lstat(p, &st); err != nil {
			t.Fatal(err)
		}
		return st.Uid, st.Gid
	}
	f := filepath.Join(home, "sub", "a.txt")
	if _, err := u.WriteFile(ctx, f, 0, strings.NewReader("hi")); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{f, filepath.Dir(f)} {
		if uid, gid := owner(p); uid != 4242 || gid != 4242 {
			t.Fatalf("%s owned by %d:%d, want 4242:4242", p, uid, gid)
		}
	}
	if err := u.MakeDir(ctx, filepath.Join(home, "d1", "d2"), 0); err != nil {
		t.Fatal(err)
	}
	if uid, _ := owner(filepath.Join(home, "d1")); uid != 4242 {
		t.Fatalf("mkdir as tuser: owned by %d", uid)
	}
	// The user's permissions are checked: root's directory is not theirs.
	if _, err := u.WriteFile(ctx, filepath.Join(rootOnly, "x"), 0, strings.NewReader("x")); !errors.Is(err, fs.ErrPermission) {
		t.Fatalf("write into root's directory as tuser: %v", err)
	}
	if err := u.Remove(ctx, rootOnly, true); !errors.Is(err, fs.ErrPermission) {
		t.Fatalf("remove root's directory as tuser: %v", err)
	}
	// ...and the agent is root again afterwards, on every thread.
	for i := 0; i < 20; i++ {
		if _, err := c.WriteFile(ctx, filepath.Join(rootOnly, "r"), 0, strings.NewReader("r")); err != nil {
			t.Fatalf("write as root after the user's calls: %v", err)
		}
	}
	if uid, _ := owner(filepath.Join(rootOnly, "r")); uid != 0 {
		t.Fatalf("root's file owned by %d", uid)
	}
	// Entries carry owner and group, by name.
	ents, err := c.ListDir(ctx, filepath.Dir(home))
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]string{}
	for _, e := range ents {
		seen[e.Name] = e.Owner + ":" + e.Group
	}
	if seen["tuser"] != "tuser:tuser" || seen["rootonly"] != "root:root" {
		t.Fatalf("owners: %v", seen)
	}
	fi, err := c.Stat(ctx, f)
	if err != nil || fi.UID != 4242 || fi.Owner != "tuser" {
		t.Fatalf("stat: %+v %v", fi, err)
	}
	tree, err := c.ListTree(ctx, home, 3)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range tree {
		if e.Owner != "tuser" {
			t.Fatalf("tree entry %s owned by %q", e.Path, e.Owner)
		}
	}
}

// An owning client acts as root and gives what it creates to the user, as
// E2B's envd does: a directory only root may write takes the user's file.
func TestFilesOwning(t *testing.T) {
	home, rootOnly := userFixture(t)
	c := startAgent(t)
	o := c.Owning("tuser")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	owner := func(p string) string {
		var st syscall.Stat_t
		if err := syscall.Lstat(p, &st); err != nil {
			t.Fatal(err)
		}
		return fmt.Sprintf("%d:%d %o", st.Uid, st.Gid, st.Mode&0o7777)
	}
	f := filepath.Join(rootOnly, "new", "deep", "a.txt")
	if _, err := o.WriteFile(ctx, f, 0o755|fs.ModeSetuid, strings.NewReader("hi")); err != nil {
		t.Fatalf("write into root's directory, owned by tuser: %v", err)
	}
	// The mode is applied after the chown, which would clear setuid.
	for p, want := range map[string]string{f: "4242:4242 4755", filepath.Dir(f): "4242:4242 755", filepath.Dir(filepath.Dir(f)): "4242:4242 755", rootOnly: "0:0 755"} {
		if got := owner(p); got != want {
			t.Errorf("%s: %s, want %s", p, got, want)
		}
	}
	if err := o.MakeDir(ctx, filepath.Join(rootOnly, "m1", "m2"), 0); err != nil {
		t.Fatal(err)
	}
	if got := owner(filepath.Join(rootOnly, "m1", "m2")); got != "4242:4242 755" {
		t.Errorf("mkdir: %s", got)
	}
	// Root's reach: a file only root may read.
	secret := filepath.Join(rootOnly, "secret")
	os.WriteFile(secret, []byte("s"), 0o600)
	if rc, _, err := o.ReadFile(ctx, secret); err != nil {
		t.Fatalf("read root's file: %v", err)
	} else {
		rc.Close()
	}
	if _, _, err := c.AsUser("tuser").ReadFile(ctx, secret); !errors.Is(err, fs.ErrPermission) {
		t.Fatalf("as the user, root's file: %v", err)
	}
	// A directory that exists keeps its owner; an unknown owner is invalid.
	if _, err := o.WriteFile(ctx, filepath.Join(home, "b.txt"), 0, strings.NewReader("b")); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Owning("nosuchuser").WriteFile(ctx, filepath.Join(home, "c.txt"), 0, strings.NewReader("c")); !errors.Is(err, fs.ErrInvalid) {
		t.Fatalf("unknown owner: %v", err)
	}
	if _, err := os.Stat(filepath.Join(home, "c.txt")); !os.IsNotExist(err) {
		t.Fatalf("a write for an unknown owner left %v", err)
	}
}

func TestLookupUserOp(t *testing.T) {
	home, _ := userFixture(t)
	c := startAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	u, err := c.LookupUser(ctx, "tuser")
	if err != nil || u.UID != 4242 || u.Home != home || len(u.Groups) != 2 {
		t.Fatalf("LookupUser: %+v %v", u, err)
	}
	if _, err := c.LookupUser(ctx, "nosuch"); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("LookupUser(nosuch): %v", err)
	}
	if _, err := c.AsUser("nosuch").Stat(ctx, "/"); !errors.Is(err, fs.ErrInvalid) {
		t.Fatalf("Stat as nosuch: %v", err)
	}
}

// BenchmarkLookupUser: what naming a user adds to a command or a file
// operation (both files read and parsed), with a 1,000-line /etc/passwd.
func BenchmarkLookupUser(b *testing.B) {
	var pw, gr strings.Builder
	for i := range 1000 {
		fmt.Fprintf(&pw, "u%d:x:%d:%d::/home/u%d:/bin/sh\n", i, 2000+i, 2000+i, i)
		fmt.Fprintf(&gr, "g%d:x:%d:u%d,u%d\n", i, 2000+i, i, i+1)
	}
	dir := b.TempDir()
	os.WriteFile(filepath.Join(dir, "passwd"), []byte(pw.String()), 0o644)
	os.WriteFile(filepath.Join(dir, "group"), []byte(gr.String()), 0o644)
	op, og := passwdPath, groupPath
	passwdPath, groupPath = filepath.Join(dir, "passwd"), filepath.Join(dir, "group")
	defer func() { passwdPath, groupPath = op, og }()
	for b.Loop() {
		if _, werr := lookupUser("u999"); werr != nil {
			b.Fatal(werr.Msg)
		}
	}
}

// TestWatchAsUser: a watch is armed with the user's permissions: a
// directory the user may not read cannot be watched as the user (it can
// as root), one it may read can, and its events arrive.
func TestWatchAsUser(t *testing.T) {
	home, _ := userFixture(t)
	c := startAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	private := filepath.Join(filepath.Dir(home), "private")
	if err := os.Mkdir(private, 0o700); err != nil {
		t.Fatal(err)
	}
	if _, err := c.AsUser("tuser").Watch(ctx, private, true); !errors.Is(err, fs.ErrPermission) {
		t.Fatalf("watch root's 0700 directory as tuser: %v, want permission denied", err)
	}
	w, err := c.Watch(ctx, private, true)
	if err != nil {
		t.Fatalf("the same as root: %v", err)
	}
	w.Close()
	if _, err := c.AsUser("nosuchuser").Watch(ctx, home, false); !errors.Is(err, fs.ErrInvalid) {
		t.Fatalf("watch as an unknown user: %v", err)
	}
	w, err = c.AsUser("tuser").Watch(ctx, home, true)
	if err != nil {
		t.Fatalf("watch the user's home as the user: %v", err)
	}
	defer w.Close()
	if err := os.WriteFile(filepath.Join(home, "new"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	ev, err := w.Next()
	if err != nil || ev.Op != WatchCreate || ev.Path != filepath.Join(home, "new") {
		t.Fatalf("event %+v, %v; want create of %s", ev, err, filepath.Join(home, "new"))
	}
}

package agent

// Users of the sandbox. A command or a file operation may name a user; the
// agent resolves the name in the sandbox's own /etc/passwd and /etc/group
// (never the host's: the agent runs inside the sandbox's root), and runs the
// command with that uid, gid and supplementary groups, HOME, USER and
// LOGNAME, starting in the user's home; a file operation runs with that
// user's file-system identity (setfsuid/setfsgid and the groups on the
// agent thread that serves it), so the kernel checks the user's
// permissions and what it creates belongs to the user. Inside a user
// namespace these are the sandbox's ids, which the kernel maps.
//
// The files are the workload's: /etc/passwd may be huge, malformed, a fifo,
// or a symlink to /proc or /dev. They are opened without blocking, must be
// regular files and not of the kernel's pseudo file systems (/proc, /sys),
// are read up to maxUserDB bytes (a larger file is refused, not cut), and
// malformed lines are skipped.

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// maxUserDB bounds what is read of /etc/passwd and /etc/group.
const maxUserDB = 4 << 20

// maxGroups bounds a user's supplementary groups (the kernel's NGROUPS_MAX).
const maxGroups = 65536

// maxUserName bounds a user name in a request.
const maxUserName = 256

// userInfo is a resolved user.
type userInfo struct {
	Name   string   `json:"name"`
	UID    uint32   `json:"uid"`
	GID    uint32   `json:"gid"`
	Home   string   `json:"home"`
	Shell  string   `json:"shell,omitempty"`
	Groups []uint32 `json:"groups,omitempty"` // supplementary, the primary gid included
}

type wireUserRequest struct {
	User string `json:"user"`
}

// The files users are read from (variables for the tests).
var (
	passwdPath = "/etc/passwd"
	groupPath  = "/etc/group"
)

// lookupUser resolves name in the sandbox's passwd and group files. A name
// that is all digits and not in passwd is taken as a uid (gid the same,
// home "/"), as docker's --user does.
func lookupUser(name string) (*userInfo, *wireError) {
	if name == "" || len(name) > maxUserName || strings.ContainsAny(name, ":\n\x00") {
		return nil, &wireError{Code: CodeInvalid, Msg: "user " + strconv.Quote(truncName(name)) + ": not a valid user name"}
	}
	pw, err := readUserDB(passwdPath)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, &wireError{Code: codeOf(err), Msg: "user " + name + ": read " + passwdPath + ": " + reason(err)}
	}
	u := findPasswd(pw, name)
	if u == nil {
		n, perr := strconv.ParseUint(name, 10, 32)
		if perr != nil || n == 1<<32-1 {
			return nil, &wireError{Code: CodeNotExist, Msg: "user " + name + ": no such user in the sandbox's " + passwdPath}
		}
		u = &userInfo{Name: name, UID: uint32(n), GID: uint32(n), Home: "/"}
	}
	gr, err := readUserDB(groupPath)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, &wireError{Code: codeOf(err), Msg: "user " + name + ": read " + groupPath + ": " + reason(err)}
	}
	u.Groups = findGroups(gr, u.Name, u.GID)
	return u, nil
}

// requestUserErr is the error of a command or file operation whose user
// does not exist: the request is invalid (a not_exist would read as the
// command's or the file's absence).
func requestUserErr(werr *wireError) *wireError {
	if werr.Code == CodeNotExist {
		return &wireError{Code: CodeInvalid, Msg: werr.Msg}
	}
	return werr
}

func truncName(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return s
}

// errUserDB is a passwd or group file that is not a plain file.
var errUserDB = errors.New("not a regular file (a device, a fifo, a directory, or a file of /proc or /sys)")

// pseudoFS are the kernel's file systems whose "regular" files are not
// files (their content is made when read, their size says nothing).
var pseudoFS = map[int64]bool{
	unix.PROC_SUPER_MAGIC: true, unix.SYSFS_MAGIC: true, unix.CGROUP_SUPER_MAGIC: true,
	unix.CGROUP2_SUPER_MAGIC: true, unix.DEBUGFS_MAGIC: true, unix.SECURITYFS_MAGIC: true,
	unix.TRACEFS_MAGIC: true, unix.BPF_FS_MAGIC: true, unix.DEVPTS_SUPER_MAGIC: true,
	unix.EFIVARFS_MAGIC: true, unix.PSTOREFS_MAGIC: true,
}

// readUserDB reads a passwd-format file, bounded (see the package comment
// above).
func readUserDB(path string) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_NOCTTY, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, err
	}
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(int(f.Fd()), &sfs); err != nil {
		return nil, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || pseudoFS[int64(sfs.Type)] {
		return nil, errUserDB
	}
	if st.Size > maxUserDB {
		return nil, &os.PathError{Op: "read", Path: path, Err: errTooLarge}
	}
	b, err := io.ReadAll(io.LimitReader(f, maxUserDB+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxUserDB {
		return nil, &os.PathError{Op: "read", Path: path, Err: errTooLarge}
	}
	return b, nil
}

var errTooLarge = errors.New("larger than 4 MiB")

// findPasswd returns name's entry of a passwd file (name:pw:uid:gid:gecos:home:shell).
func findPasswd(db []byte, name string) *userInfo {
	sc := bufio.NewScanner(bytes.NewReader(db))
	sc.Buffer(make([]byte, 0, 4096), maxUserDB)
	prefix := []byte(name + ":")
	for sc.Scan() {
		if !bytes.HasPrefix(sc.Bytes(), prefix) {
			continue
		}
		f := strings.Split(sc.Text(), ":")
		if len(f) < 7 {
			continue
		}
		uid, err1 := strconv.ParseUint(f[2], 10, 32)
		gid, err2 := strconv.ParseUint(f[3], 10, 32)
		if err1 != nil || err2 != nil || uid == 1<<32-1 || gid == 1<<32-1 {
			continue
		}
		home := f[5]
		if !strings.HasPrefix(home, "/") {
			home = "/"
		}
		return &userInfo{Name: name, UID: uint32(uid), GID: uint32(gid), Home: home, Shell: f[6]}
	}
	return nil
}

// findGroups returns gid and the gids of the groups (name:pw:gid:members)
// that list name as a member, without duplicates, at most maxGroups.
func findGroups(db []byte, name string, gid uint32) []uint32 {
	out := []uint32{gid}
	seen := map[uint32]bool{gid: true}
	sc := bufio.NewScanner(bytes.NewReader(db))
	sc.Buffer(make([]byte, 0, 4096), maxUserDB)
	nb := []byte(name)
	for sc.Scan() && len(out) < maxGroups {
		if !bytes.Contains(sc.Bytes(), nb) {
			continue // not a member: the cheap test first
		}
		f := strings.Split(sc.Text(), ":")
		if len(f) < 4 {
			continue
		}
		g, err := strconv.ParseUint(f[2], 10, 32)
		if err != nil || g == 1<<32-1 || seen[uint32(g)] {
			continue
		}
		for _, m := range strings.Split(f[3], ",") {
			if m == name {
				seen[uint32(g)] = true
				out = append(out, uint32(g))
				break
			}
		}
	}
	return out
}

// userEnv is the environment a user's command starts with (before the
// request's own entries, which override it).
func (u *userInfo) env() []string {
	return []string{"HOME=" + u.Home, "USER=" + u.Name, "LOGNAME=" + u.Name}
}

// credential is the user's identity for a new process.
func (u *userInfo) credential() *syscall.Credential {
	return &syscall.Credential{Uid: u.UID, Gid: u.GID, Groups: u.Groups}
}

// lookupUserOp serves OpUser: R(userInfo) | X.
func lookupUserOp(c net.Conn, req *wireUserRequest) {
	u, werr := lookupUser(req.User)
	if werr != nil {
		writeJSONFrame(c, FrameError, werr)
		return
	}
	writeJSONFrame(c, FrameReply, u)
}

// asUser runs fn with the file-system identity of user (nothing changes
// when user is ""): it locks the goroutine to its thread and sets that
// thread's fsuid, fsgid and supplementary groups, so the kernel checks the
// user's permissions and new files belong to the user; then it restores
// them. If they cannot be restored, the thread is left locked and dies with
// the goroutine, never serving anything else.
func asUser(c net.Conn, user string, fn func()) {
	if user == "" {
		fn()
		return
	}
	u, werr := lookupUser(user)
	if werr != nil {
		writeJSONFrame(c, FrameError, requestUserErr(werr))
		return
	}
	runtime.LockOSThread()
	restored := false
	defer func() {
		if restored {
			runtime.UnlockOSThread()
		}
	}()
	groups, err := unix.Getgroups()
	if err != nil {
		sendError(c, CodeIO, "getgroups: "+err.Error())
		restored = true
		return
	}
	uid, gid := unix.Getuid(), unix.Getgid()
	restore := func() bool {
		unix.Setfsuid(uid)
		unix.Setfsgid(gid)
		if unix.Setgroups(groups) != nil {
			return false
		}
		cu, _ := unix.SetfsuidRetUid(-1)
		cg, _ := unix.SetfsgidRetGid(-1)
		return cu == uid && cg == gid
	}
	gs := make([]int, len(u.Groups))
	for i, g := range u.Groups {
		gs[i] = int(g)
	}
	if err := unix.Setgroups(gs); err != nil {
		restored = restore()
		sendError(c, codeOf(err), "user "+u.Name+": setgroups: "+err.Error())
		return
	}
	unix.Setfsgid(int(u.GID))
	unix.Setfsuid(int(u.UID))
	if cu, _ := unix.SetfsuidRetUid(-1); cu != int(u.UID) {
		restored = restore()
		sendError(c, CodePermission, "user "+u.Name+": setfsuid refused")
		return
	}
	if cg, _ := unix.SetfsgidRetGid(-1); cg != int(u.GID) {
		restored = restore()
		sendError(c, CodePermission, "user "+u.Name+": setfsgid refused")
		return
	}
	defer func() { restored = restore() }()
	fn()
}

// idNames maps uids and gids to names for one listing or stat, reading the
// sandbox's passwd and group files (bounded as above) the first time an id
// is looked up. Not safe for concurrent use.
//
// xattrs: entries also carry their user.* extended attributes (xattrs.go).
type idNames struct {
	xattrs bool
	loaded bool
	users  map[uint32]string
	groups map[uint32]string
}

func (n *idNames) load() {
	n.loaded = true
	n.users = idMap(passwdPath)
	n.groups = idMap(groupPath)
}

// idMap reads the name → id column (the third) of a passwd-format file; the
// first line for an id wins.
func idMap(path string) map[uint32]string {
	m := map[uint32]string{}
	db, err := readUserDB(path)
	if err != nil {
		return m
	}
	sc := bufio.NewScanner(bytes.NewReader(db))
	sc.Buffer(make([]byte, 0, 4096), maxUserDB)
	for sc.Scan() {
		f := strings.SplitN(sc.Text(), ":", 4)
		if len(f) < 4 || f[0] == "" {
			continue
		}
		id, err := strconv.ParseUint(f[2], 10, 32)
		if err != nil {
			continue
		}
		if _, dup := m[uint32(id)]; !dup {
			m[uint32(id)] = f[0]
		}
	}
	return m
}

// fill sets w's owner and group names from its uid and gid (a number when
// the id has no name).
func (n *idNames) fill(w *wireFileInfo) {
	if n == nil || w.UID == nil || w.GID == nil {
		return
	}
	if !n.loaded {
		n.load()
	}
	w.Owner, w.Group = n.users[*w.UID], n.groups[*w.GID]
	if w.Owner == "" {
		w.Owner = strconv.FormatUint(uint64(*w.UID), 10)
	}
	if w.Group == "" {
		w.Group = strconv.FormatUint(uint64(*w.GID), 10)
	}
}

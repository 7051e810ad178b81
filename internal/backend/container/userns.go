package container

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/forkserver"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// User namespaces.
//
// With user namespaces on (Config.UserNS), every container (a cold
// sandbox's, or a pool member's from its start) gets a user namespace of
// its own that maps its ids 0..65535 to a range of host ids no one else
// uses: slot n is [UserNSBase + n*65536, +65536). Its root is then an
// unprivileged host uid: what it owns on the host is its writable layer,
// its capabilities hold only over what its namespaces own, and a process
// that escaped its mount namespace would be a stranger to every host file.
//
// The layers are EROFS images whose files are owned by the sandbox's ids
// (0 for root): each lower of the overlay is a private clone of the
// layer's shared mount, idmapped (mount_setattr MOUNT_ATTR_IDMAP) by the
// slot's mapping, so that the sandbox sees its files owned by its own root
// (layer.ComposeFDMapped). The upper is a plain directory owned by the
// slot's root: what the sandbox writes is stored with host ids of its
// range, and a commit shifts them back (layer.CommitOptions.IDMap).
//
// Slots are files of Config.UserNSDir (default /run/shoal/userns), one per
// slot in use, created with O_EXCL and naming the state dir and runc
// container that hold it: slots are unique on the host, across nodes and
// restarts. A slot is released when its container is destroyed (no task
// left); New releases the slots of its state dir whose container is gone.
//
// The idmapped mounts need a user namespace of the slot's mapping: one is
// made per slot, once (a short-lived child process in a new user
// namespace, whose namespace the node keeps open), and reused by every
// sandbox that gets the slot later.

// User namespace modes (Config.UserNS).
const (
	UserNSAuto = "auto" // on when the kernel supports it, else off (with a warning)
	UserNSOn   = "on"   // on; New fails when the kernel does not support it
	UserNSOff  = "off"  // off: sandbox root is host root
)

// Defaults of the user namespace ranges.
const (
	DefaultUserNSBase = 1 << 30 // far above the ids of /etc/subuid ranges
	DefaultUserNSDir  = "/run/shoal/userns"
	usernsSize        = 65536 // ids per sandbox: 0..65535 (nobody is 65534)
)

// usernsSlots allocates the id ranges of containers and keeps one user
// namespace per slot for idmapped mounts.
type usernsSlots struct {
	base     uint32
	max      int    // slots: 0..max-1
	dir      string // slot files
	stateDir string // ours: the runtime state dir written in our slot files
	helper   string // a program that blocks reading stdin (cat)

	mu    sync.Mutex
	owned map[string]int // guarded by mu; runc id -> slot
	used  map[int]string // guarded by mu; slot -> runc id
	fds   map[int]int    // guarded by mu; slot -> user namespace fd
}

func newUsernsSlots(base uint32, dir, stateDir string) (*usernsSlots, error) {
	if base == 0 {
		return nil, errors.New("user namespace base must not be 0 (host root)")
	}
	n := (uint64(1)<<32 - 1 - uint64(base)) / usernsSize
	if n == 0 {
		return nil, fmt.Errorf("user namespace base %d leaves no room for a range of %d ids", base, usernsSize)
	}
	helper, err := exec.LookPath("cat")
	if err != nil {
		return nil, fmt.Errorf("user namespaces: %w", err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("user namespaces: %w", err)
	}
	return &usernsSlots{base: base, max: int(n), dir: dir, stateDir: stateDir, helper: helper,
		owned: map[string]int{}, used: map[int]string{}, fds: map[int]int{}}, nil
}

// idmap is the host range of slot.
func (u *usernsSlots) idmap(slot int) sandbox.IDMap {
	h := u.base + uint32(slot)*usernsSize
	return sandbox.IDMap{HostUID: h, HostGID: h, Size: usernsSize}
}

func (u *usernsSlots) slotFile(slot int) string {
	return filepath.Join(u.dir, strconv.Itoa(slot))
}

// load takes back the slots of our state dir that earlier processes
// recorded (before the pool sweep, which releases those it destroys).
func (u *usernsSlots) load() error {
	ents, err := os.ReadDir(u.dir)
	if err != nil {
		return fmt.Errorf("user namespaces: %w", err)
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	for _, e := range ents {
		slot, err := strconv.Atoi(e.Name())
		if err != nil || slot < 0 || slot >= u.max {
			continue
		}
		data, err := os.ReadFile(u.slotFile(slot))
		if err != nil {
			continue
		}
		state, id, _ := strings.Cut(strings.TrimSpace(string(data)), "\n")
		if state != u.stateDir || checkID(id) != nil {
			// Another node's, unless its state dir is gone (its data was
			// removed): nobody can run or delete its containers any more.
			if _, err := os.Stat(state); errors.Is(err, fs.ErrNotExist) && filepath.IsAbs(state) {
				os.Remove(u.slotFile(slot))
			}
			continue
		}
		u.owned[id], u.used[slot] = slot, id
	}
	return nil
}

// prune releases the slots whose container the runtime no longer has.
func (u *usernsSlots) prune(hasState func(id string) bool) {
	u.mu.Lock()
	var gone []string
	for id := range u.owned {
		if !hasState(id) {
			gone = append(gone, id)
		}
	}
	u.mu.Unlock()
	for _, id := range gone {
		u.release(id)
	}
}

// alloc gives runcID a slot (the same one if it has one already).
func (u *usernsSlots) alloc(runcID string) (int, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if slot, ok := u.owned[runcID]; ok {
		return slot, nil
	}
	for slot := 0; slot < u.max; slot++ {
		if _, ok := u.used[slot]; ok {
			continue
		}
		f, err := os.OpenFile(u.slotFile(slot), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if errors.Is(err, fs.ErrExist) {
			continue // another node's
		}
		if err != nil {
			return 0, fmt.Errorf("user namespace slot: %w", err)
		}
		_, err = f.WriteString(u.stateDir + "\n" + runcID + "\n")
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			os.Remove(f.Name())
			return 0, fmt.Errorf("user namespace slot: %w", err)
		}
		u.owned[runcID], u.used[slot] = slot, runcID
		return slot, nil
	}
	return 0, fmt.Errorf("user namespace slot: all %d ranges are in use", u.max)
}

// slotOf returns runcID's slot.
func (u *usernsSlots) slotOf(runcID string) (int, bool) {
	u.mu.Lock()
	defer u.mu.Unlock()
	slot, ok := u.owned[runcID]
	return slot, ok
}

// release frees runcID's slot, if it has one. Call it only once no task
// of the container is left.
func (u *usernsSlots) release(runcID string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	slot, ok := u.owned[runcID]
	if !ok {
		return
	}
	delete(u.owned, runcID)
	delete(u.used, slot)
	os.Remove(u.slotFile(slot))
}

// releaseRange frees the slot of range m if runcID holds it, also when
// this process did not reserve it (a create by an earlier process, in the
// same state dir, that the caller learnt of from a handle).
func (u *usernsSlots) releaseRange(runcID string, m *sandbox.IDMap) {
	u.release(runcID)
	if m == nil || m.HostUID < u.base || (m.HostUID-u.base)%usernsSize != 0 {
		return
	}
	slot := int((m.HostUID - u.base) / usernsSize)
	u.mu.Lock()
	defer u.mu.Unlock()
	if _, ok := u.used[slot]; ok {
		return // another container's now
	}
	if data, err := os.ReadFile(u.slotFile(slot)); err == nil && string(data) == u.stateDir+"\n"+runcID+"\n" {
		os.Remove(u.slotFile(slot))
	}
}

// nsFD returns a user namespace of slot's mapping (owned by u: do not
// close it), for idmapped mounts.
//
// starter, when not nil, starts the namespace's helper: a fork server, so
// that the node does not fork itself (forkserver).
func (u *usernsSlots) nsFD(slot int, starter *forkserver.Client) (int, error) {
	u.mu.Lock()
	fd, ok := u.fds[slot]
	u.mu.Unlock()
	if ok {
		return fd, nil
	}
	m := u.idmap(slot)
	fd, err := newUserns(u.helper, m, starter)
	if err != nil && starter != nil {
		// A fork of the node, as without a fork server: slower (the node's
		// next writes fault), never worse.
		fd, err = newUserns(u.helper, m, nil)
	}
	if err != nil {
		return -1, err
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	if old, ok := u.fds[slot]; ok { // made meanwhile by another create
		unix.Close(fd)
		return old, nil
	}
	u.fds[slot] = fd
	return fd, nil
}

// close closes the kept user namespaces.
func (u *usernsSlots) close() {
	u.mu.Lock()
	defer u.mu.Unlock()
	for slot, fd := range u.fds {
		unix.Close(fd)
		delete(u.fds, slot)
	}
}

// newUserns returns a descriptor of a new user namespace of mapping m: a
// child (helper, blocked reading a pipe) is started in it, by starter if
// not nil, its namespace opened, and the child ended.
func newUserns(helper string, m sandbox.IDMap, starter *forkserver.Client) (int, error) {
	r, w, err := os.Pipe()
	if err != nil {
		return -1, fmt.Errorf("user namespace: %w", err)
	}
	defer w.Close()
	if starter != nil {
		return newUsernsVia(starter, helper, m, r)
	}
	uids, gids := idMaps(m)
	cmd := exec.Command(helper)
	cmd.Stdin = r
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  syscall.CLONE_NEWUSER,
		UidMappings: uids,
		GidMappings: gids,
		Pdeathsig:   syscall.SIGKILL,
	}
	err = cmd.Start()
	r.Close()
	if err != nil {
		return -1, fmt.Errorf("user namespace: start %s in it: %w", helper, err)
	}
	defer cmd.Wait()
	defer cmd.Process.Kill()
	fd, err := unix.Open("/proc/"+strconv.Itoa(cmd.Process.Pid)+"/ns/user", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("user namespace: %w", err)
	}
	return fd, nil
}

// newUserns through a fork server: the helper is its child, pinned here
// by a pidfd; it reads r (and exits at EOF, should the node die).
func newUsernsVia(starter *forkserver.Client, helper string, m sandbox.IDMap, r *os.File) (int, error) {
	devNull, err := os.Open(os.DevNull)
	if err != nil {
		r.Close()
		return -1, fmt.Errorf("user namespace: %w", err)
	}
	defer devNull.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	uids, gids := idMaps(m)
	p, err := starter.Start(ctx, forkserver.Request{
		Path: helper, Args: []string{helper}, Dir: "/",
		Cloneflags: syscall.CLONE_NEWUSER, UidMappings: uids, GidMappings: gids,
	}, []*os.File{r, devNull, devNull})
	r.Close()
	if err != nil {
		return -1, fmt.Errorf("user namespace: start %s in it: %w", helper, err)
	}
	defer p.Close()
	defer p.Kill()
	fd, err := unix.Open("/proc/"+strconv.Itoa(p.Pid)+"/ns/user", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("user namespace: %w", err)
	}
	// Still running after the open: the pid was the helper's, not a
	// process that reused it.
	if err := unix.PidfdSendSignal(p.PidFD, 0, nil, 0); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("user namespace: helper %s: %w", helper, err)
	}
	return fd, nil
}

// idMaps are the uid and gid maps of a user namespace of range m: its 0
// is m's first host id.
func idMaps(m sandbox.IDMap) (uids, gids []syscall.SysProcIDMap) {
	return []syscall.SysProcIDMap{{ContainerID: 0, HostID: int(m.HostUID), Size: int(m.Size)}},
		[]syscall.SysProcIDMap{{ContainerID: 0, HostID: int(m.HostGID), Size: int(m.Size)}}
}

// probeUserns checks that this kernel can run sandboxes in user
// namespaces with idmapped layers (layer.ProbeIDMapped).
func (u *usernsSlots) probe(scratch string) error {
	// A range of its own: slot fds are for slots.
	m := u.idmap(0)
	fd, err := newUserns(u.helper, m, nil)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return layer.ProbeIDMapped(scratch, fd, m.HostUID)
}

// chownToRoot gives path (created by the host for the sandbox: its upper,
// its /tmp, a pool container's blank root) to the sandbox's root.
func chownToRoot(path string, m *sandbox.IDMap) error {
	if m == nil {
		return nil
	}
	if err := os.Lchown(path, int(m.HostUID), int(m.HostGID)); err != nil {
		return fmt.Errorf("give %s to the sandbox's root: %w", filepath.Base(path), err)
	}
	return nil
}

// traversable lets every user search (not list) the directories leading
// to path: runc (1.1) mounts the root of a container in a user namespace
// as the container's root, an unprivileged host uid, which must reach it.
// Only the execute bit for others is added, where it is missing.
func (b *Backend) traversable(path string) error {
	for d := filepath.Dir(path); ; d = filepath.Dir(d) {
		if _, ok := b.searchable.Load(d); ok {
			return nil
		}
		fi, err := os.Stat(d)
		if err != nil {
			return fmt.Errorf("user namespace: %w", err)
		}
		if mode := fi.Mode().Perm(); mode&0o001 == 0 {
			if err := os.Chmod(d, mode|0o001); err != nil {
				return fmt.Errorf("user namespace: let the sandbox's root reach its root: %w", err)
			}
			b.log.Info("user namespaces: added search permission for others", "dir", d)
		}
		b.searchable.Store(d, true)
		if d == "/" {
			return nil
		}
	}
}

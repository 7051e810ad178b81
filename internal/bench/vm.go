package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/procfs"
	"github.com/shoal-sandbox/shoal/internal/zram"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// VMOptions configure the VM benchmark.
type VMOptions struct {
	Base      string
	Backend   string // microvm or fullvm
	Boots     int    // sandboxes created one after another
	Execs     int    // `true` round trips in the first one
	MemoryMiB int64
	// ReadFile, if set, is a file (or a directory: all its files) of the
	// base (a layer) that each VM reads whole after its first exec: then the host memory of the booted VMs
	// (QEMU's RSS, PSS, anonymous memory) and of the layers' page cache
	// say what a layer's cache costs per VM (blk: a copy in each guest;
	// pmem: the host's one, shared).
	ReadFile string
	// Pauses: rounds in which every booted VM is paused (its state
	// snapshotted to a file, its QEMU ended) and then resumed by an exec
	// (a new QEMU restores the file); 0: none.
	Pauses int
}

// VMResult is the JSON printed by `shoal bench vm`.
type VMResult struct {
	Bench   string `json:"bench"`
	Backend string `json:"backend"`
	Accel   string `json:"accel"`
	// CreateToFirstExec: from the create call to the end of the first
	// `true` in the new sandbox (the boot, its agent's first answer, an
	// exec).
	CreateToFirstExec Dist `json:"create_to_first_exec"`
	// By how the guest started (the sandbox's runtime "boot": serve
	// --vm-boot): booted, or restored from its shape's template; a
	// node's first VM of a shape boots, and its template is made after.
	Cold     *Dist `json:"create_to_first_exec_booted,omitempty"`
	Template *Dist `json:"create_to_first_exec_from_template,omitempty"`
	// Exec: `true` through the API in a booted VM.
	Exec Dist `json:"exec_api"`
	// IdleRSSKiB: host resident memory of an idle VM's QEMU (VmRSS of its
	// process, when the server runs on this machine), after its boot.
	IdleRSSKiB []int64 `json:"idle_qemu_rss_kib,omitempty"`
	MemoryMiB  int64   `json:"guest_memory_mib"`
	// LayerDevices: how the layers reached the guests (pmem or blk).
	LayerDevices string `json:"layer_devices,omitempty"`
	// With ReadFile: after every VM read it, each VM's QEMU (from
	// /proc/PID/smaps_rollup) and guest page cache (Cached), and the
	// host's page cache of the layers' images (resident pages, counted
	// once: the VMs share it).
	ReadFile          string  `json:"read_file,omitempty"`
	ReadFileKiB       int64   `json:"read_file_kib,omitempty"`
	QEMURSSKiB        []int64 `json:"qemu_rss_kib,omitempty"`
	QEMUPSSKiB        []int64 `json:"qemu_pss_kib,omitempty"`
	QEMUAnonKiB       []int64 `json:"qemu_anon_kib,omitempty"`
	GuestCachedKiB    []int64 `json:"guest_cached_kib,omitempty"`
	LayerPageCacheKiB int64   `json:"layers_page_cache_kib,omitempty"`
	// HostKiBPerVM: (the QEMUs' anonymous memory, their guests' RAM, +
	// the layers' page cache, shared) / VMs: what each VM costs the host
	// beyond QEMU's own binary.
	HostKiBPerVM int64 `json:"host_kib_per_vm,omitempty"`
	// With Pauses: the pause call, the memory it put aside and the host
	// memory a VM held after it (QEMU's RSS), and an exec sent to the
	// paused VM until its exit came back. PauseMethod says which pause
	// the server makes (serve --vm-pause): "snapshot" (stop, snapshot,
	// QEMU ended: SnapshotMiB is the file, no memory after; the exec
	// waits for the restore into a new QEMU and the agent's session) or
	// "in place: ..." (QEMU stopped, its memory paged out: SnapshotMiB is
	// what went to swap, uncompressed; the RSS after counts QEMU's code,
	// which every QEMU shares; ZramKiBPerVM is what the host's zram grew
	// by per VM in the first round, when the bench runs on the server's
	// host; the exec waits for QEMU to continue and the guest's pages to
	// come back).
	Pause              Dist    `json:"pause,omitempty"`
	PauseMethod        string  `json:"pause_method,omitempty"`
	SnapshotMiB        []int64 `json:"snapshot_mib,omitempty"`
	PausedHostKiB      int64   `json:"paused_vm_host_memory_kib"`
	ZramKiBPerVM       int64   `json:"zram_kib_per_paused_vm,omitempty"`
	RestoreToFirstExec Dist    `json:"restore_to_first_exec,omitempty"`
	// IdleVMsInMemory: how many idle, booted VMs this host's available
	// memory holds at the idle VMs' mean RSS (server on this machine);
	// paused VMs hold no memory (bounded by the disk their snapshots take).
	IdleVMsInMemory int64 `json:"idle_vms_in_memory,omitempty"`
}

// VM measures VM sandboxes: boot to first exec, exec round trips, and the
// host memory of an idle VM.
func VM(ctx context.Context, c *shoal.Client, o VMOptions) (*VMResult, error) {
	if o.Boots <= 0 || o.Execs < 0 || o.Boots > 100 || o.Execs > 10000 || o.Pauses < 0 || o.Pauses > 100 {
		return nil, fmt.Errorf("--boots must be 1..100, --execs 0..10000 and --pauses 0..100")
	}
	if o.Backend == "" {
		o.Backend = "microvm"
	}
	if o.MemoryMiB == 0 {
		o.MemoryMiB = 256
	}
	res := &VMResult{Bench: "vm", Backend: o.Backend, MemoryMiB: o.MemoryMiB}
	var first, execs, cold, tpl []time.Duration
	var ids []string
	defer func() {
		for _, id := range ids {
			c.Delete(context.Background(), id)
		}
	}()
	step := progress(ctx, "boot", o.Boots)
	for i := 0; i < o.Boots; i++ {
		step()
		t0 := time.Now()
		sb, err := c.Create(ctx, &pb.CreateSandboxRequest{Base: o.Base, Backend: o.Backend, MemoryBytes: o.MemoryMiB << 20, TimeoutSeconds: 900})
		if err != nil {
			return nil, fmt.Errorf("create %s sandbox: %w", o.Backend, err)
		}
		ids = append(ids, sb.Id)
		st, err := c.Exec(ctx, sb.Id, shoal.ExecOptions{Args: []string{"true"}})
		if err != nil {
			return nil, err
		}
		if st.Code != 0 {
			return nil, fmt.Errorf("true exited %d", st.Code)
		}
		first = append(first, time.Since(t0))
		if sb.Runtime["boot"] == "template" {
			tpl = append(tpl, time.Since(t0))
		} else {
			cold = append(cold, time.Since(t0))
		}
		res.Accel = sb.Runtime["accel"]
		res.LayerDevices = sb.Runtime["layer_devices"]
		if rss := rssKiB(sb.Runtime["pid"]); rss > 0 {
			res.IdleRSSKiB = append(res.IdleRSSKiB, rss)
		}
	}
	step = progress(ctx, "exec", o.Execs+3)
	for i := 0; i < o.Execs+3; i++ {
		step()
		t0 := time.Now()
		st, err := c.Exec(ctx, ids[0], shoal.ExecOptions{Args: []string{"true"}})
		if err != nil {
			return nil, err
		}
		if st.Code != 0 {
			return nil, fmt.Errorf("true exited %d", st.Code)
		}
		if i >= 3 { // warm-up
			execs = append(execs, time.Since(t0))
		}
	}
	res.CreateToFirstExec = dist(first)
	if len(tpl) > 0 {
		c, t := dist(cold), dist(tpl)
		res.Cold, res.Template = &c, &t
	}
	res.Exec = dist(execs)
	if len(res.IdleRSSKiB) > 0 {
		var sum int64
		for _, k := range res.IdleRSSKiB {
			sum += k
		}
		if avail := memAvailableKiB(); avail > 0 && sum > 0 {
			res.IdleVMsInMemory = avail / (sum / int64(len(res.IdleRSSKiB)))
		}
	}
	if o.ReadFile != "" {
		if err := readInVMs(ctx, c, o.ReadFile, ids, res); err != nil {
			return nil, err
		}
	}
	if o.Pauses > 0 {
		if err := pauseVMs(ctx, c, o.Pauses, ids, res); err != nil {
			return nil, err
		}
	}
	return res, nil
}

// pauseVMs pauses every VM, then resumes each by an exec, rounds times.
func pauseVMs(ctx context.Context, c *shoal.Client, rounds int, ids []string, res *VMResult) error {
	var pauses, restores []time.Duration
	step := progress(ctx, "pause", rounds*len(ids))
	for round := range rounds {
		zram0 := zram.MemUsed()
		for _, id := range ids {
			step()
			t0 := time.Now()
			sb, _, err := c.Pause(ctx, id)
			if err != nil {
				return fmt.Errorf("pause %s: %w", id, err)
			}
			pauses = append(pauses, time.Since(t0))
			if p := sb.Pause; p != nil {
				res.PauseMethod = p.Method
				res.SnapshotMiB = append(res.SnapshotMiB, p.SwappedOutBytes>>20)
				if p.MemoryAfterBytes > 0 {
					res.PausedHostKiB = max(res.PausedHostKiB, p.MemoryAfterBytes>>10)
				}
			}
		}
		if grew := zram.MemUsed() - zram0; round == 0 && grew > 0 {
			res.ZramKiBPerVM = grew >> 10 / int64(len(ids))
		}
		for _, id := range ids {
			t0 := time.Now()
			st, err := c.Exec(ctx, id, shoal.ExecOptions{Args: []string{"true"}})
			if err != nil {
				return fmt.Errorf("exec in paused %s: %w", id, err)
			}
			if st.Code != 0 {
				return fmt.Errorf("true exited %d", st.Code)
			}
			restores = append(restores, time.Since(t0))
		}
	}
	res.Pause = dist(pauses)
	res.RestoreToFirstExec = dist(restores)
	return nil
}

// memAvailableKiB is this machine's MemAvailable (0 when unknown).
func memAvailableKiB() int64 {
	n, _ := procfs.KiB("/proc/meminfo", "MemAvailable:")
	return n
}

// readInVMs has each VM read path, then measures the host's memory.
func readInVMs(ctx context.Context, c *shoal.Client, path string, ids []string, res *VMResult) error {
	res.ReadFile = path
	images := map[string]bool{}
	var pids []string
	step := progress(ctx, "read", len(ids))
	for _, id := range ids {
		step()
		var out strings.Builder
		st, err := c.Exec(ctx, id, shoal.ExecOptions{Args: []string{"sh", "-c", `find "$1" -type f -exec cat {} + | wc -c`, "sh", path}, Stdout: &out})
		if err != nil {
			return err
		}
		if st.Code != 0 {
			return fmt.Errorf("read %s in %s: exit %d", path, id, st.Code)
		}
		n, _ := strconv.ParseInt(strings.TrimSpace(out.String()), 10, 64)
		res.ReadFileKiB = n >> 10
		out.Reset()
		if _, err := c.Exec(ctx, id, shoal.ExecOptions{Args: []string{"sh", "-c", "grep '^Cached:' /proc/meminfo"}, Stdout: &out}); err != nil {
			return err
		}
		if f := strings.Fields(out.String()); len(f) >= 2 {
			kib, _ := strconv.ParseInt(f[1], 10, 64)
			res.GuestCachedKiB = append(res.GuestCachedKiB, kib)
		}
		sb, err := c.Get(ctx, id)
		if err != nil {
			return err
		}
		var imgs []string
		json.Unmarshal([]byte(sb.Runtime["layers"]), &imgs)
		for _, img := range imgs {
			images[img] = true
		}
		pids = append(pids, sb.Runtime["pid"])
	}
	var anon int64
	for _, pid := range pids {
		m := smapsRollup(pid)
		if m == nil {
			continue // not on this machine
		}
		res.QEMURSSKiB = append(res.QEMURSSKiB, m["Rss"])
		res.QEMUPSSKiB = append(res.QEMUPSSKiB, m["Pss"])
		res.QEMUAnonKiB = append(res.QEMUAnonKiB, m["Anonymous"])
		anon += m["Anonymous"]
	}
	for img := range images {
		res.LayerPageCacheKiB += residentKiB(img)
	}
	if len(res.QEMUAnonKiB) > 0 {
		res.HostKiBPerVM = (anon + res.LayerPageCacheKiB) / int64(len(res.QEMUAnonKiB))
	}
	return nil
}

// smapsRollup is a local process's /proc/PID/smaps_rollup in KiB by field
// (nil when unknown).
func smapsRollup(pid string) map[string]int64 {
	if _, err := strconv.Atoi(pid); err != nil {
		return nil
	}
	b, err := os.ReadFile("/proc/" + pid + "/smaps_rollup")
	if err != nil {
		return nil
	}
	m := map[string]int64{}
	for _, l := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(l, ":")
		if f := strings.Fields(v); ok && len(f) == 2 && f[1] == "kB" {
			m[k], _ = strconv.ParseInt(f[0], 10, 64)
		}
	}
	return m
}

// residentKiB is how much of a local file is in the page cache (mincore
// of a read-only mapping; 0 when unknown).
func residentKiB(path string) int64 {
	f, err := os.Open(path)
	if err != nil {
		return 0
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil || fi.Size() == 0 || !fi.Mode().IsRegular() {
		return 0
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(fi.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return 0
	}
	defer unix.Munmap(mem)
	page := os.Getpagesize()
	vec := make([]byte, (len(mem)+page-1)/page)
	if _, _, e := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&mem[0])), uintptr(len(mem)), uintptr(unsafe.Pointer(&vec[0]))); e != 0 {
		return 0
	}
	var n int64
	for _, v := range vec {
		n += int64(v & 1)
	}
	return n * int64(page) >> 10
}

// rssKiB is VmRSS of a local process, 0 when unknown.
func rssKiB(pid string) int64 {
	if _, err := strconv.Atoi(pid); err != nil {
		return 0
	}
	n, _ := procfs.KiB("/proc/"+pid+"/status", "VmRSS:")
	return n
}

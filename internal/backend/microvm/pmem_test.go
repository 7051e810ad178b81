package microvm

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/agent/vminit"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// The pmem layout: RAM, then each image with its pad to 2 MiB and a 2 MiB
// gap, then the RAM that holds the initramfs; every region 2 MiB aligned,
// none across microvm's 3 GiB line; layouts that cannot be are refused.
func TestPlanPmem(t *testing.T) {
	const M = 1 << 20
	for _, tc := range []struct {
		name      string
		mem       int64
		sizes     []int64
		low, high int64
		addrs     []uint64
		wantErr   bool
	}{
		{name: "small", mem: 256 * M, sizes: []int64{32*M + 4096, 8 * M},
			low: 224 * M, high: 32 * M, addrs: []uint64{224 * M, (224 + 34 + 2) * M}},
		{name: "aligned image: only the gap", mem: 256 * M, sizes: []int64{4 * M},
			low: 224 * M, high: 32 * M, addrs: []uint64{224 * M}},
		{name: "RAM after the layers crosses 3 GiB", mem: 3000 * M, sizes: []int64{512 * M},
			low: 3072*M - 514*M - 32*M, high: 3000*M - (3072*M - 514*M - 32*M), addrs: []uint64{3072*M - 514*M - 32*M}},
		{name: "layers above 4 GiB", mem: 4096 * M, sizes: []int64{3000 * M},
			low: 4096 * M, high: 0, addrs: []uint64{4096*M + 1024*M}},
		{name: "no room", mem: 2900 * M, sizes: []int64{3000 * M}, wantErr: true},
		{name: "unaligned memory", mem: 255 * M, sizes: []int64{4096}, wantErr: true},
		{name: "image not in 4 KiB blocks", mem: 256 * M, sizes: []int64{4097}, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, err := planPmem(tc.mem, tc.sizes, 32*M)
			if tc.wantErr {
				if err == nil {
					t.Fatalf("planPmem = %+v, want an error", l)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if l.RAMLow != tc.low || l.RAMHigh != tc.high {
				t.Errorf("RAM %d+%d MiB, want %d+%d", l.RAMLow/M, l.RAMHigh/M, tc.low/M, tc.high/M)
			}
			if l.RAMLow+l.RAMHigh != tc.mem {
				t.Errorf("RAM %d, want %d", l.RAMLow+l.RAMHigh, tc.mem)
			}
			for i, s := range l.Layers {
				if s.Addr != tc.addrs[i] {
					t.Errorf("layer %d at %d MiB, want %d", i, s.Addr/M, tc.addrs[i]/M)
				}
				end := s.Addr + uint64(s.region()) + pmemGap
				if s.Addr%pmemAlign != 0 || (s.Size+s.Pad)%pmemAlign != 0 || s.region() < s.Size ||
					(s.Addr < lowMemTop && end > lowMemTop) || (s.Addr >= lowMemTop && s.Addr < highMem) {
					t.Errorf("layer %d: %+v (region %d) misplaced", i, s, s.region())
				}
			}
			args, cmdline := l.qemuArgs([]string{"/i/a,b", "/i/c"}[:len(l.Layers)], "/pad")
			joined := strings.Join(args, " ")
			if !strings.Contains(joined, "mem-path=/i/a,,b,size="+strconv.FormatInt(tc.sizes[0], 10)) ||
				!strings.Contains(joined, "share=on,readonly=on") || !strings.Contains(joined, "-numa node,memdev=ram0") {
				t.Errorf("args %s", joined)
			}
			if want := "memmap=0x" + strconv.FormatInt(l.Layers[0].region(), 16) + "!0x" + strconv.FormatUint(l.Layers[0].Addr, 16); !strings.Contains(cmdline, want) {
				t.Errorf("cmdline %q lacks %q", cmdline, want)
			}
		})
	}
}

// vmBigLayer makes an EROFS layer holding /big/data (size+100 bytes of
// random data) as `shoal layer build --compression plain` does (its tail in
// a block of its own, not packed into its inode: DAX reads it in place) and
// returns its image and the data's SHA-256.
func vmBigLayer(t *testing.T, size int) (string, [32]byte) {
	t.Helper()
	dir := t.TempDir()
	data := make([]byte, size+100)
	rand.Read(data)
	os.MkdirAll(filepath.Join(dir, "root", "big"), 0o755)
	if err := os.WriteFile(filepath.Join(dir, "root", "big", "data"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(dir, "big.erofs")
	if out, err := exec.Command("mkfs.erofs", "--quiet", "--all-root", "-Enoinline_data", img, filepath.Join(dir, "root")).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.erofs: %v\n%s", err, out)
	}
	return img, sha256.Sum256(data)
}

func fileSum(t *testing.T, path string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}

// guestCachedKiB is the guest's page cache (Cached in /proc/meminfo).
func guestCachedKiB(t *testing.T, ctx context.Context, c *agent.Client) int64 {
	t.Helper()
	for _, l := range strings.Split(run(t, ctx, c, "cat", "/proc/meminfo"), "\n") {
		if v, ok := strings.CutPrefix(l, "Cached:"); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err == nil {
				return n
			}
		}
	}
	t.Fatal("no Cached in the guest's /proc/meminfo")
	return 0
}

// readBig reads the big layer's file in the guest and returns how much the
// guest's page cache grew meanwhile (KiB).
func readBig(t *testing.T, ctx context.Context, c *agent.Client, want [32]byte) int64 {
	t.Helper()
	before := guestCachedKiB(t, ctx, c)
	sum := strings.Fields(run(t, ctx, c, "busybox", "sha256sum", "/big/data"))
	after := guestCachedKiB(t, ctx, c)
	if len(sum) == 0 || sum[0] != hex.EncodeToString(want[:]) {
		t.Fatalf("the guest read /big/data as %v, want %x", sum, want)
	}
	return after - before
}

// Layers as pmem: each is mounted with DAX in the guest, and reading a
// 24 MiB file of a layer leaves the guest's page cache as it was (the same
// read from a virtio-blk layer fills it: the measure works); the guest's
// writes to its pmem device do not reach the host's image; a pause leaves
// the layers out of the snapshot (smaller than the snapshot of a blk VM
// that read the file, the layers' bytes are not in it) and the resumed VM
// reads them again, still with DAX.
func TestVMPmem(t *testing.T) {
	// SHOAL_VM_PMEM_MIB: the file's size (default 24 MiB), for the
	// snapshot sizes it logs.
	size := int64(24 << 20)
	if n, err := strconv.Atoi(os.Getenv("SHOAL_VM_PMEM_MIB")); err == nil && n > 0 && n <= 160 {
		size = int64(n) << 20
	}
	b, base := vmTestEnv(t, MachineMicroVM, func(c *Config) { c.Layers = LayersPmem })
	if b.LayerDevices() != LayersPmem {
		t.Fatalf("layers as %s: %s", b.LayerDevices(), b.pmemWhy)
	}
	big, sum := vmBigLayer(t, int(size))
	imgSum := fileSum(t, big)
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	create := func(b *Backend, id string) (sandbox.Handle, *agent.Client) {
		sdir, err := os.MkdirTemp("/tmp", "vmpm")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(sdir) })
		h, err := b.Create(ctx, sandbox.Spec{ID: id, Dir: sdir,
			Resources: sandbox.Resources{MemoryBytes: 256 << 20, MilliCPU: 1000},
			Layers: []sandbox.Layer{{Digest: "sha256:big", Kind: "toolkit", ImagePath: big},
				{Digest: "sha256:x", Kind: "base", ImagePath: base}}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { b.Delete(context.Background(), h) })
		return h, agent.NewClientDialer(h.ID, b.AgentDial(h))
	}
	h, c := create(b, "vmpmem")
	if h.Data["layer_devices"] != LayersPmem {
		t.Fatalf("layer_devices %q", h.Data["layer_devices"])
	}
	// The agent logs how it mounted each layer (its mounts are under the
	// root it left: /proc/mounts does not show them).
	checkDAX := func(c *agent.Client) {
		t.Helper()
		log := run(t, ctx, c, "busybox", "dmesg")
		for i := 0; i < 2; i++ {
			if !regexp.MustCompile(`shoal-agent: layer ` + strconv.Itoa(i) + `: /dev/pmem\d+ \(erofs, dax=always\)`).MatchString(log) {
				t.Errorf("layer %d not mounted from pmem with DAX:\n%s", i, lastLines(log, 30))
			}
		}
	}
	checkDAX(c)
	if grew := readBig(t, ctx, c, sum); grew > size/1024/4 {
		t.Errorf("reading a %d MiB file of a DAX layer grew the guest's page cache by %d KiB", size>>20, grew)
	}
	// Paused: the snapshot leaves the layers out, the resumed guest
	// reads them again with DAX.
	if _, err := c.WriteFile(ctx, "/work/a.txt", 0o644, strings.NewReader("kept")); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Pause(ctx, h); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(filepath.Join(h.Data["dir"], stateFile))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("pmem VM snapshot: %d MiB", fi.Size()>>20)
	h, err = b.Resume(ctx, h)
	if err != nil {
		t.Fatal(err)
	}
	c = agent.NewClientDialer(h.ID, b.AgentDial(h))
	if got := readFile(t, ctx, c, "/work/a.txt"); got != "kept" {
		t.Errorf("after resume: %q", got)
	}
	checkDAX(c)
	if grew := readBig(t, ctx, c, sum); grew > size/1024/4 {
		t.Errorf("after resume, reading the file grew the guest's page cache by %d KiB", grew)
	}

	// The workload is root in the guest: its writes to a layer's device
	// go nowhere (read-only memory): the host's image is unchanged, and
	// the guest reads the image's bytes again once it drops its caches.
	run(t, ctx, c, "sh", "-c", "for d in /dev/pmem*; do busybox blockdev --setrw $d; dd if=/dev/zero of=$d bs=4096 count=16 conv=notrunc,fsync 2>/dev/null; done; sync; echo 3 > /proc/sys/vm/drop_caches")
	if fileSum(t, big) != imgSum {
		t.Fatal("a guest's write to its pmem device changed the host's layer image")
	}
	head := make([]byte, 65536)
	f, err := os.Open(big)
	if err != nil {
		t.Fatal(err)
	}
	f.ReadAt(head, 0)
	f.Close()
	headSum := sha256.Sum256(head)
	guestHead := run(t, ctx, c, "sh", "-c", "for d in /dev/pmem*; do dd if=$d bs=4096 count=16 2>/dev/null | busybox sha256sum; done")
	if !strings.Contains(guestHead, hex.EncodeToString(headSum[:])) {
		t.Errorf("after its writes, the guest reads its pmem devices as %q, want one with %x", guestHead, headSum)
	}

	// The same with block devices: the guest caches what it read, and
	// its snapshot holds it.
	bb, _ := vmTestEnv(t, MachineMicroVM, func(c *Config) { c.Layers = LayersBlk })
	hb, cb := create(bb, "vmblk")
	if hb.Data["layer_devices"] != LayersBlk || hb.Data["pmem"] != "" {
		t.Fatalf("blk VM's handle %v", hb.Data)
	}
	if grew := readBig(t, ctx, cb, sum); grew < size/1024/2 {
		t.Fatalf("reading a %d MiB file of a block layer grew the guest's page cache by %d KiB only: the measure does not work", size>>20, grew)
	}
	if _, err := bb.Pause(ctx, hb); err != nil {
		t.Fatal(err)
	}
	fb, err := os.Stat(filepath.Join(hb.Data["dir"], stateFile))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("blk VM snapshot after the read: %d MiB", fb.Size()>>20)
	if fb.Size() <= fi.Size() {
		t.Errorf("snapshots: blk %d MiB, pmem %d MiB: the guest's cache of the layer should make the difference", fb.Size()>>20, fi.Size()>>20)
	}
}

// The layer mode: blk when configured; for auto, blk with the reason when
// the machine or the guest kernel cannot have pmem layers; a forced pmem
// that cannot be is an error (serve fails to start); a bad mode is an
// error.
func TestChoosePmem(t *testing.T) {
	noPmem := t.TempDir() // a kernel directory without modules/order.pmem
	os.MkdirAll(filepath.Join(noPmem, "modules"), 0o755)
	noDAX := t.TempDir() // modules, but a kernel config without FS DAX
	os.MkdirAll(filepath.Join(noDAX, "modules"), 0o755)
	os.WriteFile(filepath.Join(noDAX, "modules", vminit.PmemOrder), []byte("nd_pmem.ko\n"), 0o644)
	os.WriteFile(filepath.Join(noDAX, "config"), []byte("#\nCONFIG_X86_PMEM_LEGACY=m\nCONFIG_ZONE_DEVICE=y\n"), 0o644)
	for _, tc := range []struct {
		name, machine, kdir, mode string
		wantErr                   bool
		why                       string
	}{
		{"blk", MachineMicroVM, noPmem, LayersBlk, false, "configured"},
		{"auto, q35", MachineQ35, noPmem, LayersAuto, false, "microvm only"},
		{"auto, no modules", MachineMicroVM, noPmem, "", false, "no pmem modules"},
		{"auto, no FS DAX", MachineMicroVM, noDAX, LayersAuto, false, "CONFIG_FS_DAX"},
		{"pmem, no modules", MachineMicroVM, noPmem, LayersPmem, true, ""},
		{"bad mode", MachineMicroVM, noPmem, "virtio-pmem", true, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := &Backend{cfg: Config{Machine: tc.machine, KernelDir: tc.kdir, StateDir: t.TempDir(), Layers: tc.mode}}
			err := b.choosePmem()
			if tc.wantErr {
				if err == nil {
					t.Fatalf("no error; layers as %s (%s)", b.LayerDevices(), b.pmemWhy)
				}
				if tc.mode == LayersPmem && !errors.Is(err, ErrNoPmem) {
					t.Errorf("error %v is not ErrNoPmem", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if b.LayerDevices() != LayersBlk || !strings.Contains(b.pmemWhy, tc.why) {
				t.Errorf("layers as %s, why %q; want blk, why with %q", b.LayerDevices(), b.pmemWhy, tc.why)
			}
		})
	}
}

// The pad file: made sparse and read-only, reused as it is, and one of
// another size replaced by a new file (running VMs keep mapping the old
// one: it is never truncated in place).
func TestMakePad(t *testing.T) {
	dir := t.TempDir()
	p, err := makePad(dir)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(p)
	if err != nil || fi.Size() != pmemPadSize || fi.Mode().Perm() != 0o444 {
		t.Fatalf("pad %v, %v", fi, err)
	}
	var st1 unix.Stat_t
	unix.Stat(p, &st1)
	if st1.Blocks != 0 {
		t.Errorf("pad has %d blocks, want a sparse file", st1.Blocks)
	}
	if again, err := makePad(dir); err != nil || again != p {
		t.Fatalf("again: %s, %v", again, err)
	}
	var st2 unix.Stat_t
	unix.Stat(p, &st2)
	if st2.Ino != st1.Ino {
		t.Error("a good pad was replaced")
	}
	old, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	os.Chmod(p, 0o644)
	os.Truncate(p, 1<<20) // another size (an older version's)
	if _, err := makePad(dir); err != nil {
		t.Fatal(err)
	}
	var st3 unix.Stat_t
	unix.Stat(p, &st3)
	if st3.Ino == st1.Ino || st3.Size != pmemPadSize {
		t.Errorf("a pad of another size was not replaced (inode %d, %d bytes)", st3.Ino, st3.Size)
	}
	if fi, _ := old.Stat(); fi.Size() != 1<<20 {
		t.Errorf("the old pad changed: %d bytes", fi.Size())
	}
}

package microvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/shoal-sandbox/shoal/internal/agent/vminit"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// Layers as persistent memory (Config.Layers "pmem"): each layer's EROFS
// image is mapped, read-only and shared, into the guest's physical address
// space, and the guest mounts it with DAX: its reads and its mappings of a
// layer's files go straight to the host's page cache of the image, which
// every VM of the node shares, instead of each guest caching its own copy
// in its RAM (as it does for a virtio-blk device).
//
// QEMU 7.2's microvm machine cannot plug memory devices (virtio-pmem-pci
// and virtio-pmem realize but are never mapped), so the images are NUMA
// nodes' memory backends instead: QEMU lays the nodes' memory out one
// after the other in the guest's physical address space (the guest sees no
// NUMA: microvm has no SRAT, and its e820 map says all of it is RAM). The
// guest's kernel command line then marks each image's range as legacy
// persistent memory (memmap=SIZE!ADDR, e820 type 12), which nd_e820 and
// nd_pmem turn into /dev/pmemN, DAX-capable. The layout, from guest address
// 0:
//
//	RAM (RAMLow)  image 0, zero pad, gap  image 1, ...  RAM (RAMHigh)
//
// - A pmem region's start and size are 2 MiB aligned (the guest maps its
// pages in 2 MiB subsections): each image is followed by pad bytes up to
// the next 2 MiB, mapped from a sparse zero file (pmemPadFile, shared and
// read-only as the images are), then by a 2 MiB gap (the same file) that
// the command line reserves (memmap=SIZE$ADDR): the kernel merges adjacent
// e820 ranges of one type, and two layers must stay two devices. The
// image files are used as they are, never copied or changed.
// - QEMU loads the initramfs at the top of the RAM below 4 GiB, which must
// be RAM: RAMHigh, the rest of the guest's RAM after the layers, holds it.
// - microvm's RAM below 4 GiB ends at 3 GiB and continues at 4 GiB: no
// region may straddle that line (planPmem).
// - The legacy regions reach the guest's resource tree only once its PCI
// set-up ran (e820__reserve_resources_late): these VMs have a PCIe host
// bridge (microvm's pcie=on), with no devices on it.
//
// The guest finds each layer's device by its region's start address
// (vminit.Config.PmemAddrs), loads the pmem modules (modules/order.pmem in
// the kernel directory) and mounts with dax=always, without DAX if the
// kernel refuses it. The guest can neither change an image nor the pad (a
// read-only memory region: its writes are discarded).
//
// Snapshots: the images and the pad are shared file-backed memory, which
// the x-ignore-shared migration capability leaves out of the state file
// (set on both ends: the stream's layout depends on it); a restore maps the
// same files again at the same addresses (the handle records the layout,
// and the images' sizes are checked).
//
// Limits: DAX applies to a file whose data the image stores in plain
// blocks (erofs' FLAT_PLAIN layout); mkfs.erofs packs the tail of a file
// whose size is not a multiple of 4 KiB in its inode (FLAT_INLINE), and
// compresses the files of an lz4 layer: those are read through the guest's
// page cache, as from a block device.

// ErrNoPmem marks New's error when Config.Layers is "pmem" and this node
// cannot map layers as persistent memory.
var ErrNoPmem = errors.New("no pmem layers on this node")

// Layer device modes (Config.Layers).
const (
	LayersAuto = "auto"
	LayersPmem = "pmem"
	LayersBlk  = "blk"
)

const (
	pmemAlign = 2 << 20
	pmemGap   = 2 << 20
	// lowMemTop: microvm's guest RAM below 4 GiB ends here.
	lowMemTop = 3 << 30
	highMem   = 4 << 30
	// pmemMinLow is the least RAM before the layers (the kernel is
	// loaded at 16 MiB).
	pmemMinLow = 96 << 20
	// pmemPadFile is the sparse zero file of pads and gaps, in StateDir.
	pmemPadFile = "pmem-pad"
	pmemPadSize = pmemAlign + pmemGap
)

// pmemLayout places a VM's RAM and layers in its physical address space
// (recorded in its handle: a restore needs the same).
type pmemLayout struct {
	RAMLow  int64      `json:"ram_low"`
	RAMHigh int64      `json:"ram_high"`
	Layers  []pmemSlot `json:"layers"`
}

// pmemSlot is one layer's place.
type pmemSlot struct {
	Size int64  `json:"size"` // the image's bytes
	Addr uint64 `json:"addr"` // guest-physical start
	// Pad is how much of the pad file follows the image: to the end of
	// its 2 MiB-aligned region, and the gap.
	Pad int64 `json:"pad"`
}

func (s pmemSlot) region() int64 { return alignUp(s.Size, pmemAlign) }

func alignUp(n, a int64) int64 { return (n + a - 1) / a * a }

// total is the guest's physical memory, RAM and layers.
func (l pmemLayout) total() int64 {
	n := l.RAMLow + l.RAMHigh
	for _, s := range l.Layers {
		n += s.Size + s.Pad
	}
	return n
}

// planPmem places mem bytes of RAM (a multiple of 2 MiB) and images of the
// given sizes (multiples of 4 KiB), keeping top bytes of RAM after the
// layers for the initramfs. It fails when the layers cannot be placed
// (then the VM's layers are block devices).
func planPmem(mem int64, sizes []int64, top int64) (pmemLayout, error) {
	if mem%pmemAlign != 0 || top%pmemAlign != 0 || top <= 0 {
		return pmemLayout{}, fmt.Errorf("memory %d, top %d: not multiples of 2 MiB", mem, top)
	}
	var l pmemLayout
	var span int64 // the layers' bytes, pads and gaps
	for _, s := range sizes {
		if s <= 0 || s%4096 != 0 {
			return pmemLayout{}, fmt.Errorf("an image of %d bytes: not a multiple of 4 KiB", s)
		}
		slot := pmemSlot{Size: s, Pad: alignUp(s, pmemAlign) - s + pmemGap}
		l.Layers = append(l.Layers, slot)
		span += s + slot.Pad
	}
	switch {
	case mem+span <= lowMemTop && mem-top >= pmemMinLow:
		l.RAMLow, l.RAMHigh = mem-top, top
	case mem+span > lowMemTop && lowMemTop-span-top >= pmemMinLow && mem > lowMemTop-span-top:
		// The RAM after the layers reaches past 3 GiB (and on at 4 GiB).
		l.RAMLow = lowMemTop - span - top
		l.RAMHigh = mem - l.RAMLow
	case mem >= lowMemTop:
		// All RAM first (the initramfs in its part below 3 GiB), the
		// layers above 4 GiB.
		l.RAMLow = mem
	default:
		return pmemLayout{}, fmt.Errorf("%d MiB of memory and %d MiB of layers: no room below 3 GiB", mem>>20, span>>20)
	}
	off := l.RAMLow
	for i := range l.Layers {
		addr := off
		if addr >= lowMemTop {
			addr += highMem - lowMemTop
		}
		l.Layers[i].Addr = uint64(addr)
		off += l.Layers[i].Size + l.Layers[i].Pad
	}
	return l, nil
}

// qemuArgs are the memory backends and NUMA nodes of the layout (images
// and the pad file by path) and what the kernel command line adds.
func (l pmemLayout) qemuArgs(images []string, pad string) (args []string, cmdline string) {
	var numa, kargs []string
	ram := func(id string, size int64) {
		args = append(args, "-object", "memory-backend-ram,id="+id+",size="+strconv.FormatInt(size, 10))
		numa = append(numa, "-numa", "node,memdev="+id)
	}
	file := func(id, path string, size int64) {
		args = append(args, "-object", "memory-backend-file,id="+id+",share=on,readonly=on,mem-path="+qemuEscape(path)+",size="+strconv.FormatInt(size, 10))
		numa = append(numa, "-numa", "node,memdev="+id)
	}
	ram("ram0", l.RAMLow)
	for i, s := range l.Layers {
		file("pmem"+strconv.Itoa(i), images[i], s.Size)
		file("pmempad"+strconv.Itoa(i), pad, s.Pad)
		kargs = append(kargs, fmt.Sprintf("memmap=0x%x!0x%x", s.region(), s.Addr),
			fmt.Sprintf("memmap=0x%x$0x%x", int64(pmemGap), s.Addr+uint64(s.region())))
	}
	if l.RAMHigh > 0 {
		ram("ram1", l.RAMHigh)
	}
	return append(args, numa...), strings.Join(kargs, " ")
}

// addrs are the layers' guest-physical addresses, for the guest's config.
func (l pmemLayout) addrs() []uint64 {
	out := make([]uint64, len(l.Layers))
	for i, s := range l.Layers {
		out[i] = s.Addr
	}
	return out
}

// choosePmem decides, at New, whether this backend's layers are pmem:
// Config.Layers "blk" or "pmem", or for "auto" whether the machine, the
// guest kernel and QEMU support it. A forced "pmem" that cannot be is an
// error.
func (b *Backend) choosePmem() error {
	mode := b.cfg.Layers
	if mode == "" {
		mode = LayersAuto
	}
	switch mode {
	case LayersBlk:
		b.pmemWhy = "configured"
		return nil
	case LayersAuto, LayersPmem:
	default:
		return fmt.Errorf("vm backend: layers %q: want auto, pmem or blk", mode)
	}
	if b.cfg.Boot == BootTemplate {
		b.pmemWhy = "guests start from templates, whose memory cannot hold a sandbox's layers"
		return nil
	}
	why, err := b.pmemSupported()
	if err != nil {
		if mode == LayersPmem {
			return fmt.Errorf("vm backend: %w: %w", ErrNoPmem, err)
		}
		b.pmemWhy = err.Error()
		return nil
	}
	b.pmem, b.pmemWhy = true, why
	return nil
}

// pmemSupported says why this backend can map layers as pmem, or why not.
func (b *Backend) pmemSupported() (string, error) {
	if b.cfg.Machine != MachineMicroVM {
		return "", fmt.Errorf("machine %s: pmem layers are made for microvm only", b.cfg.Machine)
	}
	if _, err := os.Stat(filepath.Join(b.cfg.KernelDir, "modules", vminit.PmemOrder)); err != nil {
		return "", fmt.Errorf("the guest kernel's directory has no pmem modules (run scripts/vmkernel.sh again): %w", err)
	}
	if cfg, err := os.ReadFile(filepath.Join(b.cfg.KernelDir, "config")); err == nil {
		for _, opt := range []string{"CONFIG_X86_PMEM_LEGACY=", "CONFIG_FS_DAX=y", "CONFIG_ZONE_DEVICE=y"} {
			if !strings.Contains(string(cfg), "\n"+opt) {
				return "", fmt.Errorf("the guest kernel has no %s", strings.TrimSuffix(opt, "="))
			}
		}
	}
	pad, err := makePad(b.cfg.StateDir)
	if err != nil {
		return "", err
	}
	if err := b.probePmemQEMU(pad); err != nil {
		return "", err
	}
	b.pad = pad
	return "the guest kernel has legacy pmem and FS DAX, QEMU maps read-only shared file memory on microvm", nil
}

// makePad makes (or reuses) the sparse zero file of pads and gaps. One of
// another size is replaced, never changed: running VMs map it.
func makePad(dir string) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	p := filepath.Join(dir, pmemPadFile)
	if fi, err := os.Lstat(p); err == nil && fi.Mode().IsRegular() && fi.Size() == pmemPadSize {
		return p, nil
	}
	f, err := os.CreateTemp(dir, "."+pmemPadFile+"-*")
	if err != nil {
		return "", fmt.Errorf("pmem pad: %w", err)
	}
	defer os.Remove(f.Name())
	err = f.Truncate(pmemPadSize) // zeros, no blocks
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Chmod(f.Name(), 0o444)
	}
	if err == nil {
		err = os.Rename(f.Name(), p)
	}
	if err != nil {
		return "", fmt.Errorf("pmem pad: %w", err)
	}
	return p, nil
}

// probePmemQEMU starts QEMU, stopped, with a machine of the pmem layout's
// kind (a RAM node and a read-only shared file node, PCIe) and quits it.
func (b *Backend) probePmemQEMU(pad string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, b.cfg.QEMU, "-M", "microvm,pcie=on,x-option-roms=off", "-accel", "tcg", "-m", "8",
		"-nodefaults", "-no-user-config", "-display", "none", "-S",
		"-object", "memory-backend-ram,id=r,size=6M",
		"-object", "memory-backend-file,id=p,share=on,readonly=on,mem-path="+qemuEscape(pad)+",size=2M",
		"-numa", "node,memdev=r", "-numa", "node,memdev=p", "-qmp", "stdio")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	cmd.Stdin = strings.NewReader(`{"execute":"qmp_capabilities"}` + "\n" + `{"execute":"quit"}` + "\n")
	var out strings.Builder
	cmd.Stdout = &limitedWriter{w: &out, n: 4096}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("qemu cannot map file memory on microvm: %w: %s", err, lastLines(out.String(), 3))
	}
	return nil
}

// pmemTop is how much RAM a pmem VM keeps after its layers: the
// initramfs, with room.
func (b *Backend) pmemTop() int64 {
	var n int64
	if fi, err := os.Stat(b.initrd); err == nil {
		n = fi.Size()
	}
	return max(alignUp(n+16<<20, pmemAlign), 32<<20)
}

// planLayers returns the pmem layout of a new VM's layers, or nil when its
// layers are block devices (this backend's mode, or they do not fit: then
// logged).
func (b *Backend) planLayers(spec sandbox.Spec, mem int64, images []string) *pmemLayout {
	if !b.pmem {
		return nil
	}
	sizes := make([]int64, len(images))
	for i, img := range images {
		fi, err := os.Stat(img)
		if err != nil {
			b.log.Warn("layers as block devices", "sandbox_id", spec.ID, "why", err)
			return nil
		}
		sizes[i] = fi.Size()
	}
	l, err := planPmem(mem, sizes, b.pmemTop())
	if err != nil {
		b.log.Warn("layers as block devices", "sandbox_id", spec.ID, "why", err)
		return nil
	}
	return &l
}

// handlePmem returns the pmem layout a handle records (nil: block
// devices), checking that its images still have the sizes it was made
// with.
func handlePmem(h sandbox.Handle, images []string) (*pmemLayout, error) {
	doc := h.Data["pmem"]
	if doc == "" {
		return nil, nil
	}
	var l pmemLayout
	if err := json.Unmarshal([]byte(doc), &l); err != nil {
		return nil, fmt.Errorf("pmem layout: %w", err)
	}
	if len(l.Layers) != len(images) || l.RAMLow <= 0 || h.Data["pmem_pad"] == "" {
		return nil, errors.New("pmem layout: does not match the layers")
	}
	for i, img := range images {
		fi, err := os.Stat(img)
		if err != nil {
			return nil, fmt.Errorf("pmem layer %d: %w", i, err)
		}
		if fi.Size() != l.Layers[i].Size {
			return nil, fmt.Errorf("pmem layer %d: image %s has %d bytes, the VM mapped %d", i, img, fi.Size(), l.Layers[i].Size)
		}
	}
	return &l, nil
}

// pmemGuestConfig fills the guest's config for a layout.
func pmemGuestConfig(vc *vminit.Config, l *pmemLayout) {
	if l != nil {
		vc.PmemAddrs = l.addrs()
	}
}

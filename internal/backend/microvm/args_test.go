package microvm

import (
	"slices"
	"strings"
	"testing"

	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// The guest's environment: the base one, the create's variables over it
// (a create may override PATH), and the sandbox's ID last.
func TestGuestEnv(t *testing.T) {
	got := guestEnv(sandbox.Spec{ID: "sb1", Env: []string{"PATH=/opt/bin", "FOO=bar"}})
	want := []string{"PATH=/opt/bin", "HOME=/root", "TERM=xterm", "LANG=C.UTF-8", "FOO=bar", "SHOAL_SANDBOX_ID=sb1"}
	if !slices.Equal(got, want) {
		t.Errorf("guestEnv = %q, want %q", got, want)
	}
}

// QEMU's command line: the machine's devices by type, the TCG translation
// cache bounded, the guest's clock from the host's TSC frequency, commas
// in paths escaped.
func TestBaseArgs(t *testing.T) {
	b := &Backend{cfg: Config{Machine: MachineMicroVM}, kernel: "/k/vmlinux", initrd: "/i/initrd"}
	args := strings.Join(b.baseArgs("tcg", 256<<20, 2, "X=1", nil, nil, ""), " ")
	for _, want := range []string{"-M microvm,", "-accel tcg,tb-size=64", "-m 256", "-smp 2", "-kernel /k/vmlinux", "-initrd /i/initrd", "SHOAL_VM=1 X=1", "tsc_early_khz="} {
		if !strings.Contains(args, want) {
			t.Errorf("args %q lack %q", args, want)
		}
	}
	if b.dev("virtio-blk") != "virtio-blk-device" {
		t.Errorf("microvm device %s", b.dev("virtio-blk"))
	}
	q := &Backend{cfg: Config{Machine: MachineQ35}, kernel: "k", initrd: "i"}
	if args := strings.Join(q.baseArgs("kvm", 256<<20, 1, "", nil, nil, ""), " "); !strings.Contains(args, "-M q35 -accel kvm -cpu host") || strings.Contains(args, "tb-size") {
		t.Errorf("q35/kvm args %q", args)
	}
	if q.dev("virtio-blk") != "virtio-blk-pci" {
		t.Errorf("q35 device %s", q.dev("virtio-blk"))
	}
	if got := qemuEscape("/a,b/c"); got != "/a,,b/c" {
		t.Errorf("qemuEscape = %q", got)
	}
	if khz := hostTSCkHz(); khz < 100000 || khz > 10000000 {
		t.Errorf("hostTSCkHz = %d", khz)
	}
}

// The node's disk I/O bound puts every drive the guest writes or reads
// layers from in one throttling group: the writable disk, blk layers, a
// full system's root overlay.
func TestDiskThrottleArgs(t *testing.T) {
	b := &Backend{cfg: Config{Machine: MachineQ35, DiskIOPS: 500, DiskBPS: 8 << 20}, kernel: "k", initrd: "i"}
	h := sandbox.Handle{ID: "sb1", Data: map[string]string{"dir": "/d", "mem": "268435456", "cpus": "1", "accel": "tcg",
		"layers": `["/l/0.erofs","/l/1.erofs"]`, "disk": "1", "image": "/img"}}
	args, err := b.qemuArgs(h)
	if err != nil {
		t.Fatal(err)
	}
	const want = "throttling.group=vm,throttling.iops-total=500,throttling.bps-total=8388608"
	for _, id := range []string{"id=upper", "id=l0", "id=l1", "id=root"} {
		i := slices.IndexFunc(args, func(a string) bool { return strings.Contains(a, id+",") })
		if i < 0 || !strings.Contains(args[i], want) {
			t.Errorf("drive %s not throttled: %q", id, args)
		}
	}
	b.cfg.DiskIOPS, b.cfg.DiskBPS = 0, 0
	if args, _ := b.qemuArgs(h); strings.Contains(strings.Join(args, " "), "throttling") {
		t.Errorf("unbounded, yet throttled: %q", args)
	}
}

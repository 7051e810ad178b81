package microvm

import (
	"bytes"
	"encoding/binary"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// The initramfs is a newc cpio archive that cpio(1) reads back: /init (the
// agent) and the modules in their order, the pmem layers' ones too.
func TestBuildInitrd(t *testing.T) {
	if _, err := exec.LookPath("cpio"); err != nil {
		t.Skip("needs cpio(1) to read the archive back")
	}
	dir := t.TempDir()
	kdir := filepath.Join(dir, "kernel")
	os.MkdirAll(filepath.Join(kdir, "modules"), 0o755)
	os.WriteFile(filepath.Join(kdir, "modules", "order"), []byte("a.ko\nb.ko\n"), 0o644)
	os.WriteFile(filepath.Join(kdir, "modules", "a.ko"), []byte("module a"), 0o644)
	os.WriteFile(filepath.Join(kdir, "modules", "b.ko"), []byte("module bb"), 0o644)
	os.WriteFile(filepath.Join(kdir, "modules", "order.pmem"), []byte("c.ko\n"), 0o644)
	os.WriteFile(filepath.Join(kdir, "modules", "c.ko"), []byte("module c"), 0o644)
	agentBin := filepath.Join(dir, "agent")
	os.WriteFile(agentBin, []byte("#!agent"), 0o755)
	out, err := buildInitrd(filepath.Join(dir, "out"), kdir, agentBin)
	if err != nil {
		t.Fatal(err)
	}
	x := filepath.Join(dir, "x")
	os.Mkdir(x, 0o755)
	f, _ := os.Open(out)
	defer f.Close()
	cmd := exec.Command("cpio", "-id", "--quiet")
	cmd.Dir, cmd.Stdin = x, f
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("cpio: %v: %s", err, b)
	}
	for name, want := range map[string]string{
		"init": "#!agent", "lib/shoal/modules/order": "a.ko\nb.ko\n",
		"lib/shoal/modules/a.ko": "module a", "lib/shoal/modules/b.ko": "module bb",
		"lib/shoal/modules/order.pmem": "c.ko\n", "lib/shoal/modules/c.ko": "module c",
	} {
		b, err := os.ReadFile(filepath.Join(x, name))
		if err != nil || string(b) != want {
			t.Errorf("%s: %q, %v; want %q", name, b, err, want)
		}
	}
	if fi, err := os.Stat(filepath.Join(x, "init")); err != nil || fi.Mode().Perm() != 0o755 {
		t.Errorf("init: %v %v, want mode 0755", fi, err)
	}
	// The same inputs give the same file; another agent another one.
	again, _ := buildInitrd(filepath.Join(dir, "out"), kdir, agentBin)
	os.WriteFile(agentBin, []byte("#!agent v2"), 0o755)
	other, _ := buildInitrd(filepath.Join(dir, "out"), kdir, agentBin)
	if again != out || other == out || !strings.HasPrefix(filepath.Base(other), "initrd-") {
		t.Errorf("initrd names: %s, %s, %s", out, again, other)
	}
}

// A helper for manual boots: SHOAL_VM_INITRD_OUT=DIR writes the initramfs
// of the real kernel ($SHOAL_VM_KERNEL_DIR) and agent ($SHOAL_AGENT) there.
func TestWriteInitrdForManualBoot(t *testing.T) {
	out := os.Getenv("SHOAL_VM_INITRD_OUT")
	if out == "" {
		t.Skip("SHOAL_VM_INITRD_OUT not set")
	}
	p, err := buildInitrd(out, os.Getenv("SHOAL_VM_KERNEL_DIR"), os.Getenv("SHOAL_AGENT"))
	if err != nil {
		t.Fatal(err)
	}
	t.Log(p)
}

// A signed module loses its signature, and only it; an unsigned one, or
// one whose signature length does not fit, is left as it is. The real
// modules, where installed, are signed and stripped to their ELF.
func TestStripModuleSignature(t *testing.T) {
	body := []byte("\x7fELF module body")
	sig := []byte("SIGNATURE BYTES")
	info := make([]byte, 12)
	binary.BigEndian.PutUint32(info[8:], uint32(len(sig)))
	signed := append(append(append(append([]byte{}, body...), sig...), info...), moduleSigMagic...)
	if got := stripModuleSignature(signed); !bytes.Equal(got, body) {
		t.Errorf("stripped %q, want %q", got, body)
	}
	if got := stripModuleSignature(body); !bytes.Equal(got, body) {
		t.Errorf("unsigned module changed: %q", got)
	}
	binary.BigEndian.PutUint32(info[8:], 1<<20)
	bad := append(append(append([]byte{}, body...), info...), moduleSigMagic...)
	if got := stripModuleSignature(bad); !bytes.Equal(got, bad) {
		t.Errorf("a module with an impossible signature length changed: %q", got)
	}
	mods, _ := filepath.Glob(filepath.Join(DefaultKernelDir, "modules", "*.ko"))
	for _, m := range mods {
		b, err := os.ReadFile(m)
		if err != nil {
			t.Fatal(err)
		}
		s := stripModuleSignature(b)
		if !bytes.HasPrefix(s, []byte("\x7fELF")) || bytes.Contains(s, []byte(moduleSigMagic)) || len(s) >= len(b) {
			t.Errorf("%s: %d bytes stripped to %d", m, len(b), len(s))
		}
	}
}

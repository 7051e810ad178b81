package node

import (
	"debug/buildinfo"
	"debug/elf"
	"errors"
	"fmt"
)

// CheckAgentBinary refuses a guest agent that cannot run as a sandbox's
// PID 1: the agent is bind-mounted into roots that have no dynamic loader
// and no libc of the host's, so it must be a static ELF executable (no
// program interpreter, no shared libraries). `go build ./cmd/...` with cgo
// enabled (the default where a C compiler is installed) links the agent
// dynamically, because package net then uses the C resolver; without this
// check every create would fail with "exec /.shoal/agent: no such file or
// directory".
func CheckAgentBinary(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("agent binary %s: not an ELF executable: %w", path, err)
	}
	defer f.Close()
	fix := fmt.Sprintf("rebuild it static: CGO_ENABLED=0 go build -o %s ./cmd/shoal-agent (scripts/up does)", path)
	if f.Type != elf.ET_EXEC && f.Type != elf.ET_DYN {
		return fmt.Errorf("agent binary %s: ELF type %s is not an executable", path, f.Type)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			interp := make([]byte, min(p.Filesz, 256))
			p.ReadAt(interp, 0)
			return fmt.Errorf("agent binary %s is dynamically linked (interpreter %s), so it cannot run inside a sandbox: %s",
				path, trimNul(interp), fix)
		}
	}
	libs, err := f.ImportedLibraries()
	if err != nil && !errors.Is(err, elf.ErrNoSymbols) {
		return fmt.Errorf("agent binary %s: %w", path, err)
	}
	if len(libs) > 0 {
		return fmt.Errorf("agent binary %s needs shared libraries %v, so it cannot run inside a sandbox: %s", path, libs, fix)
	}
	// Even linked statically, a cgo build cannot drop capabilities on all
	// its threads (syscall.AllThreadsSyscall fails with ENOTSUP), which a
	// pool claim needs.
	if bi, err := buildinfo.ReadFile(path); err == nil {
		for _, s := range bi.Settings {
			if s.Key == "CGO_ENABLED" && s.Value == "1" {
				return fmt.Errorf("agent binary %s was built with cgo: %s", path, fix)
			}
		}
	}
	return nil
}

func trimNul(b []byte) string {
	for i, c := range b {
		if c == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}

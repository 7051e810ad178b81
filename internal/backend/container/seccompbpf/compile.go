// Package seccompbpf compiles an OCI seccomp configuration (the one
// github.com/moby/profiles/seccomp derives from docker's default profile)
// into a classic BPF program that a process installs on itself with
// seccomp(2), so that the node compiles the profile once instead of runc
// compiling it through libseccomp for every container (~25 ms of CPU each).
//
// The program has the semantics runc 1.1 gives a configuration through
// libseccomp:
//
//   - every rule of a system call is an alternative (OR); the conditions of
//     one rule must all hold (AND), except that a rule with two conditions
//     on the same argument becomes one rule per condition, as runc does;
//   - a rule whose action is the default action is skipped;
//   - a system call name the table does not know for an ABI is skipped;
//   - arguments compare as unsigned 64-bit values on x86_64, and as their
//     low 32 bits on i386 and x32 (libseccomp's rule for 32-bit ABIs, x32
//     being one: its longs and pointers are 32 bits);
//   - a system call numbered above the highest one the configuration names
//     (per ABI) fails with ENOSYS, not with the default action: runc's
//     "-ENOSYS stub", so that a newer libc falls back from a system call the
//     profile has never heard of (clone3, faccessat2 …) instead of failing.
//
// Only the x86 family is supported (the host ABI x86_64 and its i386 and
// x32 sub-ABIs), and only the actions, operators and rule shapes docker's
// profile uses plus their obvious neighbours: Compile refuses anything else,
// and the caller then falls back on letting runc load the profile.
//
// The system call tables (ztables.go) are generated from golang.org/x/sys
// by gen_tables.go.
package seccompbpf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// Audit architecture values, as the kernel reports them in seccomp_data.arch.
const (
	AuditArchX86_64 = 0xc000003e
	AuditArchI386   = 0x40000003
	// X32Bit marks an x32 system call number (x32 shares x86_64's arch value).
	X32Bit = 0x40000000
)

// Return values of a filter.
const (
	RetKillProcess = 0x80000000
	RetKillThread  = 0x00000000
	RetTrap        = 0x00030000
	RetErrno       = 0x00050000
	RetTrace       = 0x7ff00000
	RetLog         = 0x7ffc0000
	RetAllow       = 0x7fff0000
	retDataMask    = 0x0000ffff
)

// badArch is returned for an ABI the configuration does not list: on an
// x86_64 kernel only the three x86 ABIs exist, so this is never reached
// unless the configuration leaves one of them out.
const badArch = RetKillProcess

// Program is a compiled seccomp filter.
type Program []unix.SockFilter

// Bytes encodes the program as the kernel's struct sock_filter array
// (8 bytes per instruction, native byte order), the form the guest agent
// reads and passes to seccomp(2).
func (p Program) Bytes() []byte {
	b := make([]byte, 8*len(p))
	for i, in := range p {
		binary.NativeEndian.PutUint16(b[8*i:], in.Code)
		b[8*i+2] = in.Jt
		b[8*i+3] = in.Jf
		binary.NativeEndian.PutUint32(b[8*i+4:], in.K)
	}
	return b
}

// Decode is the inverse of Bytes.
func Decode(b []byte) (Program, error) {
	if len(b) == 0 || len(b)%8 != 0 || len(b)/8 > maxInsns {
		return nil, fmt.Errorf("seccomp program of %d bytes: want a multiple of 8, at most %d instructions", len(b), maxInsns)
	}
	p := make(Program, len(b)/8)
	for i := range p {
		p[i] = unix.SockFilter{
			Code: binary.NativeEndian.Uint16(b[8*i:]),
			Jt:   b[8*i+2],
			Jf:   b[8*i+3],
			K:    binary.NativeEndian.Uint32(b[8*i+4:]),
		}
	}
	return p, nil
}

// maxInsns is the kernel's limit on a filter's length (BPF_MAXINSNS).
const maxInsns = 4096

// abi is one system call ABI the filter distinguishes.
type abi struct {
	arch  specs.Arch
	audit uint32
	table map[string]uint32
	base  uint32 // added to the table's numbers (X32Bit for x32)
	bits  int    // argument width: 64, or 32 on i386 and x32
}

var abis = []abi{
	{specs.ArchX86_64, AuditArchX86_64, sysX86_64, 0, 64},
	{specs.ArchX32, AuditArchX86_64, sysX32, X32Bit, 32}, // ILP32: libseccomp compares 32 bits
	{specs.ArchX86, AuditArchI386, sysI386, 0, 32},
}

// Resolve returns the number of a system call in the ABI arch, and whether
// the table knows it.
func Resolve(arch specs.Arch, name string) (uint32, bool) {
	for _, a := range abis {
		if a.arch == arch {
			nr, ok := a.table[name]
			return nr + a.base, ok
		}
	}
	return 0, false
}

// Action converts an OCI action (and errno) into a filter return value, as
// runc does: ERRNO and TRACE default to EPERM.
func Action(act specs.LinuxSeccompAction, errno *uint) (uint32, error) {
	data := uint32(unix.EPERM)
	if errno != nil {
		if *errno > retDataMask {
			return 0, fmt.Errorf("errno %d out of range", *errno)
		}
		data = uint32(*errno)
	}
	switch act {
	case specs.ActKill, specs.ActKillThread:
		return RetKillThread, nil
	case specs.ActKillProcess:
		return RetKillProcess, nil
	case specs.ActTrap:
		return RetTrap, nil
	case specs.ActErrno:
		return RetErrno | data, nil
	case specs.ActTrace:
		return RetTrace | data, nil
	case specs.ActAllow:
		return RetAllow, nil
	case specs.ActLog:
		return RetLog, nil
	}
	return 0, fmt.Errorf("seccomp action %q is not supported", act)
}

// rule is one alternative for a system call: all conds must hold.
type rule struct {
	conds  []specs.LinuxSeccompArg
	action uint32
}

// decision is what the filter does for one system call number.
type decision struct {
	uncond    bool   // action applies whatever the arguments
	action    uint32 // the action of the rules (all rules of a number share it)
	rules     []rule // when !uncond: the first rule that matches gives action
	hasAction bool
}

func (d *decision) add(r rule) error {
	if d.hasAction && d.action != r.action {
		return fmt.Errorf("rules with different actions (%#x, %#x)", d.action, r.action)
	}
	d.hasAction, d.action = true, r.action
	if len(r.conds) == 0 {
		d.uncond, d.rules = true, nil
	} else if !d.uncond {
		d.rules = append(d.rules, r)
	}
	return nil
}

// Compile compiles cfg for the x86 ABIs it lists (x86_64 must be among them,
// or the list must be empty, which means x86_64 alone).
func Compile(cfg *specs.LinuxSeccomp) (Program, error) {
	if cfg == nil {
		return nil, errors.New("no seccomp configuration")
	}
	if len(cfg.Flags) > 0 {
		return nil, fmt.Errorf("seccomp flags %v are not supported", cfg.Flags)
	}
	if cfg.ListenerPath != "" {
		return nil, errors.New("seccomp notify listener is not supported")
	}
	def, err := Action(cfg.DefaultAction, cfg.DefaultErrnoRet)
	if err != nil {
		return nil, fmt.Errorf("default action: %w", err)
	}
	archs := cfg.Architectures
	if len(archs) == 0 {
		archs = []specs.Arch{specs.ArchX86_64}
	}
	var use []abi
	for _, arch := range archs {
		i := slices.IndexFunc(abis, func(a abi) bool { return a.arch == arch })
		if i < 0 {
			return nil, fmt.Errorf("architecture %s is not supported", arch)
		}
		if !slices.ContainsFunc(use, func(a abi) bool { return a.arch == arch }) {
			use = append(use, abis[i])
		}
	}
	if !slices.ContainsFunc(use, func(a abi) bool { return a.arch == specs.ArchX86_64 }) {
		return nil, errors.New("architecture list lacks SCMP_ARCH_X86_64")
	}
	// runc adds its -ENOSYS stub unless the default is permissive or is
	// ENOSYS already.
	stub := def != RetAllow && def != RetLog && def != RetErrno|uint32(unix.ENOSYS)

	sections := make([]section, len(use))
	for i, a := range use {
		s := section{abi: a, decisions: map[uint32]*decision{}}
		for _, sc := range cfg.Syscalls {
			act, err := Action(sc.Action, sc.ErrnoRet)
			if err != nil {
				return nil, fmt.Errorf("syscalls %v: %w", sc.Names, err)
			}
			rules, err := splitRules(sc.Args, act, a.bits)
			if err != nil {
				return nil, fmt.Errorf("syscalls %v: %w", sc.Names, err)
			}
			for _, name := range sc.Names {
				nr, ok := a.table[name]
				if !ok {
					continue // not in this ABI (or unknown): skipped, as runc does
				}
				nr += a.base
				if !s.anyNamed || nr > s.last {
					s.last, s.anyNamed = nr, true
				}
				if act == def {
					continue
				}
				d := s.decisions[nr]
				if d == nil {
					d = &decision{}
					s.decisions[nr] = d
				}
				for _, r := range rules {
					if err := d.add(r); err != nil {
						return nil, fmt.Errorf("syscall %s (%s): %w", name, a.arch, err)
					}
				}
			}
		}
		s.stub = stub && s.anyNamed
		sections[i] = s
	}
	return assemble(sections, def)
}

// splitRules turns one OCI syscall entry's conditions into rules: one rule
// with all of them, or, when an argument is compared twice, one rule per
// condition (runc's behaviour, which docker's profile relies on).
func splitRules(args []specs.LinuxSeccompArg, act uint32, bits int) ([]rule, error) {
	seen := map[uint]bool{}
	dup := false
	for _, c := range args {
		if c.Index > 5 {
			return nil, fmt.Errorf("argument index %d out of range", c.Index)
		}
		switch c.Op {
		case specs.OpNotEqual, specs.OpLessThan, specs.OpLessEqual, specs.OpEqualTo,
			specs.OpGreaterEqual, specs.OpGreaterThan, specs.OpMaskedEqual:
		default:
			return nil, fmt.Errorf("operator %q is not supported", c.Op)
		}
		if bits == 32 && (c.Value > 0xffffffff || (c.Op == specs.OpMaskedEqual && c.ValueTwo > 0xffffffff)) {
			return nil, fmt.Errorf("value %#x of argument %d does not fit a 32-bit ABI", c.Value, c.Index)
		}
		dup = dup || seen[c.Index]
		seen[c.Index] = true
	}
	if !dup {
		return []rule{{conds: args, action: act}}, nil
	}
	rules := make([]rule, len(args))
	for i, c := range args {
		rules[i] = rule{conds: []specs.LinuxSeccompArg{c}, action: act}
	}
	return rules, nil
}

// section is the part of the program for one ABI.
type section struct {
	abi       abi
	decisions map[uint32]*decision
	last      uint32 // highest number the configuration names in this ABI
	anyNamed  bool
	stub      bool // numbers above last return ENOSYS
}

// span is a range of system call numbers with one decision.
type span struct {
	lo, hi uint32
	d      *decision // nil: the default action
	enosys bool
}

// spans covers the section's numbers [lo, hi] with runs of equal decisions.
// With the stub, the numbers above the highest one named return ENOSYS.
func (s *section) spans(lo, hi uint32) []span {
	limit := hi
	if s.stub && s.last < hi {
		limit = s.last
	}
	nrs := make([]uint32, 0, len(s.decisions))
	for nr := range s.decisions {
		if nr >= lo && nr <= limit {
			nrs = append(nrs, nr)
		}
	}
	slices.Sort(nrs)
	var out []span
	add := func(sp span) {
		if n := len(out); n > 0 && out[n-1].hi+1 == sp.lo && sameUncond(out[n-1], sp) {
			out[n-1].hi = sp.hi
			return
		}
		out = append(out, sp)
	}
	next := lo
	for _, nr := range nrs {
		if nr > next {
			add(span{lo: next, hi: nr - 1})
		}
		add(span{lo: nr, hi: nr, d: s.decisions[nr]})
		next = nr + 1
	}
	if next <= limit && (len(nrs) == 0 || nrs[len(nrs)-1] < limit) {
		add(span{lo: next, hi: limit})
	}
	if limit < hi {
		add(span{lo: limit + 1, hi: hi, enosys: true})
	}
	return out
}

// sameUncond reports whether two spans may merge: both the default, both
// ENOSYS, or both the same unconditional action.
func sameUncond(a, b span) bool {
	switch {
	case a.enosys || b.enosys:
		return a.enosys && b.enosys
	case a.d == nil || b.d == nil:
		return a.d == nil && b.d == nil
	}
	return a.d.uncond && b.d.uncond && a.d.action == b.d.action
}

const (
	offNr   = 0
	offArch = 4
	offArgs = 16
)

func assemble(sections []section, def uint32) (Program, error) {
	var g gen
	bySection := map[specs.Arch]*section{}
	for i := range sections {
		bySection[sections[i].abi.arch] = &sections[i]
	}
	x8664, x32, i386 := bySection[specs.ArchX86_64], bySection[specs.ArchX32], bySection[specs.ArchX86]

	lX8664 := g.label()
	g.ld(offArch)
	g.jeq(AuditArchX86_64, lX8664, g.next())
	if i386 != nil {
		lI386 := g.label()
		g.jeq(AuditArchI386, lI386, g.next())
		g.ret(badArch)
		g.bind(lI386)
		g.ld(offNr)
		g.tree(i386, i386.spans(0, 0xffffffff), def)
	} else {
		g.ret(badArch)
	}
	g.bind(lX8664)
	g.ld(offNr)
	lX32 := g.label()
	g.jge(X32Bit, lX32, g.next())
	g.tree(x8664, x8664.spans(0, X32Bit-1), def)
	g.bind(lX32)
	if x32 != nil {
		g.tree(x32, x32.spans(X32Bit, 0xffffffff), def)
	} else {
		g.ret(badArch)
	}
	return g.link()
}

package seccompbpf

import (
	"fmt"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// gen assembles a program with symbolic forward jumps. A conditional jump
// whose target is more than 255 instructions away is rewritten by link into
// a short jump over two unconditional (32-bit offset) jumps.
type gen struct {
	ins    []insn
	labels []int // label -> index of the instruction it precedes; -1 unbound
}

type label int

type insn struct {
	code   uint16
	k      uint32
	jt, jf label // targets of a conditional jump (cond)
	cond   bool
}

func (g *gen) label() label {
	g.labels = append(g.labels, -1)
	return label(len(g.labels) - 1)
}

// next returns a label bound to the instruction after the one about to be
// emitted (a conditional jump's fall-through).
func (g *gen) next() label {
	l := g.label()
	g.labels[l] = len(g.ins) + 1
	return l
}

func (g *gen) bind(l label) {
	if g.labels[l] != -1 {
		panic("seccompbpf: label bound twice")
	}
	g.labels[l] = len(g.ins)
}

func (g *gen) emit(in insn) { g.ins = append(g.ins, in) }

func (g *gen) ld(off uint32) {
	g.emit(insn{code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, k: off})
}

func (g *gen) and(k uint32) {
	g.emit(insn{code: unix.BPF_ALU | unix.BPF_AND | unix.BPF_K, k: k})
}

func (g *gen) ret(k uint32) {
	g.emit(insn{code: unix.BPF_RET | unix.BPF_K, k: k})
}

func (g *gen) jmp(op uint16, k uint32, t, f label) {
	g.emit(insn{code: unix.BPF_JMP | op | unix.BPF_K, k: k, jt: t, jf: f, cond: true})
}

func (g *gen) jeq(k uint32, t, f label) { g.jmp(unix.BPF_JEQ, k, t, f) }
func (g *gen) jgt(k uint32, t, f label) { g.jmp(unix.BPF_JGT, k, t, f) }
func (g *gen) jge(k uint32, t, f label) { g.jmp(unix.BPF_JGE, k, t, f) }

// tree emits a binary search over spans (the accumulator holds the system
// call number) ending in each span's decision.
func (g *gen) tree(s *section, spans []span, def uint32) {
	if len(spans) == 1 {
		g.leaf(s, spans[0], def)
		return
	}
	mid := len(spans) / 2
	right := g.label()
	g.jge(spans[mid].lo, right, g.next())
	g.tree(s, spans[:mid], def)
	g.bind(right)
	g.tree(s, spans[mid:], def)
}

func (g *gen) leaf(s *section, sp span, def uint32) {
	switch {
	case sp.enosys:
		g.ret(RetErrno | uint32(unix.ENOSYS))
	case sp.d == nil:
		g.ret(def)
	case sp.d.uncond:
		g.ret(sp.d.action)
	default:
		// One number with conditional rules: try each in turn.
		for _, r := range sp.d.rules {
			fail := g.label()
			for _, c := range r.conds {
				g.cond(c, s.abi.bits, fail)
			}
			g.ret(r.action)
			g.bind(fail)
		}
		g.ret(def)
	}
}

// cond emits a test of one argument condition: it falls through when the
// condition holds and jumps to fail when it does not.
func (g *gen) cond(c specs.LinuxSeccompArg, bits int, fail label) {
	lo := uint32(offArgs + 8*c.Index) // little endian: low word first
	hi := lo + 4
	vlo, vhi := uint32(c.Value), uint32(c.Value>>32)
	ok := g.label()
	if bits == 32 {
		// Only the low word is compared on a 32-bit ABI.
		g.ld(lo)
		switch c.Op {
		case specs.OpEqualTo:
			g.jeq(vlo, ok, fail)
		case specs.OpNotEqual:
			g.jeq(vlo, fail, ok)
		case specs.OpGreaterThan:
			g.jgt(vlo, ok, fail)
		case specs.OpGreaterEqual:
			g.jge(vlo, ok, fail)
		case specs.OpLessThan:
			g.jge(vlo, fail, ok)
		case specs.OpLessEqual:
			g.jgt(vlo, fail, ok)
		case specs.OpMaskedEqual:
			g.and(vlo)
			g.jeq(uint32(c.ValueTwo), ok, fail)
		}
		g.bind(ok)
		return
	}
	checkLo := g.label()
	g.ld(hi)
	switch c.Op {
	case specs.OpEqualTo:
		g.jeq(vhi, checkLo, fail)
		g.bind(checkLo)
		g.ld(lo)
		g.jeq(vlo, ok, fail)
	case specs.OpNotEqual:
		g.jeq(vhi, checkLo, ok)
		g.bind(checkLo)
		g.ld(lo)
		g.jeq(vlo, fail, ok)
	case specs.OpGreaterThan, specs.OpGreaterEqual:
		eq := g.label()
		g.jgt(vhi, ok, eq)
		g.bind(eq)
		g.jeq(vhi, checkLo, fail)
		g.bind(checkLo)
		g.ld(lo)
		if c.Op == specs.OpGreaterThan {
			g.jgt(vlo, ok, fail)
		} else {
			g.jge(vlo, ok, fail)
		}
	case specs.OpLessThan, specs.OpLessEqual:
		eq := g.label()
		g.jgt(vhi, fail, eq)
		g.bind(eq)
		g.jeq(vhi, checkLo, ok)
		g.bind(checkLo)
		g.ld(lo)
		if c.Op == specs.OpLessThan {
			g.jge(vlo, fail, ok)
		} else {
			g.jgt(vlo, fail, ok)
		}
	case specs.OpMaskedEqual:
		m, want := c.Value, c.ValueTwo
		g.and(uint32(m >> 32))
		g.jeq(uint32(want>>32), checkLo, fail)
		g.bind(checkLo)
		g.ld(lo)
		g.and(uint32(m))
		g.jeq(uint32(want), ok, fail)
	}
	g.bind(ok)
}

// link resolves the labels into jump offsets.
func (g *gen) link() (Program, error) {
	far := make([]bool, len(g.ins))
	pos := make([]int, len(g.ins)+1)
	target := func(l label) (int, error) {
		i := g.labels[l]
		if i < 0 {
			return 0, fmt.Errorf("seccompbpf: unbound label %d", l)
		}
		return pos[i], nil
	}
	for {
		p := 0
		for i, in := range g.ins {
			pos[i] = p
			p++
			if in.cond && far[i] {
				p += 2
			}
		}
		pos[len(g.ins)] = p
		changed := false
		for i, in := range g.ins {
			if !in.cond || far[i] {
				continue
			}
			t, err := target(in.jt)
			if err != nil {
				return nil, err
			}
			f, err := target(in.jf)
			if err != nil {
				return nil, err
			}
			if t-pos[i]-1 > 255 || f-pos[i]-1 > 255 {
				far[i], changed = true, true
			}
		}
		if !changed {
			break
		}
	}
	if pos[len(g.ins)] > maxInsns {
		return nil, fmt.Errorf("seccomp program of %d instructions exceeds the kernel's %d", pos[len(g.ins)], maxInsns)
	}
	var prog Program
	for i, in := range g.ins {
		switch {
		case in.cond:
			t, _ := target(in.jt)
			f, _ := target(in.jf)
			if t <= pos[i] || f <= pos[i] {
				return nil, fmt.Errorf("seccompbpf: backward jump at %d", i)
			}
			if !far[i] {
				prog = append(prog, unix.SockFilter{Code: in.code, Jt: uint8(t - pos[i] - 1), Jf: uint8(f - pos[i] - 1), K: in.k})
				continue
			}
			// jcond k, 0, 1; ja t; ja f
			prog = append(prog,
				unix.SockFilter{Code: in.code, Jt: 0, Jf: 1, K: in.k},
				unix.SockFilter{Code: unix.BPF_JMP | unix.BPF_JA, K: uint32(t - (pos[i] + 1) - 1)},
				unix.SockFilter{Code: unix.BPF_JMP | unix.BPF_JA, K: uint32(f - (pos[i] + 2) - 1)},
			)
		default:
			prog = append(prog, unix.SockFilter{Code: in.code, K: in.k})
		}
	}
	return prog, nil
}

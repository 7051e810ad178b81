package seccompbpf

import (
	"encoding/binary"
	"fmt"

	"golang.org/x/sys/unix"
)

// Data is the kernel's struct seccomp_data: what a filter sees of a system
// call.
type Data struct {
	Nr   uint32
	Arch uint32
	IP   uint64
	Args [6]uint64
}

// Bytes encodes d as the kernel lays it out (x86: little endian).
func (d Data) Bytes() []byte {
	b := make([]byte, 64)
	binary.LittleEndian.PutUint32(b[0:], d.Nr)
	binary.LittleEndian.PutUint32(b[4:], d.Arch)
	binary.LittleEndian.PutUint64(b[8:], d.IP)
	for i, a := range d.Args {
		binary.LittleEndian.PutUint64(b[16+8*i:], a)
	}
	return b
}

// Run interprets a seccomp filter (any classic BPF program the kernel
// accepts for seccomp, such as libseccomp's, not only Compile's) on d and
// returns its verdict. It is for tests and tools that compare filters.
func Run(p Program, d Data) (uint32, error) {
	data := d.Bytes()
	var a, x uint32
	var mem [16]uint32
	for pc := 0; pc < len(p); pc++ {
		in := p[pc]
		k := in.K
		src := func() uint32 {
			if in.Code&0x08 == unix.BPF_X {
				return x
			}
			return k
		}
		switch in.Code & 0x07 { // class
		case unix.BPF_LD, unix.BPF_LDX:
			var v uint32
			switch in.Code & 0xe0 { // mode
			case unix.BPF_ABS:
				if in.Code&0x18 != unix.BPF_W || k%4 != 0 || k+4 > uint32(len(data)) {
					return 0, fmt.Errorf("pc %d: bad load %#x at %d", pc, in.Code, k)
				}
				v = binary.LittleEndian.Uint32(data[k:])
			case unix.BPF_IMM:
				v = k
			case unix.BPF_MEM:
				if k >= 16 {
					return 0, fmt.Errorf("pc %d: scratch %d", pc, k)
				}
				v = mem[k]
			case unix.BPF_LEN:
				v = uint32(len(data))
			default:
				return 0, fmt.Errorf("pc %d: unsupported load %#x", pc, in.Code)
			}
			if in.Code&0x07 == unix.BPF_LD {
				a = v
			} else {
				x = v
			}
		case unix.BPF_ST, unix.BPF_STX:
			if k >= 16 {
				return 0, fmt.Errorf("pc %d: scratch %d", pc, k)
			}
			if in.Code&0x07 == unix.BPF_ST {
				mem[k] = a
			} else {
				mem[k] = x
			}
		case unix.BPF_ALU:
			s := src()
			switch in.Code & 0xf0 {
			case unix.BPF_ADD:
				a += s
			case unix.BPF_SUB:
				a -= s
			case unix.BPF_MUL:
				a *= s
			case unix.BPF_DIV:
				if s == 0 {
					return 0, nil // the kernel returns 0 (kill)
				}
				a /= s
			case unix.BPF_MOD:
				if s == 0 {
					return 0, nil
				}
				a %= s
			case unix.BPF_AND:
				a &= s
			case unix.BPF_OR:
				a |= s
			case unix.BPF_XOR:
				a ^= s
			case unix.BPF_LSH:
				a <<= s & 31
			case unix.BPF_RSH:
				a >>= s & 31
			case unix.BPF_NEG:
				a = -a
			default:
				return 0, fmt.Errorf("pc %d: unsupported alu %#x", pc, in.Code)
			}
		case unix.BPF_JMP:
			if in.Code&0xf0 == unix.BPF_JA {
				pc += int(k)
				break
			}
			s := src()
			var taken bool
			switch in.Code & 0xf0 {
			case unix.BPF_JEQ:
				taken = a == s
			case unix.BPF_JGT:
				taken = a > s
			case unix.BPF_JGE:
				taken = a >= s
			case unix.BPF_JSET:
				taken = a&s != 0
			default:
				return 0, fmt.Errorf("pc %d: unsupported jump %#x", pc, in.Code)
			}
			if taken {
				pc += int(in.Jt)
			} else {
				pc += int(in.Jf)
			}
		case unix.BPF_RET:
			if in.Code&0x18 == unix.BPF_A {
				return a, nil
			}
			return k, nil
		case unix.BPF_MISC:
			if in.Code&0xf8 == unix.BPF_TAX {
				x = a
			} else {
				a = x
			}
		}
		if pc+1 >= len(p) {
			return 0, fmt.Errorf("pc %d: runs past the end", pc)
		}
	}
	return 0, fmt.Errorf("program ends without a return")
}

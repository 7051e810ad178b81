package layer

// Checking an EROFS image that Shoal did not build (an import) before the
// host kernel mounts it. Two userspace checks, both before the image is
// installed:
//
//   - checkErofs (this file, pure Go) reads the superblock and walks every
//     directory from the root as the kernel resolves paths: every inode a
//     path reaches is decoded and must be a regular file, a directory, a
//     symlink or an overlayfs whiteout (a character device 0/0): no other
//     device node, fifo or socket; no set-user-ID or set-group-ID file
//     unless the importer may (the admin); directories only in the two
//     flat layouts, every dirent, inline tail and block inside the image,
//     no directory reached twice (a cycle), feature bits limited to those
//     Shoal's own mkfs.erofs writes. It counts the tree's entries and
//     bytes (the record's Files and ContentBytes are these, not the
//     importer's word).
//   - fsck.erofs --extract (erofs-utils, no destination: nothing is
//     written) decodes every file's data, compressed or not, and the
//     image's metadata (xattrs, compression indexes), failing on anything
//     malformed.
//
// What remains for the kernel to parse is an image that both parsers read
// to the end without finding anything wrong, holding only what a Shoal
// build could hold.

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"slices"
	"strings"
	"time"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// ErrBadImage marks an image that fails the checks of an import; the
// message says which rule it broke (errdefs.ErrInvalidArgument).
var ErrBadImage = errdefs.Mark(errdefs.ErrInvalidArgument, errors.New("image refused"))

const (
	erofsSuperOffset = 1024
	erofsSuperSize   = 128
	erofsSlotBits    = 5 // an inode's nid counts 32-byte slots

	// incompat features the walk understands and Shoal's mkfs.erofs 1.5
	// writes: 0-padding of compressed data (lz4, lz4hc) and
	// compression configs; anything else (chunked files, device tables,
	// fragments, 48-bit layouts, ...) is refused.
	erofsIncompatKnown = 0x1 | 0x2

	erofsLayoutFlatPlain  = 0
	erofsLayoutFlatInline = 2

	// Bounds of the walk: entries and directory depth.
	verifyMaxEntries = 4 << 20
	verifyMaxDepth   = 4096
	verifyMaxBytes   = 1 << 50 // of content, hard links counted each time
	// fsckTimeout bounds fsck.erofs's pass over an image.
	fsckTimeout = 30 * time.Minute
)

// Unix file types and set-id bits of an inode's i_mode.
const (
	modeType  = 0o170000
	modeReg   = 0o100000
	modeDir   = 0o040000
	modeLnk   = 0o120000
	modeChr   = 0o020000
	modeSetID = 0o6000
)

// erofsStats is what the walk counted: entries (not the root) and bytes of
// regular files.
type erofsStats struct {
	files, bytes int64
}

type erofsInode struct {
	nid      uint64
	mode     uint16
	layout   int
	size     uint64
	u        uint32 // raw block address, or rdev of a device
	isize    int64  // inode and its xattrs
	inodeOff int64  // byte offset of the inode
}

type erofsWalker struct {
	r          io.ReaderAt
	size       int64 // of the image
	blkBits    uint
	metaBlk    int64
	allowSetID bool
	st         erofsStats
	dirs       map[uint64]bool // directories reached
}

// checkErofs checks an EROFS image of size bytes read through r against
// Shoal's rules (see the top of this file). Errors wrap ErrBadImage.
func checkErofs(ctx context.Context, r io.ReaderAt, size int64, allowSetID bool) (erofsStats, error) {
	var sb [erofsSuperSize]byte
	if size < erofsSuperOffset+erofsSuperSize {
		return erofsStats{}, fmt.Errorf("%w: %d bytes: too short for an EROFS image", ErrBadImage, size)
	}
	if _, err := r.ReadAt(sb[:], erofsSuperOffset); err != nil {
		return erofsStats{}, fmt.Errorf("%w: read superblock: %v", ErrBadImage, err)
	}
	le := binary.LittleEndian
	if le.Uint32(sb[0:]) != erofsMagic {
		return erofsStats{}, fmt.Errorf("%w: not an EROFS image (no superblock magic at byte 1024)", ErrBadImage)
	}
	blkBits := uint(sb[12])
	if blkBits < 9 || blkBits > 12 {
		return erofsStats{}, fmt.Errorf("%w: block size 2^%d: want 512 to 4096 bytes", ErrBadImage, blkBits)
	}
	if f := le.Uint32(sb[80:]); f&^erofsIncompatKnown != 0 {
		return erofsStats{}, fmt.Errorf("%w: incompatible features %#x that Shoal's builds never use", ErrBadImage, f&^erofsIncompatKnown)
	}
	if blocks := int64(le.Uint32(sb[36:])); blocks<<blkBits != size {
		return erofsStats{}, fmt.Errorf("%w: %d bytes, but its superblock counts %d blocks of %d", ErrBadImage, size, blocks, 1<<blkBits)
	}
	if sb[13] != 0 || le.Uint16(sb[86:]) != 0 || sb[90] != 0 {
		return erofsStats{}, fmt.Errorf("%w: superblock extension slots, extra devices or a directory block size: not made by Shoal", ErrBadImage)
	}
	w := &erofsWalker{r: r, size: size, blkBits: blkBits, metaBlk: int64(le.Uint32(sb[40:])), allowSetID: allowSetID, dirs: map[uint64]bool{}}
	root, err := w.inode(uint64(le.Uint16(sb[14:])))
	if err != nil {
		return erofsStats{}, fmt.Errorf("%w: root: %v", ErrBadImage, err)
	}
	if root.mode&modeType != modeDir {
		return erofsStats{}, fmt.Errorf("%w: the root is not a directory", ErrBadImage)
	}
	if err := w.walk(ctx, root); err != nil {
		return erofsStats{}, err
	}
	return w.st, nil
}

// inode decodes the inode of nid.
func (w *erofsWalker) inode(nid uint64) (erofsInode, error) {
	if nid > uint64(w.size)>>erofsSlotBits {
		return erofsInode{}, fmt.Errorf("inode %d is outside the image", nid)
	}
	off := w.metaBlk<<w.blkBits + int64(nid)<<erofsSlotBits
	if off < 0 || off+32 > w.size {
		return erofsInode{}, fmt.Errorf("inode %d is outside the image", nid)
	}
	var b [64]byte
	n := 32
	if _, err := w.r.ReadAt(b[:32], off); err != nil {
		return erofsInode{}, fmt.Errorf("read inode %d: %v", nid, err)
	}
	le := binary.LittleEndian
	format := le.Uint16(b[0:])
	if format&^0xf != 0 {
		return erofsInode{}, fmt.Errorf("inode %d: unknown format bits %#x", nid, format)
	}
	in := erofsInode{nid: nid, layout: int(format>>1) & 7, mode: le.Uint16(b[4:]), u: le.Uint32(b[16:]), inodeOff: off}
	if format&1 == 0 { // compact
		in.size = uint64(le.Uint32(b[8:]))
	} else { // extended
		n = 64
		if off+64 > w.size {
			return erofsInode{}, fmt.Errorf("inode %d is outside the image", nid)
		}
		if _, err := w.r.ReadAt(b[32:64], off+32); err != nil {
			return erofsInode{}, fmt.Errorf("read inode %d: %v", nid, err)
		}
		in.size = le.Uint64(b[8:])
	}
	in.isize = int64(n)
	if xc := int64(le.Uint16(b[2:])); xc != 0 {
		in.isize += 12 + (xc-1)*4
	}
	if in.layout > 4 {
		return erofsInode{}, fmt.Errorf("inode %d: unknown data layout %d", nid, in.layout)
	}
	return in, nil
}

// check applies Shoal's rules to the inode of entry name of directory d.
func (w *erofsWalker) check(d *dirFrame, name string, in erofsInode) error {
	p := func() string { return d.path(name) }
	switch in.mode & modeType {
	case modeReg:
		if in.size > verifyMaxBytes || w.st.bytes+int64(in.size) > verifyMaxBytes {
			return fmt.Errorf("%w: %s: a file of %d bytes, more than %d in all", ErrBadImage, p(), in.size, int64(verifyMaxBytes))
		}
		w.st.bytes += int64(in.size)
	case modeDir:
		if in.mode&modeSetID&^0o2000 != 0 {
			return fmt.Errorf("%w: %s: a set-user-ID directory", ErrBadImage, p())
		}
		return nil
	case modeLnk:
		if in.size == 0 || in.size > 4095 {
			return fmt.Errorf("%w: %s: a symlink target of %d bytes", ErrBadImage, p(), in.size)
		}
	case modeChr:
		if in.u != 0 {
			return fmt.Errorf("%w: %s is a character device %d:%d: device nodes are not allowed in a layer (only overlayfs whiteouts, 0:0)", ErrBadImage, p(), in.u>>8&0xfff, in.u&0xff|in.u>>12&0xfff00)
		}
	default:
		return fmt.Errorf("%w: %s is a %s: device nodes, fifos and sockets are not allowed in a layer", ErrBadImage, p(), modeName(in.mode))
	}
	if in.mode&modeSetID != 0 && !w.allowSetID {
		return fmt.Errorf("%w: %s is set-user-ID or set-group-ID (mode %#o): only the admin may import such files", ErrBadImage, p(), in.mode&0o7777)
	}
	return nil
}

func modeName(m uint16) string {
	switch m & modeType {
	case 0o060000:
		return "block device"
	case 0o010000:
		return "fifo"
	case 0o140000:
		return "socket"
	}
	return fmt.Sprintf("file of unknown type %#o", m&modeType)
}

// dirFrame is a directory being walked. Its path is built only for an
// error: entries of deep directories must not each cost a copy of it.
type dirFrame struct {
	in     erofsInode
	parent *dirFrame
	name   string
	depth  int
}

// path is the directory's path, or that of its entry name ("" : none),
// the last 512 bytes of it at most.
func (d *dirFrame) path(name string) string {
	parts := []string{}
	if name != "" {
		parts = append(parts, name)
	}
	n := len(name)
	for f := d; f != nil && f.parent != nil && n < 512; f = f.parent {
		parts = append(parts, f.name)
		n += len(f.name) + 1
	}
	slices.Reverse(parts)
	p := "/" + strings.Join(parts, "/")
	if len(p) > 512 {
		p = "..." + p[len(p)-512:]
	}
	return p
}

// walk visits every entry under root, depth first, without recursion.
func (w *erofsWalker) walk(ctx context.Context, root erofsInode) error {
	w.dirs[root.nid] = true
	stack := []*dirFrame{{in: root}}
	for len(stack) > 0 {
		if err := ctx.Err(); err != nil {
			return err
		}
		d := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		err := w.readDir(d, func(name string, nid uint64) error {
			w.st.files++
			if w.st.files > verifyMaxEntries {
				return fmt.Errorf("%w: more than %d entries", ErrBadImage, verifyMaxEntries)
			}
			in, err := w.inode(nid)
			if err != nil {
				return fmt.Errorf("%w: %s: %v", ErrBadImage, d.path(name), err)
			}
			if err := w.check(d, name, in); err != nil {
				return err
			}
			if in.mode&modeType != modeDir {
				return nil
			}
			if w.dirs[nid] {
				return fmt.Errorf("%w: %s: a directory reached twice (a hard link or a cycle)", ErrBadImage, d.path(name))
			}
			if d.depth+1 > verifyMaxDepth {
				return fmt.Errorf("%w: %s: directories nested deeper than %d", ErrBadImage, d.path(name), verifyMaxDepth)
			}
			w.dirs[nid] = true
			stack = append(stack, &dirFrame{in: in, parent: d, name: name, depth: d.depth + 1})
			return nil
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// readDir calls fn for every entry of directory in but "." and "..".
func (w *erofsWalker) readDir(d *dirFrame, fn func(name string, nid uint64) error) error {
	in := d.in
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: directory %s: %s", ErrBadImage, d.path(""), fmt.Sprintf(format, args...))
	}
	if in.layout != erofsLayoutFlatPlain && in.layout != erofsLayoutFlatInline {
		return bad("data layout %d (directories are flat in Shoal's images)", in.layout)
	}
	blk := int64(1) << w.blkBits
	if in.size > uint64(w.size) {
		return bad("%d bytes, more than the image", in.size)
	}
	size := int64(in.size)
	nblocks := (size + blk - 1) >> w.blkBits
	buf := make([]byte, blk)
	for i := int64(0); i < nblocks; i++ {
		n := min(blk, size-i*blk)
		var off int64
		if in.layout == erofsLayoutFlatInline && i == nblocks-1 {
			off = in.inodeOff + in.isize
			// The kernel reads an inline tail only within the inode's block.
			if (off&(blk-1))+n > blk {
				return bad("its inline tail crosses a block boundary")
			}
		} else {
			off = (int64(in.u) + i) << w.blkBits
		}
		if off < 0 || off+n > w.size {
			return bad("block %d is outside the image", i)
		}
		b := buf[:n]
		if _, err := w.r.ReadAt(b, off); err != nil {
			return bad("read block %d: %v", i, err)
		}
		if err := dirBlock(b, func(name []byte, nid uint64) error {
			if string(name) == "." || string(name) == ".." {
				return nil
			}
			return fn(string(name), nid)
		}); err != nil {
			return bad("block %d: %v", i, err)
		}
	}
	return nil
}

// dirBlock decodes the dirents of one directory block: 12-byte records
// (nid, name offset, type, reserved), then their names; the first name's
// offset says how many records there are. A name ends at the next one's
// offset, the last one at the end of the block or at its first NUL.
func dirBlock(b []byte, fn func(name []byte, nid uint64) error) error {
	const direntSize = 12
	if len(b) < direntSize {
		return fmt.Errorf("%d bytes: no room for an entry", len(b))
	}
	le := binary.LittleEndian
	first := int(le.Uint16(b[8:]))
	if first < direntSize || first%direntSize != 0 || first > len(b) {
		return fmt.Errorf("bad first name offset %d", first)
	}
	n := first / direntSize
	for i := 0; i < n; i++ {
		d := b[i*direntSize:]
		start := int(le.Uint16(d[8:]))
		end := len(b)
		if i+1 < n {
			end = int(le.Uint16(d[direntSize+8:]))
		}
		if start < first || end > len(b) || start >= end {
			return fmt.Errorf("entry %d: name at %d..%d", i, start, end)
		}
		name := b[start:end]
		if i+1 == n {
			if z := bytes.IndexByte(name, 0); z >= 0 {
				name = name[:z]
			}
		}
		if len(name) == 0 || len(name) > 255 || bytes.IndexByte(name, '/') >= 0 || bytes.IndexByte(name, 0) >= 0 {
			return fmt.Errorf("entry %d: bad name %q", i, name)
		}
		if err := fn(name, le.Uint64(d[0:])); err != nil {
			return err
		}
	}
	return nil
}

// fsckErofs runs erofs-utils' fsck.erofs over the image at path, decoding
// every file's data without writing it anywhere.
func fsckErofs(ctx context.Context, path string) error {
	ctx, cancel := context.WithTimeout(ctx, fsckTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "fsck.erofs", "--extract", path)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.WaitDelay = time.Second
	if err := cmd.Run(); err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("fsck.erofs: %w", ctx.Err())
		}
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return fmt.Errorf("%w: fsck.erofs: %s", ErrBadImage, strings.TrimSpace(lastBytes(out.String(), 512)))
		}
		return fmt.Errorf("fsck.erofs: %w", err)
	}
	return nil
}

package node

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"github.com/shoal-sandbox/shoal/internal/dockerfile"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

const (
	syscallNoFollow = syscall.O_NOFOLLOW
	maxCopyEntries  = 1 << 20 // entries one COPY writes
)

type copyOpts struct {
	uid, gid int
	mode     fs.FileMode // 0: the source's
	entries  int
}

// copyStep runs COPY and ADD (local sources only): from the build context
// (what .dockerignore leaves in) or, with --from, from an earlier stage.
func (b *dockerBuilder) copyStep(ctx context.Context, in dockerfile.Instruction, st *stage) error {
	allowed := []string{"chown", "chmod"}
	if in.Cmd == "COPY" {
		allowed = append(allowed, "from")
	}
	if err := in.CheckFlags(allowed...); err != nil {
		return err
	}
	var words []string
	if in.JSON {
		words = in.Args
	} else if len(in.Args) == 1 {
		var err error
		if words, err = dockerfile.Words(in.Args[0], b.escape); err != nil {
			return err
		}
	}
	if len(words) < 2 {
		return errdefs.New(errdefs.ErrInvalidArgument, "want %s SRC... DEST", in.Cmd)
	}
	for i, w := range words {
		var err error
		if words[i], err = dockerfile.Expand(w, b.escape, st.lookup); err != nil {
			return err
		}
	}
	srcs, dest := words[:len(words)-1], words[len(words)-1]
	o := copyOpts{}
	if v, ok := in.Flag("chown"); ok {
		u, g, hasG := strings.Cut(v, ":")
		var err1, err2 error
		o.uid, err1 = strconv.Atoi(u)
		o.gid = o.uid
		if hasG {
			o.gid, err2 = strconv.Atoi(g)
		}
		if err1 != nil || err2 != nil || o.uid < 0 || o.gid < 0 || o.uid > 1<<31-2 || o.gid > 1<<31-2 {
			return errdefs.New(errdefs.ErrInvalidArgument, "--chown=%.32s: give numeric UID[:GID] (user names are not looked up)", v)
		}
	}
	if v, ok := in.Flag("chmod"); ok {
		m, err := strconv.ParseUint(v, 8, 32)
		if err != nil || m > 0o7777 {
			return errdefs.New(errdefs.ErrInvalidArgument, "--chmod=%.32s: give an octal mode", v)
		}
		o.mode = fs.FileMode(m&0o777) | modeBits(uint32(m))
	}
	var from *stage
	if v, ok := in.Flag("from"); ok {
		if from = b.stage(v); from == nil || from == st {
			return errdefs.New(errdefs.ErrInvalidArgument, "COPY --from=%.64s: no earlier stage of that name (images and layers are not taken here; FROM them in a stage)", v)
		}
	}
	if !path.IsAbs(dest) {
		dest = path.Join("/", st.cfg.WorkingDir, dest)
	}
	destDir := strings.HasSuffix(words[len(words)-1], "/") || len(srcs) > 1
	// Sources, checked and digested before anything is mounted.
	var rels []string
	inputs := []string{}
	for _, s := range srcs {
		if in.Cmd == "ADD" && (strings.Contains(s, "://") || strings.HasPrefix(s, "git@")) {
			return errdefs.New(errdefs.ErrInvalidArgument, "ADD of a URL (%.128s) is not supported: fetch it in a RUN (with the egress the build is given)", s)
		}
		rel := strings.TrimLeft(path.Clean(s), "/")
		if rel == "" {
			rel = "."
		}
		if !filepath.IsLocal(rel) && rel != "." {
			return errdefs.New(errdefs.ErrInvalidArgument, "%s source %.128q is outside the build context", in.Cmd, s)
		}
		var matched []string
		if from == nil {
			if strings.ContainsAny(rel, "*?[") {
				var err error
				if matched, err = b.glob(rel); err != nil {
					return err
				}
				destDir = true
			} else {
				if b.excluded(rel) {
					return errdefs.New(errdefs.ErrNotFound, "%s source %.128q: left out by .dockerignore", in.Cmd, s)
				}
				if _, err := b.ctxRoot.Lstat(rel); err != nil {
					return errdefs.Mark(errdefs.ErrNotFound, fmt.Errorf("%s source %.128q: %w (is it in the build context, or outside it through a symlink?)", in.Cmd, s, unwrapPath(err)))
				}
				matched = []string{rel}
			}
			for _, m := range matched {
				if in.Cmd == "ADD" {
					if err := b.refuseArchive(m); err != nil {
						return err
					}
				}
				d, err := hashTree(b.ctxRoot, m, b.excluded)
				if err != nil {
					return fmt.Errorf("%s source %.128q: %w", in.Cmd, m, unwrapPath(err))
				}
				inputs = append(inputs, m+"="+d)
			}
		} else {
			matched = []string{rel}
			inputs = append(inputs, "stage "+from.key+" "+rel)
		}
		rels = append(rels, matched...)
	}
	text := in.Cmd + " " + jsonString(in.Flags) + " " + jsonString(srcs) + " " + dest
	st.key = dockerfile.StepKey(st.key, text, inputs...)
	return b.hostStep(ctx, in, st, st.key, func(dst *os.Root) (bool, error) {
		do := func(src *os.Root, ignore func(string) bool) error {
			for _, rel := range rels {
				fi, err := src.Lstat(rel)
				if err != nil {
					return fmt.Errorf("%s source %.128q: %w", in.Cmd, rel, unwrapPath(err))
				}
				target := strings.TrimPrefix(dest, "/")
				if !fi.IsDir() {
					isDir := false
					if di, err := dst.Stat(target + "/."); err == nil && di.IsDir() {
						isDir = true
					}
					if destDir || isDir {
						target = path.Join(target, path.Base(rel))
					}
				}
				if target == "" {
					target = "."
				}
				if err := copyEntry(src, rel, dst, target, &o, ignore, 0); err != nil {
					return err
				}
			}
			return nil
		}
		if from == nil {
			return true, do(b.ctxRoot, b.excluded)
		}
		_, cleanup, err := b.withStack(from, func(src *os.Root) error {
			return do(src, func(string) bool { return false })
		})
		if cleanup != nil {
			cleanup()
		}
		return true, err
	})
}

func (b *dockerBuilder) excluded(rel string) bool {
	if rel == "." {
		return false
	}
	return b.ignore.Excluded(rel)
}

// glob matches a pattern against the context, one component at a time.
func (b *dockerBuilder) glob(pattern string) ([]string, error) {
	parts := strings.Split(pattern, "/")
	cur := []string{"."}
	for _, p := range parts {
		var next []string
		for _, c := range cur {
			if !strings.ContainsAny(p, "*?[") {
				n := path.Join(c, p)
				if _, err := b.ctxRoot.Lstat(n); err == nil && !b.excluded(n) {
					next = append(next, n)
				}
				continue
			}
			d, err := b.ctxRoot.Open(c)
			if err != nil {
				continue
			}
			names, _ := d.Readdirnames(-1)
			d.Close()
			slices.Sort(names)
			for _, n := range names {
				ok, err := path.Match(p, n)
				if err != nil {
					return nil, errdefs.New(errdefs.ErrInvalidArgument, "pattern %.128q: %v", pattern, err)
				}
				if ok && !b.excluded(path.Join(c, n)) {
					next = append(next, path.Join(c, n))
				}
			}
			if len(next) > maxCopySources {
				return nil, errdefs.New(errdefs.ErrInvalidArgument, "pattern %.128q matches more than %d files", pattern, maxCopySources)
			}
		}
		cur = next
	}
	if len(cur) == 0 {
		return nil, errdefs.New(errdefs.ErrNotFound, "source %.128q matches no file of the build context", pattern)
	}
	return cur, nil
}

// refuseArchive refuses ADD of a local archive (which docker unpacks):
// Shoal copies files as they are; unpack it in a RUN.
func (b *dockerBuilder) refuseArchive(rel string) error {
	f, err := b.ctxRoot.OpenFile(rel, os.O_RDONLY|syscallNoFollow, 0)
	if err != nil {
		return nil // a directory or a symlink: copied as it is
	}
	defer f.Close()
	head := make([]byte, 512)
	n, _ := io.ReadFull(f, head)
	head = head[:n]
	archive := bytes.HasPrefix(head, []byte{0x1f, 0x8b}) || bytes.HasPrefix(head, []byte{0x28, 0xb5, 0x2f, 0xfd}) ||
		bytes.HasPrefix(head, []byte("BZh")) || bytes.HasPrefix(head, []byte{0xfd, '7', 'z', 'X', 'Z', 0}) ||
		(n >= 262 && string(head[257:262]) == "ustar")
	if archive {
		return errdefs.New(errdefs.ErrInvalidArgument, "ADD of the archive %.128q: unpacking archives is not supported; COPY it and unpack it in a RUN", rel)
	}
	return nil
}

func unwrapPath(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}

func modeBits(m uint32) fs.FileMode {
	var out fs.FileMode
	if m&syscall.S_ISUID != 0 {
		out |= fs.ModeSetuid
	}
	if m&syscall.S_ISGID != 0 {
		out |= fs.ModeSetgid
	}
	if m&syscall.S_ISVTX != 0 {
		out |= fs.ModeSticky
	}
	return out
}

// copyEntry copies srel of src to drel of dst (a directory's contents
// into drel), owned by o's ids, never following a symlink of either.
func copyEntry(src *os.Root, srel string, dst *os.Root, drel string, o *copyOpts, ignore func(string) bool, depth int) error {
	if depth > 256 {
		return fmt.Errorf("%s: more than 256 levels of directories", srel)
	}
	if ignore(srel) {
		return nil
	}
	o.entries++
	if o.entries > maxCopyEntries {
		return errdefs.New(errdefs.ErrResourceExhausted, "more than %d files in one COPY", maxCopyEntries)
	}
	fi, err := src.Lstat(srel)
	if err != nil {
		return err
	}
	mode := fi.Mode() & (fs.ModePerm | fs.ModeSetuid | fs.ModeSetgid | fs.ModeSticky)
	if o.mode != 0 {
		mode = o.mode
	}
	if dir := path.Dir(drel); dir != "." {
		if err := dst.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("destination %s: %w", dir, unwrapPath(err))
		}
	}
	switch {
	case fi.IsDir():
		if drel != "." {
			if err := dst.Mkdir(drel, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
				return fmt.Errorf("destination %s: %w", drel, unwrapPath(err))
			}
		}
		d, err := src.Open(srel)
		if err != nil {
			return err
		}
		names, err := d.Readdirnames(-1)
		d.Close()
		if err != nil {
			return err
		}
		slices.Sort(names)
		for _, n := range names {
			if err := copyEntry(src, path.Join(srel, n), dst, path.Join(drel, n), o, ignore, depth+1); err != nil {
				return err
			}
		}
		if srel == "." || drel == "." {
			return nil // the directory's contents, not itself
		}
		if err := dst.Chmod(drel, mode); err != nil {
			return err
		}
		return dst.Lchown(drel, o.uid, o.gid)
	case fi.Mode()&fs.ModeSymlink != 0:
		t, err := src.Readlink(srel)
		if err != nil {
			return err
		}
		if err := dst.Remove(drel); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("destination %s: %w", drel, unwrapPath(err))
		}
		if err := dst.Symlink(t, drel); err != nil {
			return err
		}
		return dst.Lchown(drel, o.uid, o.gid)
	case fi.Mode().IsRegular():
		in, err := src.OpenFile(srel, os.O_RDONLY|syscallNoFollow|syscall.O_NONBLOCK, 0)
		if err != nil {
			return err
		}
		defer in.Close()
		if err := dst.Remove(drel); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("destination %s: %w", drel, unwrapPath(err))
		}
		out, err := dst.OpenFile(drel, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscallNoFollow, 0o600)
		if err != nil {
			return fmt.Errorf("destination %s: %w", drel, unwrapPath(err))
		}
		// At most the size it had: a file growing meanwhile is cut there.
		_, err = io.Copy(out, io.LimitReader(in, fi.Size()))
		if err == nil {
			err = out.Chown(o.uid, o.gid)
		}
		if err == nil {
			err = out.Chmod(mode)
		}
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		return err
	}
	return fmt.Errorf("%s: a %s; COPY takes files, directories and symlinks", srel, fi.Mode().Type())
}

package agent

import (
	"fmt"
	"io"
	"net"
	"os"
)

// MaxListEntries bounds a recursive list (depth > 1): past it the agent
// answers CodeTooMany instead of a partial list.
const MaxListEntries = 10000

// wireListRequest is the list request. Depth 0 or 1 lists the directory's
// own entries (unbounded, streamed); n > 1 also lists n-1 levels of
// subdirectories, and each entry's name is then its path relative to the
// listed directory ("sub/file").
type wireListRequest struct {
	Path  string `json:"path"`
	Depth int    `json:"depth,omitempty"`
	User  string `json:"user,omitempty"` // list as this user (users.go)
	// WithXattrs: entries carry their user.* extended attributes.
	WithXattrs bool `json:"with_xattrs,omitempty"`
}

func listOp(c net.Conn, req *wireListRequest) {
	path, ok := cleanPath(req.Path)
	if !ok {
		sendError(c, CodeInvalid, errBadPath)
		return
	}
	if req.Depth < 0 {
		sendError(c, CodeInvalid, "depth must not be negative")
		return
	}
	if req.Depth <= 1 {
		listDir(c, path, req.WithXattrs)
		return
	}
	fi, err := os.Stat(path)
	if err != nil {
		sendOSError(c, err, path)
		return
	}
	if !fi.IsDir() {
		sendError(c, CodeNotDir, "not a directory")
		return
	}
	t := &treeLister{c: c, depth: req.Depth, names: idNames{xattrs: req.WithXattrs}}
	if err := t.walk(path, "", 1); err != nil {
		if err == errTooManyEntries {
			sendError(c, CodeTooMany, fmt.Sprintf("more than %d entries within depth %d: list a narrower directory or a smaller depth", MaxListEntries, req.Depth))
			return
		}
		sendOSError(c, err, path)
		return
	}
	if t.flush() == nil {
		writeFrame(c, FrameEOF, nil)
	}
}

var errTooManyEntries = fmt.Errorf("more than %d entries", MaxListEntries)

type treeLister struct {
	c     net.Conn
	depth int
	count int
	batch []wireFileInfo
	werr  error
	names idNames
}

// walk lists dir (at level, 1 being the listed directory), then descends
// into its subdirectories (not through symlinks) while level < depth.
// Subdirectories that cannot be read are listed but not descended into.
func (t *treeLister) walk(dir, rel string, level int) error {
	f, err := os.Open(dir)
	if err != nil {
		if level == 1 {
			return err
		}
		return nil
	}
	type subdir struct{ path, rel string }
	var subdirs []subdir
	for {
		ents, rerr := f.ReadDir(256)
		for _, e := range ents {
			fi, err := e.Info() // lstat
			if err != nil {
				continue // removed meanwhile
			}
			t.count++
			if t.count > MaxListEntries {
				f.Close()
				return errTooManyEntries
			}
			name := e.Name()
			if rel != "" {
				name = rel + "/" + name
			}
			p := joinPath(dir, e.Name())
			w := toWire(fi, p, &t.names)
			w.Name = name
			t.batch = append(t.batch, w)
			if len(t.batch) >= 256 {
				if err := t.flush(); err != nil {
					f.Close()
					return err
				}
			}
			if fi.IsDir() && level < t.depth && !skipDescend(p) {
				subdirs = append(subdirs, subdir{p, name})
			}
		}
		if rerr == io.EOF || (rerr == nil && len(ents) == 0) {
			break
		}
		if rerr != nil {
			f.Close()
			if level == 1 {
				return rerr
			}
			return nil
		}
	}
	f.Close()
	for _, sub := range subdirs {
		if err := t.walk(sub.path, sub.rel, level+1); err != nil {
			return err
		}
	}
	return nil
}

func (t *treeLister) flush() error {
	if t.werr != nil || len(t.batch) == 0 {
		return t.werr
	}
	t.werr = writeJSONFrame(t.c, FrameData, t.batch)
	t.batch = t.batch[:0]
	return t.werr
}

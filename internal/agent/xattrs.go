package agent

// User extended attributes ("user.*") of files: set on a file as it is
// written (wirePathRequest.Xattrs), read into entries when asked
// (WithXattrs). E2B keeps a file's metadata this way (user.e2b.*). Both
// directions are bounded: at most maxXattrs attributes, names of at most
// 255 bytes, values of at most maxXattrValue bytes, maxXattrTotal in all per
// file; past that a write is refused and a read stops.

import (
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

const (
	maxXattrs     = 64
	maxXattrValue = 4096
	maxXattrTotal = 64 << 10
)

// checkXattrs validates attributes to set (names without "user.").
func checkXattrs(x map[string]string) *wireError {
	if len(x) > maxXattrs {
		return &wireError{Code: CodeInvalid, Msg: "more than 64 extended attributes"}
	}
	total := 0
	for k, v := range x {
		if k == "" || len(k) > 250 || strings.IndexByte(k, 0) >= 0 || len(v) > maxXattrValue {
			return &wireError{Code: CodeInvalid, Msg: "extended attribute " + truncName(k) + ": a name of 1-250 bytes and a value of at most 4096"}
		}
		total += len(k) + len(v)
	}
	if total > maxXattrTotal {
		return &wireError{Code: CodeInvalid, Msg: "extended attributes of more than 64 KiB"}
	}
	return nil
}

// setXattrs sets user.NAME=VALUE on f.
func setXattrs(f *os.File, x map[string]string) error {
	for k, v := range x {
		if err := unix.Fsetxattr(int(f.Fd()), "user."+k, []byte(v), 0); err != nil {
			return &os.PathError{Op: "setxattr", Path: f.Name(), Err: err}
		}
	}
	return nil
}

// readXattrs returns path's user.* attributes (not following a symlink),
// names without "user.", within the bounds above; nil when it has none or
// they cannot be read.
func readXattrs(path string) map[string]string {
	buf := make([]byte, 16<<10)
	n, err := unix.Llistxattr(path, buf)
	if err != nil || n <= 0 {
		return nil
	}
	var out map[string]string
	total := 0
	val := make([]byte, maxXattrValue)
	for _, name := range strings.Split(string(buf[:n]), "\x00") {
		key, ok := strings.CutPrefix(name, "user.")
		if !ok || key == "" {
			continue
		}
		m, err := unix.Lgetxattr(path, name, val)
		if err != nil || m < 0 {
			continue // gone, or larger than we read
		}
		total += len(key) + m
		if len(out) >= maxXattrs || total > maxXattrTotal {
			break
		}
		if out == nil {
			out = map[string]string{}
		}
		out[key] = string(val[:m])
	}
	return out
}

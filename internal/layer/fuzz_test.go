package layer

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"golang.org/x/sys/unix"
)

// FuzzParseRef: any string parses to exactly one form or to ErrInvalidRef,
// never a panic; an accepted ref has a valid name/version/digest.
func FuzzParseRef(f *testing.F) {
	for _, s := range []string{"debian:12", "python-3.11@sha256:" + strings.Repeat("a", 64), "sha256:" + strings.Repeat("0", 64),
		"a:b:c", "@", ":", "x@sha256:zz", "../etc:1", "a:" + strings.Repeat("v", 200), "UPPER:1",
		"acme/py:3", "/py:3", "a/b/py:3", "acme/sha256:" + strings.Repeat("a", 64), "acme/x@sha256:" + strings.Repeat("b", 64), "-x/py:3"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, ref string) {
		p, err := parseRef(ref)
		if err != nil {
			return
		}
		if (p.version == "") == (p.digest == "") {
			t.Fatalf("%q: version %q digest %q: want exactly one", ref, p.version, p.digest)
		}
		if p.name != "" && validateName(p.name) != nil {
			t.Fatalf("%q: accepted name %q", ref, p.name)
		}
		if p.digest != "" && validateDigest(p.digest) != nil {
			t.Fatalf("%q: accepted digest %q", ref, p.digest)
		}
		if strings.ContainsAny(p.name+p.version+p.tenant, "/\x00") {
			t.Fatalf("%q: name, version or tenant with / or NUL", ref)
		}
		if p.qualified != strings.Contains(ref, "/") || p.qualified && p.digest != "" && p.name == "" {
			t.Fatalf("%q: qualified %v (tenant %q) for a ref with %d /", ref, p.qualified, p.tenant, strings.Count(ref, "/"))
		}
		if p.tenant != "" && validateTenant(p.tenant) != nil {
			t.Fatalf("%q: accepted tenant %q", ref, p.tenant)
		}
	})
}

// FuzzExtractTar: any byte stream given as a tar (a layer source, or one
// layer of an OCI image) extracts or fails, never panics, and never writes
// outside the destination, whatever its names, links and types.
func FuzzExtractTar(f *testing.F) {
	for _, entries := range [][]*tar.Header{
		{{Name: "a", Typeflag: tar.TypeReg, Size: 1, Mode: 0o644}},
		{{Name: "../escape", Typeflag: tar.TypeReg, Size: 1, Mode: 0o644}},
		{{Name: "l", Typeflag: tar.TypeSymlink, Linkname: "/"}, {Name: "l/x", Typeflag: tar.TypeReg, Size: 1, Mode: 0o644}},
		{{Name: "h", Typeflag: tar.TypeLink, Linkname: "../../etc/passwd"}},
		{{Name: "d", Typeflag: tar.TypeDir, Mode: 0o755}, {Name: "d/.wh..wh..opq", Typeflag: tar.TypeReg}, {Name: "d/.wh.x", Typeflag: tar.TypeReg}},
		{{Name: "f", Typeflag: tar.TypeFifo}},
	} {
		var b bytes.Buffer
		tw := tar.NewWriter(&b)
		for _, h := range entries {
			tw.WriteHeader(h)
			if h.Size > 0 {
				tw.Write(bytes.Repeat([]byte("x"), int(h.Size)))
			}
		}
		tw.Close()
		f.Add(b.Bytes(), true)
	}
	f.Fuzz(func(t *testing.T, data []byte, whiteouts bool) {
		parent := t.TempDir()
		dst := filepath.Join(parent, "root")
		x, err := newExtractor(dst, whiteouts)
		if err != nil {
			t.Fatal(err)
		}
		defer x.close()
		// Bounded input: a fuzz run must not fill the disk.
		_ = x.apply(context.Background(), io.LimitReader(bytes.NewReader(data), 1<<20))
		ents, err := os.ReadDir(parent)
		if err != nil {
			t.Fatal(err)
		}
		if len(ents) != 1 || ents[0].Name() != "root" {
			t.Fatalf("extraction wrote beside its root: %v", ents)
		}
	})
}

// FuzzCommitStream: any byte stream given as a VM's commit stream extracts
// or fails, never panics, and never writes outside the tree, whatever its
// names, links, types and sizes.
func FuzzCommitStream(f *testing.F) {
	for _, entries := range [][]*tar.Header{
		{{Name: ".", Typeflag: tar.TypeDir, Mode: 0o755}, {Name: "a", Typeflag: tar.TypeReg, Size: 1, Mode: 0o644}},
		{{Name: ".", Typeflag: tar.TypeDir}, {Name: "../escape", Typeflag: tar.TypeReg, Size: 1, Mode: 0o644}},
		{{Name: ".", Typeflag: tar.TypeDir}, {Name: "l", Typeflag: tar.TypeSymlink, Linkname: "/"}, {Name: "l/x", Typeflag: tar.TypeReg, Size: 1, Mode: 0o644}},
		{{Name: ".", Typeflag: tar.TypeDir}, {Name: "h", Typeflag: tar.TypeLink, Linkname: "../../etc/passwd"}},
		{{Name: ".", Typeflag: tar.TypeDir}, {Name: "d", Typeflag: tar.TypeDir, PAXRecords: map[string]string{"SCHILY.xattr.trusted.overlay.opaque": "y"}}, {Name: "d/w", Typeflag: tar.TypeChar}},
		{{Name: ".", Typeflag: tar.TypeDir}, {Name: "f", Typeflag: tar.TypeFifo}},
	} {
		var b bytes.Buffer
		tw := tar.NewWriter(&b)
		for _, h := range entries {
			h.Format = tar.FormatPAX
			tw.WriteHeader(h)
			if h.Size > 0 {
				tw.Write(bytes.Repeat([]byte("x"), int(h.Size)))
			}
		}
		tw.Close()
		f.Add(b.Bytes())
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		parent := t.TempDir()
		tree := filepath.Join(parent, "root")
		if err := os.Mkdir(tree, 0o755); err != nil {
			t.Fatal(err)
		}
		lim := commitLimits{bytes: 1 << 20, entries: 1000, depth: 16}
		_ = extractCommitStream(context.Background(), bytes.NewReader(data), tree, map[string]bool{".shoal": true}, lim, 1000, nil)
		ents, err := os.ReadDir(parent)
		if err != nil {
			t.Fatal(err)
		}
		if len(ents) != 1 || ents[0].Name() != "root" {
			t.Fatalf("extraction wrote beside its tree: %v", ents)
		}
	})
}

// FuzzExtractOCILayer: any byte stream given as one layer of a pulled
// image (fetchLayer's extraction: kept as a layer of its own, or an
// image's bottom layer) extracts or fails, never panics, never writes
// outside its root, and leaves no device node but overlayfs's whiteouts
// (0/0 character devices) and no overlayfs attribute but the opaque marks
// the extraction makes (an image must not steer overlayfs into other
// layers, nor give a sandbox a device).
func FuzzExtractOCILayer(f *testing.F) {
	for _, entries := range [][]*tar.Header{
		{{Name: "d", Typeflag: tar.TypeDir, Mode: 0o755}, {Name: "d/.wh..wh..opq", Typeflag: tar.TypeReg}, {Name: "d/.wh.x", Typeflag: tar.TypeReg}},
		{{Name: ".wh.etc", Typeflag: tar.TypeReg}, {Name: "etc/", Typeflag: tar.TypeDir, Mode: 0o755}},
		{{Name: "a/b/.wh.c", Typeflag: tar.TypeReg}, {Name: "a/.wh..wh..opq", Typeflag: tar.TypeReg}},
		{{Name: "x", Typeflag: tar.TypeReg, Size: 1, Mode: 0o644, PAXRecords: map[string]string{"SCHILY.xattr.trusted.overlay.redirect": "/etc"}}},
		{{Name: "dev/null", Typeflag: tar.TypeChar, Devmajor: 1, Devminor: 3}, {Name: "kmem", Typeflag: tar.TypeBlock, Devmajor: 1, Devminor: 2}},
		{{Name: ".wh.../x", Typeflag: tar.TypeReg}, {Name: "../.wh.y", Typeflag: tar.TypeReg}},
	} {
		var b bytes.Buffer
		tw := tar.NewWriter(&b)
		for _, h := range entries {
			tw.WriteHeader(h)
			if h.Size > 0 {
				tw.Write(bytes.Repeat([]byte("x"), int(h.Size)))
			}
		}
		tw.Close()
		f.Add(b.Bytes(), false)
		f.Add(b.Bytes(), true)
	}
	f.Fuzz(func(t *testing.T, data []byte, bottom bool) {
		parent := t.TempDir()
		dst := filepath.Join(parent, "root")
		x, err := newExtractor(dst, bottom)
		if err != nil {
			t.Fatal(err)
		}
		defer x.close()
		x.overlay = !bottom
		x.maxEntries = 256
		if x.apply(context.Background(), io.LimitReader(bytes.NewReader(data), 1<<20)) == nil {
			x.finishDirs()
		}
		ents, err := os.ReadDir(parent)
		if err != nil {
			t.Fatal(err)
		}
		if len(ents) != 1 || ents[0].Name() != "root" {
			t.Fatalf("extraction wrote beside its root: %v", ents)
		}
		filepath.WalkDir(dst, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return nil
			}
			var st unix.Stat_t
			if unix.Lstat(p, &st) != nil {
				return nil
			}
			if typ := st.Mode & unix.S_IFMT; typ == unix.S_IFBLK || (typ == unix.S_IFCHR && st.Rdev != 0) {
				t.Fatalf("%s: a device node (mode %o, rdev %d) in a pulled layer", p, st.Mode, st.Rdev)
			}
			if bottom && st.Mode&unix.S_IFMT == unix.S_IFCHR {
				t.Fatalf("%s: a whiteout in an image's bottom layer", p)
			}
			names := make([]byte, 4096)
			n, _ := unix.Llistxattr(p, names)
			for _, name := range strings.Split(string(names[:max(n, 0)]), "\x00") {
				if !strings.HasPrefix(name, "trusted.overlay.") && !strings.HasPrefix(name, "user.overlay.") {
					continue
				}
				v := make([]byte, 16)
				vn, _ := unix.Lgetxattr(p, name, v)
				if name != "trusted.overlay.opaque" || string(v[:max(vn, 0)]) != "y" || !d.IsDir() || bottom {
					t.Fatalf("%s: overlayfs attribute %s=%q", p, name, v[:max(vn, 0)])
				}
			}
			return nil
		})
	})
}

// FuzzImageConfig: any config blob parses and is bounded (ImageConfig.check)
// or refused, never a panic; what is accepted stays within the bounds
// every sandbox made from the image carries in its record.
func FuzzImageConfig(f *testing.F) {
	f.Add([]byte(`{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/usr/bin","LANG=C.UTF-8"],"WorkingDir":"/testbed","User":"1000:1000","Entrypoint":["/bin/sh","-c"],"Cmd":["pytest"]},"rootfs":{"type":"layers","diff_ids":[]}}`))
	f.Add([]byte(`{"config":{"Env":null,"Cmd":[""]}}`))
	f.Add([]byte(`{"config":{"Env":["` + strings.Repeat("A", 4096) + `"]}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		cf, err := v1.ParseConfigFile(bytes.NewReader(data))
		if err != nil {
			return
		}
		c := ImageConfig{Env: cf.Config.Env, WorkingDir: cf.Config.WorkingDir, User: cf.Config.User, Entrypoint: cf.Config.Entrypoint, Cmd: cf.Config.Cmd}
		if c.check() != nil {
			return
		}
		total := 0
		for _, s := range slices.Concat(c.Env, c.Entrypoint, c.Cmd) {
			total += len(s)
		}
		if len(c.Env) > maxImageEnv || len(c.Entrypoint)+len(c.Cmd) > maxImageArgs || total > maxImageCfgBytes || len(c.WorkingDir) > 4096 || len(c.User) > 256 {
			t.Fatalf("accepted a config past its bounds: %d env, %d args, %d bytes", len(c.Env), len(c.Entrypoint)+len(c.Cmd), total)
		}
	})
}

// FuzzCheckErofs: the walk of an untrusted image (verify.go) never panics
// or loops on any bytes, and what it accepts counts at most its bounds.
// Its seeds are 4 KiB images at least: run it with a short
// -fuzzminimizetime (scripts/test gives 1s), or each new input is
// minimized for a minute.
func FuzzCheckErofs(f *testing.F) {
	if _, err := exec.LookPath("mkfs.erofs"); err == nil {
		dir := f.TempDir()
		tree := filepath.Join(dir, "tree")
		os.MkdirAll(filepath.Join(tree, "d/e"), 0o755)
		os.WriteFile(filepath.Join(tree, "d/e/f"), []byte("file"), 0o644)
		os.WriteFile(filepath.Join(tree, "g"), bytes.Repeat([]byte("g"), 5000), 0o644)
		os.Symlink("d/e/f", filepath.Join(tree, "l"))
		for _, opts := range [][]string{nil, {"-zlz4hc"}, {"-Enoinline_data"}} {
			img := filepath.Join(dir, "img")
			if out, err := exec.Command("mkfs.erofs", append(append([]string{"--quiet"}, opts...), img, tree)...).CombinedOutput(); err != nil {
				f.Fatalf("mkfs.erofs: %v: %s", err, out)
			}
			b, err := os.ReadFile(img)
			if err != nil {
				f.Fatal(err)
			}
			f.Add(b)
		}
	}
	f.Add(make([]byte, 4096))
	f.Fuzz(func(t *testing.T, img []byte) {
		st, err := checkErofs(context.Background(), bytes.NewReader(img), int64(len(img)), false)
		if err != nil {
			if !errors.Is(err, ErrBadImage) {
				t.Fatalf("an error not marked ErrBadImage: %v", err)
			}
			return
		}
		if st.files < 0 || st.files > verifyMaxEntries || st.bytes < 0 {
			t.Fatalf("accepted with counts %+v", st)
		}
	})
}

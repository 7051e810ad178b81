package control

import (
	"path"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/limits"
)

// fuzzMessages are the request messages the strict JSON codec decodes.
func fuzzMessages() []proto.Message {
	return []proto.Message{
		&pb.CreateSandboxRequest{}, &pb.SetTimeoutRequest{}, &pb.ListDirRequest{}, &pb.WatchDirRequest{},
		&pb.ExecRequest{}, &pb.ConnectCommandRequest{}, &pb.SendStdinRequest{}, &pb.ResizePtyRequest{},
		&pb.CreateShellRequest{}, &pb.RunInShellRequest{}, &pb.RunRequest{}, &pb.ListSandboxesRequest{},
	}
}

// FuzzStrictJSONDecode: any bytes decode to a message or to an error, never
// a panic; what decodes encodes again and decodes to the same message.
func FuzzStrictJSONDecode(f *testing.F) {
	for _, s := range []string{
		`{}`, `{"base":"busybox:1","memoryBytes":"9223372036854775807","timeoutSeconds":"18446744075"}`,
		`{"sandboxId":"x","args":["sh","-c","true"],"env":{"A":"1"},"pty":{"rows":65537,"cols":1}}`,
		`{"metadata":{"a":"b"},"unknown":1}`, `{"stdin":"AAEC"}`, `[`, `{"timeoutMs":1e400}`, `null`,
	} {
		f.Add(uint8(0), []byte(s))
	}
	codec := strictJSONCodec{name: "json"}
	f.Fuzz(func(t *testing.T, which uint8, data []byte) {
		msgs := fuzzMessages()
		m := msgs[int(which)%len(msgs)]
		if err := codec.Unmarshal(data, m); err != nil {
			return
		}
		b, err := codec.Marshal(m)
		if err != nil {
			t.Fatalf("re-encode %T: %v", m, err)
		}
		m2 := m.ProtoReflect().New().Interface()
		if err := codec.Unmarshal(b, m2); err != nil {
			t.Fatalf("decode of own encoding %s: %v", b, err)
		}
		if !proto.Equal(m, m2) {
			t.Fatalf("round trip changed %T: %v vs %v", m, m, m2)
		}
	})
}

// FuzzCheckPath: a path the files API accepts is absolute, has no ".."
// element and no NUL, and is within the length bound; cleaning it cannot
// climb out of "/".
func FuzzCheckPath(f *testing.F) {
	for _, s := range []string{"/", "/a/b", "/a/../b", "a", "", "/a/\x00", "//a//b/", "/..", "/a/..", "/" + strings.Repeat("a", 5000)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, p string) {
		if checkPath(p) != nil {
			return
		}
		if !path.IsAbs(p) || strings.IndexByte(p, 0) >= 0 || len(p) > limits.PathBytes {
			t.Fatalf("accepted %q", p)
		}
		for _, el := range strings.Split(p, "/") {
			if el == ".." {
				t.Fatalf("accepted %q with ..", p)
			}
		}
		if c := path.Clean(p); !strings.HasPrefix(c, "/") {
			t.Fatalf("%q cleans to %q", p, c)
		}
	})
}

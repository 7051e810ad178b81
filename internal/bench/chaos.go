package bench

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"sort"
	"strings"
	"sync"
	"time"

	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	_ "github.com/shoal-sandbox/shoal/api/shoal/v1" // registers the services
)

// ChaosOptions configures Chaos.
type ChaosOptions struct {
	URL, APIKey string
	N           int    // requests
	Concurrency int    // in flight
	Seed        uint64 // 0: from the clock
	// SandboxID, if set, is a running sandbox that some requests name so
	// that they reach its agent; it is never deleted by the run.
	SandboxID string
	Base      string // the CLI creates that sandbox from it
	// Timeout bounds each request (streams that would follow a command
	// or a watch end there; that is not a failure).
	Timeout time.Duration
}

// ChaosResult is what Chaos saw.
type ChaosResult struct {
	Requests     int            `json:"requests"`
	Seed         uint64         `json:"seed"`
	ByStatus     map[string]int `json:"by_status"`
	ServerErrors int            `json:"server_errors"` // 5xx, or grpc/connect internal/unknown
	ClientEnds   int            `json:"client_timeouts_or_resets"`
	Samples      []string       `json:"server_error_samples,omitempty"`
	HealthyAfter bool           `json:"healthy_after"`
	Took         float64        `json:"took_s"`
}

// Chaos sends N random and malformed requests to a running serve: random
// bodies, wrong content types, huge, negative and overflowing numbers,
// path traversal, unknown procedures, truncated stream envelopes, to every
// procedure of the API and its plain routes. A reply of 5xx (or a gRPC or
// Connect error of code internal or unknown) counts as a server error.
// Layer-changing procedures get only undecodable bodies, so the run does
// not remove layers or read server paths.
func Chaos(ctx context.Context, o ChaosOptions) (ChaosResult, error) {
	if o.N <= 0 {
		o.N = 10000
	}
	if o.Concurrency <= 0 {
		o.Concurrency = 8
	}
	if o.Timeout <= 0 {
		o.Timeout = 3 * time.Second
	}
	if o.Seed == 0 {
		o.Seed = uint64(time.Now().UnixNano())
	}
	g := newChaosGen(o)
	res := ChaosResult{Seed: o.Seed, ByStatus: map[string]int{}}
	var mu sync.Mutex
	start := time.Now()
	client := &http.Client{Timeout: o.Timeout}
	reqs := make([]*http.Request, o.N)
	for i := range reqs {
		reqs[i] = g.request(ctx)
	}
	step := progress(ctx, "requests", o.N)
	parallel(o.N, o.Concurrency, func(i int) {
		defer step()
		req := reqs[i]
		status, bad, note := send(client, req)
		mu.Lock()
		defer mu.Unlock()
		res.Requests++
		res.ByStatus[status]++
		if status == "client-end" {
			res.ClientEnds++
		}
		if bad {
			res.ServerErrors++
			if len(res.Samples) < 20 {
				res.Samples = append(res.Samples, fmt.Sprintf("%s %s -> %s %s", req.Method, req.URL.RequestURI(), status, note))
			}
		}
	})
	res.Took = time.Since(start).Seconds()
	if r, err := client.Get(o.URL + "/healthz"); err == nil {
		res.HealthyAfter = r.StatusCode == http.StatusOK
		r.Body.Close()
	}
	return res, nil
}

// send sends one request and classifies the answer.
func send(c *http.Client, req *http.Request) (status string, serverError bool, note string) {
	res, err := c.Do(req)
	if err != nil {
		return "client-end", false, err.Error()
	}
	defer res.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(res.Body, 1<<20))
	status = fmt.Sprint(res.StatusCode)
	if res.StatusCode >= 500 {
		// A 5xx that is the answer the request asked for is not a fault:
		// deadline_exceeded after the client's own Connect-Timeout-Ms,
		// unavailable (502) from a port with nothing listening. Any other
		// (500 internal above all) is.
		var e struct{ Code string }
		json.Unmarshal(body, &e)
		switch {
		case res.StatusCode == http.StatusGatewayTimeout && e.Code == "deadline_exceeded",
			res.StatusCode == http.StatusBadGateway && e.Code == "unavailable" && bytes.Contains(body, []byte("nothing is listening")):
			return status + "/" + e.Code, false, ""
		}
		return status, true, truncate(string(body), 300)
	}
	if g := res.Header.Get("Grpc-Status"); g == "13" || g == "2" {
		return status + "/grpc-" + g, true, res.Header.Get("Grpc-Message")
	}
	// A Connect stream carries its error in the end-of-stream message.
	if strings.HasPrefix(res.Header.Get("Content-Type"), "application/connect+") &&
		(bytes.Contains(body, []byte(`"code":"internal"`)) || bytes.Contains(body, []byte(`"code":"unknown"`))) {
		return status + "/stream-internal", true, truncate(string(body), 300)
	}
	return status, false, ""
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}

type chaosGen struct {
	o       ChaosOptions
	mu      sync.Mutex
	r       *rand.Rand
	methods []protoreflect.MethodDescriptor
}

func newChaosGen(o ChaosOptions) *chaosGen {
	g := &chaosGen{o: o, r: rand.New(rand.NewPCG(o.Seed, o.Seed^0x9e3779b97f4a7c15))}
	protoregistry.GlobalFiles.RangeFiles(func(fd protoreflect.FileDescriptor) bool {
		if fd.Package() != "shoal.v1" {
			return true
		}
		for i := 0; i < fd.Services().Len(); i++ {
			sd := fd.Services().Get(i)
			for j := 0; j < sd.Methods().Len(); j++ {
				g.methods = append(g.methods, sd.Methods().Get(j))
			}
		}
		return true
	})
	sort.Slice(g.methods, func(i, j int) bool { return g.methods[i].FullName() < g.methods[j].FullName() })
	return g
}

// destructive methods get only bodies that cannot decode.
func destructive(m protoreflect.MethodDescriptor) bool {
	n := string(m.Name())
	for _, w := range []string{"Build", "Remove", "Delete", "Gc", "GC", "Tag", "Commit", "Import", "Env"} {
		if strings.Contains(n, w) {
			return true
		}
	}
	return false
}

var (
	chaosStrings = []string{"", "..", "../../../../etc/passwd", "/etc/shadow", "/proc/self/root/etc", "a\x00b",
		"sha256:" + strings.Repeat("f", 64), "busybox:1", "x:1", "~", "/", "//..//..", "%2e%2e%2f", strings.Repeat("A", 5000),
		"SIGKILL", "SIGNOPE", "\u202e", "{}", "null", "1e400"}
	chaosNumbers = []string{"0", "-1", "1", "9223372036854775807", "-9223372036854775808", "18446744075", "18446744073709551615",
		"99999999999999999999999", "1e400", "-0", "0.5", `"abc"`, "4294967296", "65537", "1000000000000"}
)

func (g *chaosGen) intn(n int) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.r.IntN(n)
}

func (g *chaosGen) pick(s []string) string { return s[g.intn(len(s))] }

func (g *chaosGen) randomBytes(max int) []byte {
	n := g.intn(max + 1)
	b := make([]byte, n)
	g.mu.Lock()
	for i := range b {
		b[i] = byte(g.r.IntN(256))
	}
	g.mu.Unlock()
	return b
}

func (g *chaosGen) str() string {
	switch g.intn(4) {
	case 0:
		if g.o.SandboxID != "" {
			return g.o.SandboxID
		}
	case 1:
		return string(g.randomBytes(40))
	}
	return g.pick(chaosStrings)
}

// value is a random JSON value for a field, often of the wrong type.
func (g *chaosGen) value(f protoreflect.FieldDescriptor, depth int) string {
	if g.intn(10) == 0 {
		return g.pick(append(append([]string{}, chaosNumbers...), `"x"`, "[]", "{}", "true", "null"))
	}
	if f.IsMap() {
		var parts []string
		n := g.intn(4)
		if g.intn(20) == 0 {
			n = 2000
		}
		for i := range n {
			k, _ := json.Marshal(fmt.Sprint(g.str(), i))
			v, _ := json.Marshal(g.str())
			parts = append(parts, string(k)+":"+string(v))
		}
		return "{" + strings.Join(parts, ",") + "}"
	}
	if f.IsList() {
		var parts []string
		n := g.intn(4)
		if g.intn(20) == 0 {
			n = 300
		}
		for range n {
			parts = append(parts, g.scalar(f, depth))
		}
		return "[" + strings.Join(parts, ",") + "]"
	}
	return g.scalar(f, depth)
}

func (g *chaosGen) scalar(f protoreflect.FieldDescriptor, depth int) string {
	switch f.Kind() {
	case protoreflect.StringKind:
		b, _ := json.Marshal(g.str())
		return string(b)
	case protoreflect.BytesKind:
		return `"` + g.pick([]string{"", "AAAA", "!!notbase64", strings.Repeat("QUFB", 1000)}) + `"`
	case protoreflect.BoolKind:
		return g.pick([]string{"true", "false", `"yes"`})
	case protoreflect.MessageKind:
		if depth > 2 {
			return "{}"
		}
		return g.message(f.Message(), depth+1)
	case protoreflect.EnumKind:
		return g.pick([]string{"0", "1", "99", "-1", `"NOPE"`})
	default: // numbers, as JSON numbers or strings (int64 travels as a string)
		n := g.pick(chaosNumbers)
		if g.intn(2) == 0 && !strings.HasPrefix(n, `"`) {
			return `"` + n + `"`
		}
		return n
	}
}

func (g *chaosGen) message(md protoreflect.MessageDescriptor, depth int) string {
	var parts []string
	for i := 0; i < md.Fields().Len(); i++ {
		if g.intn(3) == 0 {
			continue
		}
		f := md.Fields().Get(i)
		parts = append(parts, fmt.Sprintf("%q:%s", f.JSONName(), g.value(f, depth)))
	}
	if g.intn(15) == 0 {
		parts = append(parts, `"noSuchField":1`)
	}
	return "{" + strings.Join(parts, ",") + "}"
}

// request makes one random request.
func (g *chaosGen) request(ctx context.Context) *http.Request {
	var method, path, ctype string
	var body []byte
	switch k := g.intn(100); {
	case k < 60: // a known procedure
		m := g.methods[g.intn(len(g.methods))]
		method, path = http.MethodPost, "/"+string(m.Parent().FullName())+"/"+string(m.Name())
		ctype = "application/json"
		stream := m.IsStreamingServer()
		if stream {
			ctype = "application/connect+json"
		}
		if destructive(m) || g.intn(5) == 0 {
			body = g.randomBytes(200)
		} else {
			body = []byte(g.message(m.Input(), 0))
			if g.intn(10) == 0 {
				body = body[:g.intn(len(body)+1)] // truncated
			}
		}
		switch g.intn(8) {
		case 0:
			ctype = g.pick([]string{"text/plain", "", "application/grpc", "application/grpc+json", "application/proto",
				"application/connect+proto", "multipart/form-data; boundary=x", "application/json; charset=latin1"})
		case 1:
			method = g.pick([]string{http.MethodGet, http.MethodPut, http.MethodDelete, "PATCH"})
		}
		if stream && ctype == "application/connect+json" {
			// A Connect stream envelope: flags, length, message; its
			// length sometimes lies (a truncated stream).
			var env [5]byte
			n := uint32(len(body))
			if g.intn(4) == 0 {
				n = uint32(g.intn(1 << 30))
			}
			binary.BigEndian.PutUint32(env[1:], n)
			body = append(env[:], body...)
		}
	case k < 68: // an unknown procedure or service
		method = http.MethodPost
		path = g.pick([]string{"/shoal.v1.SandboxService/Nope", "/shoal.v1.NoService/Create", "/shoal.v1./", "/shoal.v1.SandboxService/",
			"/shoal.v1.SandboxService/CreateSandbox/extra", "/grpc.health.v1.Health/Check"})
		ctype = "application/json"
		body = g.randomBytes(100)
	case k < 82: // files
		id := g.str()
		q := "path=" + urlQ(g.str())
		if g.intn(3) == 0 {
			q += "&mode=" + urlQ(g.pick([]string{"0644", "7777", "99999", "-1", "abc", "0o644"}))
		}
		path = "/v1/sandboxes/" + urlP(id) + "/files?" + q
		method = g.pick([]string{http.MethodGet, http.MethodPut, http.MethodPost})
		ctype = "application/octet-stream"
		body = g.randomBytes(2000)
	case k < 92: // ports
		port := g.pick([]string{"80", "0", "-1", "65536", "99999999999", "abc", "8080"})
		path = "/v1/sandboxes/" + urlP(g.str()) + "/ports/" + port + "/" + urlP(g.str())
		if g.intn(3) == 0 {
			path = "/v1/sandboxes/" + urlP(g.str()) + "/ports/" + port + "/tcp"
		}
		method = g.pick([]string{http.MethodGet, http.MethodPost, http.MethodConnect})
		body = g.randomBytes(100)
	default: // layer export and odd paths
		path = g.pick([]string{"/v1/layers/export?ref=" + urlQ(g.str()), "/v1/layers/export", "/", "/v1/", "/healthz?x=" + urlQ(g.str()),
			"/v1/sandboxes//files", "/../../etc/passwd"})
		method = g.pick([]string{http.MethodGet, http.MethodPost, http.MethodHead})
	}
	req, err := http.NewRequestWithContext(ctx, method, g.o.URL+path, bytes.NewReader(body))
	if err != nil {
		req, _ = http.NewRequestWithContext(ctx, http.MethodGet, g.o.URL+"/healthz", nil)
	}
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	if g.intn(30) != 0 {
		req.Header.Set("Authorization", "Bearer "+g.o.APIKey)
	}
	if g.intn(4) == 0 {
		req.Header.Set("Connect-Protocol-Version", "1")
	}
	if g.intn(10) == 0 {
		req.Header.Set("Connect-Timeout-Ms", g.pick(chaosNumbers))
	}
	return req
}

func urlQ(s string) string {
	var b strings.Builder
	for _, c := range []byte(s) {
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '.' || c == '_' || c == '/' || c == '~' {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(&b, "%%%02X", c)
		}
	}
	return b.String()
}

func urlP(s string) string {
	return strings.ReplaceAll(urlQ(s), "/", "%2F")
}

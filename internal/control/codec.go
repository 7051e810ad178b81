package control

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/limits"
)

// handlerOptions are the options of every connect handler the API serves:
// baseHandlerOptions, and every call counted (metrics.go), authorized and
// audited (authz.go).
func (s *Server) handlerOptions() []connect.HandlerOption {
	return append(baseHandlerOptions(),
		connect.WithInterceptors(metricsInterceptor{s.metrics}, authzInterceptor{s})) // authz.go
}

// baseHandlerOptions are the options of every connect handler of a node's
// API and of the control plane's: JSON requests are decoded strictly (see
// strictJSONCodec), no message may be larger than limits.MessageBytes
// (connect refuses a larger one with resource_exhausted before reading it
// whole), and an answer is compressed, for a client that accepts it, only
// from limits.CompressMinBytes on.
func baseHandlerOptions() []connect.HandlerOption {
	return []connect.HandlerOption{
		connect.WithReadMaxBytes(limits.MessageBytes),
		connect.WithCodec(strictJSONCodec{name: "json"}),
		connect.WithCodec(strictJSONCodec{name: "json; charset=utf-8"}),
		connect.WithCompressMinBytes(limits.CompressMinBytes),
	}
}

// strictJSONCodec is connect-go's protojson codec without DiscardUnknown: a
// JSON request naming a field this server does not know is refused with
// invalid_argument naming the field, instead of the field being dropped
// silently (a client could not tell that e.g. clientKey was ignored by an
// older server). Connect registers its JSON codec under two names, "json"
// and "json; charset=utf-8"; both are replaced. Binary protobuf keeps its
// usual rule (unknown fields are skipped), as the wire format intends.
type strictJSONCodec struct{ name string }

var _ connect.Codec = strictJSONCodec{}

func (c strictJSONCodec) Name() string { return c.name }

func (c strictJSONCodec) IsBinary() bool { return false }

func (c strictJSONCodec) Marshal(message any) ([]byte, error) {
	m, ok := message.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("%T is not a protobuf message", message)
	}
	return protojson.MarshalOptions{}.Marshal(m)
}

func (c strictJSONCodec) MarshalAppend(dst []byte, message any) ([]byte, error) {
	m, ok := message.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("%T is not a protobuf message", message)
	}
	return protojson.MarshalOptions{}.MarshalAppend(dst, m)
}

// MarshalStable is what connect uses for the query string of GET requests.
func (c strictJSONCodec) MarshalStable(message any) ([]byte, error) {
	b, err := c.Marshal(message)
	if err != nil {
		return nil, err
	}
	var out bytes.Buffer
	if err := json.Compact(&out, b); err != nil {
		return nil, err
	}
	return out.Bytes(), nil
}

func (c strictJSONCodec) Unmarshal(data []byte, message any) error {
	m, ok := message.(proto.Message)
	if !ok {
		return fmt.Errorf("%T is not a protobuf message", message)
	}
	if len(data) == 0 {
		return errors.New("zero-length payload is not a valid JSON object")
	}
	if err := (protojson.UnmarshalOptions{}).Unmarshal(data, m); err != nil {
		// Connect answers invalid_argument with "unmarshal message: " and
		// this; protojson's own text names the field: `unknown field "x"`.
		name := m.ProtoReflect().Descriptor().FullName()
		if strings.Contains(err.Error(), "unknown field") {
			return fmt.Errorf("%s: %w (this server does not know that field: is the client newer than the server?)", name, err)
		}
		return fmt.Errorf("%s: %w", name, err)
	}
	return nil
}

// unknownProcedures answers a call to a procedure this server does not
// serve, /shoal.v1.<Service>/<Method> with an unknown service or method,
// with Connect's JSON error {"code":"unimplemented"} and HTTP 404 (gRPC
// clients get grpc-status 12 in a trailers-only reply) instead of the
// plain-text "404 page not found" of ServeMux and of the generated service
// handlers. Everything else goes to next.
//
// A call whose declared Content-Length is over limits.MessageBytes is
// refused here, before a byte of its body is read (connect's own bound,
// WithReadMaxBytes, still holds for bodies of unknown length).
func unknownProcedures(mux *http.ServeMux) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/shoal.v1.") {
			if !knownProcedure(mux, r) {
				msg := fmt.Sprintf("this Shoal server does not implement %s (unknown procedure: is the client newer than the server?)", r.URL.Path)
				writeProtocolError(w, r, connect.CodeUnimplemented, msg)
				return
			}
			if r.ContentLength > limits.MessageBytes {
				msg := fmt.Sprintf("request body of %d bytes is larger than the maximum of %s", r.ContentLength, limits.Size(limits.MessageBytes))
				writeProtocolError(w, r, connect.CodeResourceExhausted, msg)
				return
			}
		}
		mux.ServeHTTP(w, r)
	})
}

// knownProcedure reports whether r names a method declared in api/shoal/v1
// whose service has a handler on mux.
func knownProcedure(mux *http.ServeMux, r *http.Request) bool {
	service, method, ok := strings.Cut(strings.TrimPrefix(r.URL.Path, "/"), "/")
	if !ok || method == "" || strings.Contains(method, "/") {
		return false
	}
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(service))
	if err != nil {
		return false
	}
	sd, ok := d.(protoreflect.ServiceDescriptor)
	if !ok || sd.Methods().ByName(protoreflect.Name(method)) == nil {
		return false
	}
	_, pattern := mux.Handler(r)
	return pattern != ""
}

// writeProtocolError answers a call with an error before connect sees it:
// gRPC clients get grpc-status in a trailers-only reply, others Connect's
// JSON error with the code's HTTP status.
func writeProtocolError(w http.ResponseWriter, r *http.Request, code connect.Code, msg string) {
	if strings.HasPrefix(r.Header.Get("Content-Type"), "application/grpc") {
		w.Header().Set("Content-Type", r.Header.Get("Content-Type"))
		w.Header().Set("Grpc-Status", strconv.Itoa(int(code)))
		w.Header().Set("Grpc-Message", url.PathEscape(msg))
		w.WriteHeader(http.StatusOK)
		return
	}
	status := errdefs.StatusOf(errdefs.FaceShoal, code.String())
	if code == connect.CodeUnimplemented {
		status = http.StatusNotFound // an unknown procedure, as connect answers one
	}
	if code == connect.CodeResourceExhausted {
		// The body is not read: close the connection after the reply
		// rather than drain it.
		w.Header().Set("Connection", "close")
	}
	writeHTTPError(w, status, code.String(), msg)
}

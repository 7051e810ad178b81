package main

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// The CLI's JSON is for people and shell scripts (jq), as docker inspect's
// is, not protojson: field names as in the .proto files, every field
// present, 64-bit integers as numbers ("memory_bytes": 536870912, not
// "536870912"), enums as their short lower-case names ("running", not
// "SANDBOX_STATE_RUNNING"; "base", not "LAYER_KIND_BASE"), timestamps in
// RFC 3339 and durations as Go writes them.

// printJSON prints one message.
func printJSON(m proto.Message) {
	b, _ := json.MarshalIndent(jsonView(m.ProtoReflect()), "", "  ")
	fmt.Println(string(b))
}

// printJSONList prints messages as one JSON array.
func printJSONList[T proto.Message](items []T) {
	out := make([]any, 0, len(items))
	for _, it := range items {
		out = append(out, jsonView(it.ProtoReflect()))
	}
	b, _ := json.MarshalIndent(out, "", "  ")
	fmt.Println(string(b))
}

// jsonView is m as plain JSON values, fields in declaration order.
func jsonView(m protoreflect.Message) any {
	switch v := m.Interface().(type) {
	case *timestamppb.Timestamp:
		if v == nil || (v.Seconds == 0 && v.Nanos == 0) {
			return nil
		}
		return v.AsTime().UTC().Format(time.RFC3339Nano)
	case *durationpb.Duration:
		return v.AsDuration().String()
	}
	fields := m.Descriptor().Fields()
	out := make(orderedObject, 0, fields.Len())
	for i := 0; i < fields.Len(); i++ {
		fd := fields.Get(i)
		if fd.ContainingOneof() != nil && !fd.ContainingOneof().IsSynthetic() && !m.Has(fd) {
			continue // an unset member of a oneof
		}
		out = append(out, field{string(fd.Name()), fieldView(fd, m.Get(fd), m.Has(fd))})
	}
	return out
}

func fieldView(fd protoreflect.FieldDescriptor, v protoreflect.Value, has bool) any {
	switch {
	case fd.IsList():
		l := v.List()
		out := make([]any, 0, l.Len())
		for i := 0; i < l.Len(); i++ {
			out = append(out, scalarView(fd, l.Get(i)))
		}
		return out
	case fd.IsMap():
		out := map[string]any{}
		v.Map().Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
			out[k.String()] = scalarView(fd.MapValue(), mv)
			return true
		})
		return out
	case fd.Message() != nil && !has:
		return nil
	}
	return scalarView(fd, v)
}

func scalarView(fd protoreflect.FieldDescriptor, v protoreflect.Value) any {
	switch fd.Kind() {
	case protoreflect.MessageKind, protoreflect.GroupKind:
		return jsonView(v.Message())
	case protoreflect.EnumKind:
		return enumName(fd.Enum(), v.Enum())
	case protoreflect.BytesKind:
		return base64.StdEncoding.EncodeToString(v.Bytes())
	}
	return v.Interface() // bool, string, ints (as numbers), floats
}

// enumName is an enum value's name without its type's prefix, in lower
// case: SandboxState SANDBOX_STATE_RUNNING is "running". The zero value
// (XXX_UNSPECIFIED) is "".
func enumName(ed protoreflect.EnumDescriptor, n protoreflect.EnumNumber) any {
	vd := ed.Values().ByNumber(n)
	if vd == nil {
		return int32(n)
	}
	if n == 0 && strings.HasSuffix(string(vd.Name()), "_UNSPECIFIED") {
		return ""
	}
	return strings.ToLower(strings.TrimPrefix(string(vd.Name()), screamingSnake(string(ed.Name()))+"_"))
}

// screamingSnake turns SandboxState into SANDBOX_STATE.
func screamingSnake(s string) string {
	var b strings.Builder
	for i, r := range s {
		if i > 0 && r >= 'A' && r <= 'Z' {
			b.WriteByte('_')
		}
		b.WriteRune(r)
	}
	return strings.ToUpper(b.String())
}

// orderedObject is a JSON object that keeps its fields' order.
type orderedObject []field

type field struct {
	name  string
	value any
}

func (o orderedObject) MarshalJSON() ([]byte, error) {
	var b strings.Builder
	b.WriteByte('{')
	for i, f := range o {
		if i > 0 {
			b.WriteByte(',')
		}
		k, _ := json.Marshal(f.name)
		v, err := json.Marshal(f.value)
		if err != nil {
			return nil, err
		}
		b.Write(k)
		b.WriteByte(':')
		b.Write(v)
	}
	b.WriteByte('}')
	return []byte(b.String()), nil
}

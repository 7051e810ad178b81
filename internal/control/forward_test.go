package control

import (
	"net/http/httptest"
	"testing"

	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"github.com/shoal-sandbox/shoal/api/shoal/v1/shoalv1connect"
)

// TestForwarderServesEveryProcedure: a procedure added to api/shoal/v1
// must be classified for the control role too (forwarded, or refused as
// not yet served), or clients of a cluster would get "unknown procedure".
func TestForwarderServesEveryProcedure(t *testing.T) {
	mux := (&Forwarder{}).routes()
	n := 0
	for _, svc := range []string{shoalv1connect.SandboxServiceName, shoalv1connect.CommandServiceName, shoalv1connect.LayerServiceName,
		shoalv1connect.FnCallServiceName, shoalv1connect.AdminServiceName} {
		d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(svc))
		if err != nil {
			t.Fatal(err)
		}
		methods := d.(protoreflect.ServiceDescriptor).Methods()
		for i := 0; i < methods.Len(); i++ {
			r := httptest.NewRequest("POST", "/"+svc+"/"+string(methods.Get(i).Name()), nil)
			if !knownProcedure(mux, r) {
				t.Errorf("control role does not serve %s", r.URL.Path)
			}
			n++
		}
	}
	if n < 50 {
		t.Fatalf("only %d procedures found", n)
	}
}

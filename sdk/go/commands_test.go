package shoal

import (
	"bytes"
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/api/shoal/v1/shoalv1connect"
)

// execServer answers every Exec with a started event, one line of output
// and an exit, as serve does.
type execServer struct {
	shoalv1connect.UnimplementedCommandServiceHandler
}

func (execServer) Exec(_ context.Context, req *connect.Request[pb.ExecRequest], s *connect.ServerStream[pb.CommandEvent]) error {
	for _, ev := range []*pb.CommandEvent{
		{Offset: 1, Event: &pb.CommandEvent_Started_{Started: &pb.CommandEvent_Started{CommandId: "c1", Pid: 7}}},
		{Offset: 2, Event: &pb.CommandEvent_Stdout{Stdout: []byte(req.Msg.Args[0] + "\n")}},
		{Offset: 3, Event: &pb.CommandEvent_Exit_{Exit: &pb.CommandEvent_Exit{Code: 3}}},
	} {
		if err := s.Send(ev); err != nil {
			return err
		}
	}
	return nil
}

// TestExecReusesConnection: commands run one after the other share one
// connection. Exec used to close the stream at its exit event, before the
// end of the response: net/http then closed the connection, and every
// command paid for a new one (154 connections for 100 commands).
func TestExecReusesConnection(t *testing.T) {
	_, h := shoalv1connect.NewCommandServiceHandler(execServer{})
	srv := httptest.NewUnstartedServer(h)
	var conns atomic.Int32
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	defer srv.Close()
	c, err := New(Options{URL: srv.URL, APIKey: "k"})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 20; i++ {
		var out bytes.Buffer
		st, err := c.Exec(context.Background(), "sb", ExecOptions{Args: []string{"hello"}, Stdout: &out})
		if err != nil {
			t.Fatal(err)
		}
		if st.Code != 3 || st.CommandID != "c1" || st.Offset != 3 || out.String() != "hello\n" {
			t.Fatalf("exec %d: %+v, output %q", i, st, out.String())
		}
	}
	if n := conns.Load(); n != 1 {
		t.Errorf("20 commands took %d connections, want 1", n)
	}
}

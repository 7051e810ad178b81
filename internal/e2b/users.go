package e2b

// Users, as envd has them. A request may name the sandbox user it acts as:
// the SDK sends "Authorization: Basic base64(user:)" with process and
// filesystem calls and a "username" query parameter with /files. Without
// one, envd acts as the template's default user, which is "user" in E2B's
// templates: Shoal's default is Config.DefaultUser (per template:
// Config.TemplateUsers), falling back to root (with a warning in the log)
// in a sandbox whose /etc/passwd has no such user. Users are resolved by
// the guest agent in the sandbox's own /etc/passwd; their homes are cached
// per sandbox.

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/limits"
)

type userKey struct{}

// maxCachedUsers bounds the users whose homes are cached per sandbox.
const maxCachedUsers = 64

// requestUser reads the user a request of the envd face names: /files'
// username query parameter, else the Authorization header's Basic user.
func requestUser(r *http.Request) (string, error) {
	if r.URL.Path == "/files" {
		if u := r.URL.Query().Get("username"); u != "" {
			return u, limits.User("username", u)
		}
	}
	h := r.Header.Get("Authorization")
	if h == "" {
		return "", nil
	}
	scheme, cred, _ := strings.Cut(h, " ")
	if !strings.EqualFold(scheme, "Basic") {
		return "", fmt.Errorf("Authorization: only Basic (the sandbox user) is taken here")
	}
	b, err := base64.StdEncoding.DecodeString(strings.TrimSpace(cred))
	if err != nil {
		return "", fmt.Errorf("Authorization: Basic: %v", err)
	}
	u, _, _ := strings.Cut(string(b), ":")
	return u, limits.User("user", u)
}

// withUser carries a request's named user ("" = the sandbox's default).
func withUser(ctx context.Context, user string) context.Context {
	return context.WithValue(ctx, userKey{}, user)
}

func userOf(ctx context.Context) string {
	u, _ := ctx.Value(userKey{}).(string)
	return u
}

// actAs returns the agent of sandbox id for the request's user, that
// user's name ("" = root, the agent's own identity) and home. ag is the
// sandbox's agent (as root). As envd, which runs as root, the agent
// returned acts as root and gives what it creates (files, directories) to
// the user (agent.Client.Owning); commands run as the user.
func (s *Server) actAs(ctx context.Context, id string, ag *agent.Client) (*agent.Client, string, string, error) {
	in := s.info(id)
	name := userOf(ctx)
	if name == "" {
		name = s.defaultUser(ctx, id, ag, in)
		if name == "" {
			_, home := s.sandboxFacts(id, ag)
			return ag.WithXattrs(), "", home, nil
		}
	}
	u, err := s.lookupUser(ctx, ag, in, name)
	if err != nil {
		if codeOf(err) == connect.CodeNotFound {
			return nil, "", "", connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("user %q: no such user in sandbox %s (its /etc/passwd)", name, id))
		}
		return nil, "", "", toConnect(err)
	}
	// As envd: root's reach, and what is created belongs to the user.
	return ag.Owning(name).WithXattrs(), name, u.Home, nil // entries carry their metadata
}

// info returns the sandbox's facts record.
func (s *Server) info(id string) *sbInfo {
	s.mu.Lock()
	defer s.mu.Unlock()
	in := s.sandboxes[id]
	if in == nil {
		in = &sbInfo{}
		s.sandboxes[id] = in
	}
	return in
}

// lookupUser resolves name through the agent, cached per sandbox.
func (s *Server) lookupUser(ctx context.Context, ag *agent.Client, in *sbInfo, name string) (agent.UserInfo, error) {
	in.mu.Lock()
	u, ok := in.users[name]
	in.mu.Unlock()
	if ok {
		return u, nil
	}
	lctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	u, err := ag.LookupUser(lctx, name)
	if err != nil {
		return u, err
	}
	in.mu.Lock()
	if in.users == nil || len(in.users) >= maxCachedUsers {
		in.users = map[string]agent.UserInfo{}
	}
	in.users[name] = u
	in.mu.Unlock()
	return u, nil
}

// defaultUser is the user a request that names none acts as: the
// template's (Config.TemplateUsers), else Config.DefaultUser, when the
// sandbox has that user; else "" (root), said once in the log.
func (s *Server) defaultUser(ctx context.Context, id string, ag *agent.Client, in *sbInfo) string {
	in.mu.Lock()
	if in.defKnown {
		defer in.mu.Unlock()
		return in.defUser
	}
	in.mu.Unlock()
	want := s.cfg.DefaultUser
	if m, ok := s.store.sandbox(id); ok && m.Template != "" {
		if u, ok := s.cfg.TemplateUsers[m.Template]; ok {
			want = u
		}
	}
	if want == "" || want == "root" {
		in.mu.Lock()
		in.defUser, in.defKnown = want, true
		in.mu.Unlock()
		return want
	}
	_, err := s.lookupUser(ctx, ag, in, want)
	var ae *agent.Error
	switch {
	case err == nil:
	case errors.As(err, &ae) && (ae.Code == agent.CodeNotExist || ae.Code == agent.CodeUnsupported):
		s.log.Warn("e2b: the sandbox has no such user: its commands and files act as root", "sandbox_id", id, "user", want, "err", err)
		want = ""
	default:
		// Unknown (the agent did not answer): root for this request, ask again next time.
		s.log.Warn("e2b: could not look the default user up", "sandbox_id", id, "user", want, "err", err)
		return ""
	}
	in.mu.Lock()
	in.defUser, in.defKnown = want, true
	in.mu.Unlock()
	return want
}

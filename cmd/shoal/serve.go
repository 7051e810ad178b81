package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	_ "net/http/pprof" // on --pprof only: DefaultServeMux is not the API's mux
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"go.etcd.io/bbolt"

	"github.com/shoal-sandbox/shoal/internal/backend/container"
	"github.com/shoal-sandbox/shoal/internal/control"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/node"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
	"github.com/shoal-sandbox/shoal/internal/session"
)

// serveConfig is the configuration of the all-in-one server.
type serveConfig struct {
	DataDir string
	Listen  string
	Agent   string
	Runtime string
	Debug   bool
	LogCap  int64
	Pprof   string
}

// Validate fills defaults and checks the configuration.
func (c *serveConfig) Validate() error {
	if c.DataDir == "" {
		return errors.New("--data is required")
	}
	abs, err := filepath.Abs(c.DataDir)
	if err != nil {
		return err
	}
	c.DataDir = abs
	if _, _, err := net.SplitHostPort(c.Listen); err != nil {
		return fmt.Errorf("--listen %q must be HOST:PORT: %w", c.Listen, err)
	}
	if c.Agent == "" {
		c.Agent = findAgent()
	}
	if c.Agent == "" {
		return errors.New("shoal-agent not found next to the shoal binary nor in /usr/local/lib/shoal: build it (see README) or pass --agent")
	}
	return nil
}

// findAgent looks for shoal-agent beside this executable, then in the
// install location.
func findAgent() string {
	var cands []string
	if exe, err := os.Executable(); err == nil {
		cands = append(cands, filepath.Join(filepath.Dir(exe), "shoal-agent"))
	}
	cands = append(cands, "/usr/local/lib/shoal/shoal-agent", "/usr/local/bin/shoal-agent")
	for _, c := range cands {
		if fi, err := os.Stat(c); err == nil && fi.Mode().IsRegular() {
			return c
		}
	}
	return ""
}

func serveCmd() *cobra.Command {
	var cfg serveConfig
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the API, a node agent and the local layer store (all in one)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := cfg.Validate(); err != nil {
				return err
			}
			return serve(cfg)
		},
	}
	cmd.Flags().StringVar(&cfg.DataDir, "data", "/var/lib/shoal", "data directory")
	cmd.Flags().StringVar(&cfg.Listen, "listen", "127.0.0.1:7480", "API listen address")
	cmd.Flags().StringVar(&cfg.Agent, "agent", "", "path of the shoal-agent binary (default: beside shoal)")
	cmd.Flags().StringVar(&cfg.Runtime, "runtime", "runc", "OCI runtime for the container backend")
	cmd.Flags().BoolVar(&cfg.Debug, "debug", false, "debug logging")
	cmd.Flags().StringVar(&cfg.Pprof, "pprof", "", "serve Go profiles (net/http/pprof) on this HOST:PORT, unauthenticated: keep it on localhost")
	cmd.Flags().Int64Var(&cfg.LogCap, "command-log-cap", session.DefaultLogCap, "bytes of output kept per command (the rest is dropped and reported)")
	return cmd
}

func serve(cfg serveConfig) error {
	level := slog.LevelInfo
	if cfg.Debug {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
		return err
	}
	auth, err := control.LoadOrCreateAdminKey(cfg.DataDir)
	if err != nil {
		return err
	}
	db, err := bbolt.Open(filepath.Join(cfg.DataDir, "shoal.db"), 0o600, &bbolt.Options{Timeout: 2 * time.Second})
	if err != nil {
		return fmt.Errorf("open store %s (is another shoal serve using this data dir?): %w", filepath.Join(cfg.DataDir, "shoal.db"), err)
	}
	defer db.Close()
	layers, err := layer.Open(filepath.Join(cfg.DataDir, "layers"), db, log)
	if err != nil {
		return err
	}
	ctr, err := container.New(container.Config{
		Runtime:  cfg.Runtime,
		StateDir: filepath.Join(cfg.DataDir, "runc"),
		Log:      log,
	})
	if err != nil {
		return err
	}
	mgr, err := node.New(node.Config{DataDir: cfg.DataDir, AgentBinary: cfg.Agent}, db, layers, []sandbox.Backend{ctr}, log)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	sessions, err := session.New(session.Config{LogCap: cfg.LogCap}, db, mgr, log)
	if err != nil {
		return err
	}
	defer sessions.Close()
	mgr.OnDelete(sessions.DropSandbox)
	if err := mgr.Recover(ctx); err != nil {
		return fmt.Errorf("recover sandboxes: %w", err)
	}
	if err := sessions.Recover(ctx); err != nil {
		return fmt.Errorf("recover commands: %w", err)
	}
	go mgr.Run(ctx)

	if cfg.Pprof != "" {
		go func() { log.Warn("pprof", "err", http.ListenAndServe(cfg.Pprof, nil)) }()
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return err
	}
	var protocols http.Protocols
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true) // gRPC clients
	srv := &http.Server{
		Handler:           control.New(mgr, sessions, auth, log).Handler(),
		Protocols:         &protocols,
		ReadHeaderTimeout: 10 * time.Second,
	}
	log.Info("shoal serving", "listen", ln.Addr().String(), "data", cfg.DataDir,
		"admin_key", filepath.Join(cfg.DataDir, control.AdminKeyFile))
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	// Sandboxes keep running: only the API stops.
	shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return srv.Shutdown(shutdown)
}

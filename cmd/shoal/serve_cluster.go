//go:build !client

package main

// The cluster roles of `shoal serve`: --role node (today's node, which
// also registers itself in etcd and reports its capacity) and --role
// control (the API in front of the nodes: placement and routing,
// internal/control's Forwarder). The default, --role all, is the
// all-in-one server, unchanged.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/shoal-sandbox/shoal/internal/audit"
	"github.com/shoal-sandbox/shoal/internal/cluster"
	"github.com/shoal-sandbox/shoal/internal/control"
	"github.com/shoal-sandbox/shoal/internal/e2b"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/metrics"
	"github.com/shoal-sandbox/shoal/internal/node"
	"github.com/shoal-sandbox/shoal/internal/placement"
	"github.com/shoal-sandbox/shoal/internal/tenant"
)

const (
	roleAll     = "all"
	roleNode    = "node"
	roleControl = "control"
)

// clusterConfig configures the cluster roles.
type clusterConfig struct {
	Role      string
	Etcd      string // comma-separated endpoints
	NodeName  string
	Advertise string // the node's API URL as control replicas reach it
	// E2BAdvertise is the node's E2B endpoint as control replicas reach
	// it (default http://<its --e2b-listen address>).
	E2BAdvertise string
	NodeTTL      time.Duration // the node's lease
	// Placement: nodes tried per create, and how long a create may wait
	// for capacity.
	PlaceAttempts int
	PlaceWait     time.Duration
	// ClientKeyTTL: how long a control replica remembers a create's
	// client key in etcd.
	ClientKeyTTL time.Duration
	TLS          clusterTLS // serve_tls.go
	scheme       string     // of this server's API: http or https
	e2bClosed    bool       // the node's E2B endpoint is for control replicas only (serveConfig.nodeE2BClosed)
}

func addClusterFlags(cmd *cobra.Command, c *clusterConfig) {
	cmd.Flags().StringVar(&c.Role, "role", roleAll, "all (one server: API and node), node (a node of a cluster, registered in etcd) or control (the API in front of a cluster's nodes: placement and routing)")
	cmd.Flags().StringVar(&c.Etcd, "etcd", "", "etcd endpoints, comma-separated (e.g. http://127.0.0.1:2379); required by --role node and control")
	cmd.Flags().StringVar(&c.NodeName, "node-name", "", "--role node: this node's name in the cluster (a-z, 0-9, -; default the host name); its sandbox IDs start with a tag derived from it")
	cmd.Flags().StringVar(&c.Advertise, "advertise", "", "--role node: the URL control replicas reach this node's API at (default http://<--listen>, https:// with --tls-cert); --role control: the URL the other control replicas reach this one at (default http(s)://<--listen>; none when --listen is on every address: then it does not register, and the others' audit and creates-per-second leave it out)")
	cmd.Flags().StringVar(&c.E2BAdvertise, "e2b-advertise", "", "--role node: the URL control replicas reach this node's E2B endpoint at (default http://<--e2b-listen>); control replicas serve E2B for the cluster through it")
	cmd.Flags().DurationVar(&c.NodeTTL, "node-ttl", 10*time.Second, "--role node: the node's lease in etcd; a node silent this long is down and its sandboxes reported lost")
	cmd.Flags().IntVar(&c.PlaceAttempts, "place-attempts", 3, "--role control: nodes tried per create before it waits for capacity (a node's refusal moves it to the next)")
	cmd.Flags().DurationVar(&c.ClientKeyTTL, "client-key-ttl", time.Hour, "--role control: how long a create's client key is remembered in etcd after its last use: a retry with it through any control replica gets the same sandbox")
	cmd.Flags().DurationVar(&c.PlaceWait, "place-wait", 60*time.Second, "--role control: how long a create may queue for capacity when no node can hold it")
}

// validate checks the cluster flags (after --data and --listen are).
func (c *clusterConfig) validate(listen string) error {
	switch c.Role {
	case roleAll:
		if c.Etcd != "" || c.TLS.EtcdCA != "" || c.TLS.EtcdCert != "" {
			return errors.New("--etcd and --etcd-ca/--etcd-cert are for --role node or control (the default role, all, keeps its state on this machine)")
		}
		if c.TLS.CA != "" || c.TLS.Cert != "" {
			return errors.New("--cluster-ca/--cluster-cert are for --role control (the calls of a control replica to nodes)")
		}
		return nil
	case roleNode, roleControl:
	default:
		return fmt.Errorf("--role %q: want all, node or control", c.Role)
	}
	if c.Etcd == "" {
		return fmt.Errorf("--role %s needs --etcd", c.Role)
	}
	if c.Role == roleNode && (c.TLS.CA != "" || c.TLS.Cert != "") {
		return errors.New("--cluster-ca/--cluster-cert are for --role control (a node calls no other member; it requires control replicas' certificates with --tls-client-ca)")
	}
	if err := c.TLS.validate(); err != nil {
		return err
	}
	if c.PlaceAttempts < 1 || c.PlaceAttempts > 100 {
		return fmt.Errorf("--place-attempts %d: want 1 to 100", c.PlaceAttempts)
	}
	if c.PlaceWait < 0 || c.PlaceWait > time.Hour {
		return fmt.Errorf("--place-wait %s: want 0 to 1h", c.PlaceWait)
	}
	if c.ClientKeyTTL < time.Minute || c.ClientKeyTTL > 7*24*time.Hour {
		return fmt.Errorf("--client-key-ttl %s: want 1m to 168h", c.ClientKeyTTL)
	}
	if c.Role == roleControl {
		// Its peers reach it here (audit); none: it does not register.
		if c.Advertise == "" {
			host, _, _ := net.SplitHostPort(listen)
			if ip := net.ParseIP(host); host != "" && (ip == nil || !ip.IsUnspecified()) {
				c.Advertise = c.scheme + "://" + listen
			}
		}
		return nil
	}
	if c.NodeName == "" {
		h, err := os.Hostname()
		if err != nil {
			return fmt.Errorf("--node-name: %w", err)
		}
		c.NodeName = strings.ToLower(h)
	}
	if err := cluster.ValidNodeName(c.NodeName); err != nil {
		return fmt.Errorf("--node-name: %w", err)
	}
	if c.NodeTTL < 2*time.Second || c.NodeTTL > 10*time.Minute {
		return fmt.Errorf("--node-ttl %s: want 2s to 10m", c.NodeTTL)
	}
	if c.Advertise == "" {
		host, _, _ := net.SplitHostPort(listen)
		if ip := net.ParseIP(host); host == "" || ip != nil && ip.IsUnspecified() {
			return fmt.Errorf("--listen %s listens on every address: give --advertise, the URL control replicas reach this node at", listen)
		}
		c.Advertise = c.scheme + "://" + listen
	}
	return nil
}

func (c *clusterConfig) etcdClient() (*clientv3.Client, error) {
	var eps []string
	for _, e := range strings.Split(c.Etcd, ",") {
		if e = strings.TrimSpace(e); e != "" {
			eps = append(eps, e)
		}
	}
	tlsCfg, err := c.TLS.etcd()
	if err != nil {
		return nil, err
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: eps, DialTimeout: 5 * time.Second, Logger: zap.NewNop(), TLS: tlsCfg})
	if err != nil {
		return nil, fmt.Errorf("etcd %s: %w", c.Etcd, err)
	}
	return cli, nil
}

// registerNode makes the node a member of the cluster: it mirrors the
// cluster's environments and layer tags into its layer store (and sends
// api's environment writes, and the store's tag moves, to etcd), registers, and heartbeats until ctx ends.
// The returned stop waits for it to leave. e2bAddr is the address of the
// node's E2B endpoint (nil: it serves none).
func registerNode(ctx context.Context, c clusterConfig, e2bAddr net.Addr, mgr *node.Manager, layers *layer.Store, api *control.Server, log *slog.Logger) (stop func(), err error) {
	e2bURL, err := c.e2bURL(e2bAddr)
	if err != nil {
		return nil, err
	}
	cli, err := c.etcdClient()
	if err != nil {
		return nil, err
	}
	runCtx, cancelRun := context.WithCancel(ctx)
	// The environments first: a node that was down catches up before it
	// takes creates.
	mirror, err := cluster.MirrorLayers(runCtx, cli, layers, log)
	if err != nil {
		cancelRun()
		cli.Close()
		return nil, fmt.Errorf("read the cluster's environments and layer tags from etcd: %w", err)
	}
	api.SetClusterEnvs(&control.ClusterEnvs{Client: cli, Mirror: mirror})
	layers.SetClusterTags(mirror)
	report := func() (placement.Node, []cluster.CatalogEntry) {
		l := mgr.Load()
		n := placement.Node{MilliCPU: l.MilliCPU, Memory: l.Memory, UsedMilliCPU: l.UsedMilliCPU, UsedMemory: l.UsedMemory,
			Sandboxes: l.Sandboxes, Backends: l.Backends}
		if ls, err := layers.List(); err == nil {
			for _, x := range ls { // the cluster's tags: those whose image is here
				if layers.Holds(x.Digest) {
					n.Layers = append(n.Layers, x.Ref())
				}
			}
		}
		recs := mgr.List()
		sbs := make([]cluster.CatalogEntry, 0, len(recs))
		for _, r := range recs {
			sbs = append(sbs, cluster.CatalogEntry{ID: r.ID, Tenant: r.Tenant, Created: r.Created, MilliCPU: r.Resources.MilliCPU, Memory: r.Resources.MemoryBytes})
		}
		return n, sbs
	}
	var storeURL string
	if rs := layers.RemoteStore(); rs != nil {
		storeURL = rs.URL()
	}
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	reg, err := cluster.Register(rctx, cli, cluster.RegisterConfig{Name: c.NodeName, URL: c.Advertise, E2BURL: e2bURL, LayerStore: storeURL,
		TTL: c.NodeTTL, Report: report, Log: log})
	cancel()
	if err != nil {
		cancelRun()
		cli.Close()
		return nil, fmt.Errorf("register node %s in etcd: %w", c.NodeName, err)
	}
	log.Info("cluster: node registered", "node", c.NodeName, "tag", reg.Tag(), "url", c.Advertise, "e2b_url", e2bURL, "etcd", c.Etcd)
	done := make(chan struct{})
	go func() { defer close(done); reg.Run(runCtx) }()
	return func() { cancelRun(); <-done; cli.Close() }, nil
}

// nodeTenancy follows the cluster's tenants' keys and quotas in etcd for
// a node, until the returned stop. The node's own keys and quotas
// (DATA/shoal.db, made while it served alone) are not used while it is a
// node of a cluster, nor changed: it says so if it has any (they work
// again if it serves alone again).
func nodeTenancy(c clusterConfig, local *tenant.Store, log *slog.Logger) (*cluster.Tenancy, func(), error) {
	cli, err := c.etcdClient()
	if err != nil {
		return nil, nil, err
	}
	ctx, cancel := context.WithCancel(context.Background()) // the watch follows for as long as the node serves
	ten, err := cluster.WatchTenancy(ctx, cli, log)
	if err != nil {
		cancel()
		cli.Close()
		return nil, nil, fmt.Errorf("etcd %s: %w", c.Etcd, err)
	}
	if n, q := len(local.Keys()), len(local.Tenants()); n > 0 || q > 0 {
		log.Warn("cluster: this node's own tenants' keys and quotas (DATA/shoal.db) are not used while it is a node of a cluster: the cluster's (etcd) are; make them again through a control replica (shoal key create, shoal tenant set)",
			"local_keys", n, "local_tenants", q, "cluster_keys", len(ten.Keys()))
	}
	return ten, func() { cancel(); cli.Close() }, nil
}

// e2bURL is the E2B endpoint a node publishes: --e2b-advertise, else
// http://<the address it listens on>; none when it serves no E2B.
func (c *clusterConfig) e2bURL(addr net.Addr) (string, error) {
	if addr == nil {
		if c.E2BAdvertise != "" {
			return "", errors.New("--e2b-advertise: this node serves no E2B endpoint (--e2b-listen is empty, or its default address was taken)")
		}
		return "", nil
	}
	scheme := "http"
	if c.e2bClosed {
		scheme = "https"
	}
	if c.E2BAdvertise != "" {
		u, err := url.Parse(c.E2BAdvertise)
		if err != nil || u.Scheme != scheme || u.Host == "" {
			return "", fmt.Errorf("--e2b-advertise %q: want %s://HOST:PORT", c.E2BAdvertise, scheme)
		}
		return c.E2BAdvertise, nil
	}
	if a, ok := addr.(*net.TCPAddr); ok && a.IP.IsUnspecified() {
		return "", fmt.Errorf("--e2b-listen %s listens on every address: give --e2b-advertise, the URL control replicas reach this node's E2B endpoint at", addr)
	}
	return scheme + "://" + addr.String(), nil
}

// serveControl runs a control replica: the API in front of the cluster's
// nodes. It keeps no state of its own beyond its admin key (DATA/admin.key,
// which every node's data directory must hold too) and its audit log
// (DATA/audit.log).
func serveControl(cfg serveConfig) error {
	log := newLogger(cfg) // serve.go
	if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
		return err
	}
	auth, err := control.LoadOrCreateAdminKey(cfg.DataDir)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	cli, err := cfg.Cluster.etcdClient()
	if err != nil {
		return err
	}
	defer cli.Close()
	engine := placement.New(placement.Config{MaxAttempts: cfg.Cluster.PlaceAttempts, MaxWait: cfg.Cluster.PlaceWait})
	lctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	_, err = cli.Get(lctx, cluster.Prefix, clientv3.WithCountOnly())
	cancel()
	if err != nil {
		return fmt.Errorf("etcd %s: %w", cfg.Cluster.Etcd, err)
	}
	dir, err := cluster.WatchDirectory(ctx, cli, engine, log) // follows etcd as long as the server runs
	if err != nil {
		return err
	}
	// The cluster's tenants' keys and quotas, each tenant's usage across
	// the cluster (the catalog), and the replica's own audit log of what
	// it changes and refuses (DATA/audit.log).
	keys, err := cluster.WatchTenancy(ctx, cli, log)
	if err != nil {
		return err
	}
	usage, err := cluster.WatchUsage(ctx, cli, keys, log)
	if err != nil {
		return err
	}
	auditLog, err := audit.Open(filepath.Join(cfg.DataDir, "audit.log"), 0, log, nil)
	if err != nil {
		return err
	}
	defer auditLog.Close()
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return err
	}
	var protocols http.Protocols
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	fwd := control.NewForwarder(dir, engine, auth, log)
	nodesTLS, err := cfg.Cluster.TLS.nodes()
	if err != nil {
		ln.Close()
		return err
	}
	fwd.SetNodeTLS(nodesTLS)
	fwd.SetTenancy(keys, usage, auditLog)
	fwd.SetMetrics(metrics.New()) // GET /metrics: this replica's requests, placement, nodes
	if adv := cfg.Cluster.Advertise; adv != "" {
		// Known to the other replicas: they read its audit log, and split
		// tenants' creates per second with it.
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		rep, err := cluster.RegisterReplica(rctx, cli, adv, 0, log) // a lease of 10 s
		cancel()
		if err != nil {
			return fmt.Errorf("register the control replica in etcd: %w", err)
		}
		runCtx, cancelRun := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); rep.Run(runCtx) }()
		defer func() { cancelRun(); <-done }()
		usage.SetReplicas(rep)
		fwd.SetPeers(rep)
		log.Info("cluster: control replica registered", "id", rep.ID(), "url", adv)
	} else {
		log.Warn("cluster: this control replica does not register (--listen is on every address and --advertise is not given): the other replicas' `shoal audit` leave its log out, and tenants' creates per second are not split with it")
	}
	if err := fwd.SetClientKeyTTL(cfg.Cluster.ClientKeyTTL); err != nil {
		return err
	}
	ln, handler, err := cfg.TLS.wrap(ln, fwd.Handler(), "/healthz")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: handler, Protocols: &protocols, ReadHeaderTimeout: 10 * time.Second}
	e2bLn, domain, err := listenE2B(cfg, log)
	if err != nil {
		ln.Close()
		return err
	}
	log.Info("shoal control serving", "listen", ln.Addr().String(), "tls", cfg.TLS.Cert != "", "etcd", cfg.Cluster.Etcd, "nodes", len(dir.Live()),
		"admin_key", filepath.Join(cfg.DataDir, control.AdminKeyFile))
	errc := make(chan error, 2)
	go func() { errc <- srv.Serve(ln) }()
	if e2bLn != nil {
		// E2B's API and sandbox traffic for the whole cluster: creates
		// placed, the rest passed on to the nodes' E2B endpoints.
		e2bHTTP := &http.Server{Handler: fwd.E2BHandler(domain), Protocols: &protocols, ReadHeaderTimeout: 10 * time.Second}
		defer e2bHTTP.Close()
		log.Info("e2b endpoint serving (the cluster's)", "listen", e2bLn.Addr().String(), "domain", domain, "ca", filepath.Join(cfg.DataDir, e2b.CAFile))
		go func() { errc <- e2bHTTP.Serve(e2bLn) }()
	}
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	shutdown, cancel2 := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel2()
	return srv.Shutdown(shutdown)
}

// listenE2B opens the control replica's E2B endpoint as the all-in-one
// serve does (serve.go): plain HTTP and TLS on one port, a default port
// that is taken only warned about. nil: none.
func listenE2B(cfg serveConfig, log *slog.Logger) (net.Listener, string, error) {
	if cfg.E2B.Listen == "" {
		return nil, "", nil
	}
	ln, err := net.Listen("tcp", cfg.E2B.Listen)
	if err != nil {
		if cfg.E2B.ListenSet {
			return nil, "", fmt.Errorf("--e2b-listen: %w", err)
		}
		log.Warn("E2B endpoint disabled: its default address is taken (pass --e2b-listen to choose one)", "listen", cfg.E2B.Listen, "err", err)
		return nil, "", nil
	}
	domain := cfg.E2B.Domain
	if domain == "" {
		domain = "shoal.localhost:" + strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	}
	tl, err := e2b.Serve(ln, cfg.DataDir, domain)
	if err != nil {
		ln.Close()
		return nil, "", err
	}
	return tl, domain, nil
}

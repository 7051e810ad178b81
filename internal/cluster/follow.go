package cluster

import (
	"context"
	"log/slog"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// follower keeps an in-memory copy of a prefix (or a few) of etcd: a load
// of it all, then its watch's events from the revision that load read at.
type follower struct {
	cli    *clientv3.Client
	prefix string
	// more prefixes, watched from the same revision as prefix; their
	// responses are applied one at a time, as prefix's are (each
	// prefix's in order; the load must read them all at its revision).
	more []string
	what string // for the log: "nodes", "environments", ...
	log  *slog.Logger
	// load reads the whole prefix into the copy and returns the revision
	// it read at; reloadTimeout bounds it after a broken watch.
	load          func(context.Context) (int64, error)
	reloadTimeout time.Duration
	// apply applies one watch response (its events, or none: a progress
	// notification) to the copy.
	apply func(clientv3.WatchResponse)
	opts  []clientv3.OpOption // more watch options
}

// run applies the watch's events from revision rev on until ctx ends;
// when the watch breaks (etcd compacted past it, or a long partition) it
// reloads and watches anew.
func (f follower) run(ctx context.Context, rev int64) {
	for ctx.Err() == nil {
		f.watch(ctx, rev)
		if ctx.Err() != nil {
			return
		}
		time.Sleep(200 * time.Millisecond) // do not spin on a broken etcd
		lctx, cancel := context.WithTimeout(ctx, f.reloadTimeout)
		r, err := f.load(lctx)
		cancel()
		if err != nil {
			f.log.Warn("cluster: reload "+f.what, "err", err)
			continue
		}
		rev = r
	}
}

// watch applies the events of every prefix from revision rev on, until
// one of the watches breaks or ctx ends.
func (f follower) watch(ctx context.Context, rev int64) {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	opts := append([]clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithRev(rev + 1)}, f.opts...)
	if len(f.more) == 0 {
		defer cancel()
		for resp := range f.cli.Watch(wctx, f.prefix, opts...) {
			if err := resp.Err(); err != nil {
				f.log.Warn("cluster: watch "+f.what, "err", err)
				return
			}
			f.apply(resp)
		}
		return
	}
	// One goroutine per watch feeds resps; a watch that ends ends them
	// all (and the copy reloads).
	resps := make(chan clientv3.WatchResponse)
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	for _, p := range append([]string{f.prefix}, f.more...) {
		wc := f.cli.Watch(wctx, p, opts...)
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer cancel()
			for resp := range wc {
				select {
				case resps <- resp:
				case <-wctx.Done():
					return
				}
			}
		}()
	}
	for {
		select {
		case resp := <-resps:
			if err := resp.Err(); err != nil {
				f.log.Warn("cluster: watch "+f.what, "err", err)
				return
			}
			f.apply(resp)
		case <-wctx.Done():
			return
		}
	}
}

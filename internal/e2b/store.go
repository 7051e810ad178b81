package e2b

import (
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"time"

	"go.etcd.io/bbolt"

	"github.com/shoal-sandbox/shoal/internal/boltgroup"
)

// What the E2B face adds to Shoal's own records, persisted in the node's
// store so that it survives a restart of `shoal serve`: per sandbox, the
// template it was created from and its pause state; per command started
// through E2B, its tag and its configuration as the client gave it (E2B's
// process list reports both).
var (
	bucketSandboxes = []byte("e2b.sandboxes") // sandbox ID → sandboxMeta
	bucketCommands  = []byte("e2b.commands")  // sandboxID/commandID → commandMeta
)

type sandboxMeta struct {
	Template string `json:"template"`
	// Deadline is when E2B's timeout kills the sandbox, whatever it is
	// doing (E2B's timeout is a time to live; Shoal's own is an idle
	// timeout, which a running command suspends). Zero: no deadline (a
	// sandbox made through Shoal's own API, or a paused one).
	Deadline time.Time `json:"deadline,omitzero"`
	Paused   bool      `json:"paused,omitempty"`
	// AutoPause: at its deadline the sandbox is paused, not killed (E2B's
	// lifecycle onTimeout: 'pause', the create's autoPause).
	AutoPause bool `json:"auto_pause,omitempty"`
	// AutoPauseFSOnly: that pause keeps the files only (onTimeout
	// keepMemory: false, the create's autoPauseMemory false).
	AutoPauseFSOnly bool `json:"auto_pause_fs_only,omitempty"`
	// ResumeTimeout is the sandbox's timeout before it was paused.
	ResumeTimeout time.Duration `json:"resume_timeout,omitempty"`
	// Public: its ports are served to anyone who knows the sandbox's
	// address (made through E2B without network.allowPublicTraffic =
	// false). Otherwise they need the traffic access token, and a sandbox
	// made through Shoal's own API (no entry, or one written later by an
	// E2B call that knew nothing of its network) is never public.
	Public *bool `json:"public,omitempty"`
	// Private is what entries written before Public said: set when
	// allowPublicTraffic was false (read by public()).
	Private bool `json:"private,omitempty"`
}

// public reports whether a sandbox's ports are open without the traffic
// access token. Entries older than the Public field: the E2B-made ones
// (they name a template) that were not created private.
func (m sandboxMeta) public() bool {
	if m.Public != nil {
		return *m.Public
	}
	return m.Template != "" && !m.Private
}

type commandMeta struct {
	Tag  string            `json:"tag,omitempty"`
	Cmd  string            `json:"cmd"`
	Args []string          `json:"args,omitempty"`
	Envs map[string]string `json:"envs,omitempty"`
	Cwd  string            `json:"cwd,omitempty"`
}

// store caches both buckets in memory; writes go through to bbolt.
type store struct {
	db *bbolt.DB

	mu        sync.Mutex             // guards the maps
	sandboxes map[string]sandboxMeta // by sandbox ID
	commands  map[string]commandMeta // by sandboxID/commandID
}

func openStore(db *bbolt.DB) (*store, error) {
	st := &store{db: db, sandboxes: map[string]sandboxMeta{}, commands: map[string]commandMeta{}}
	err := db.Update(func(tx *bbolt.Tx) error {
		sb, err := tx.CreateBucketIfNotExists(bucketSandboxes)
		if err != nil {
			return err
		}
		cb, err := tx.CreateBucketIfNotExists(bucketCommands)
		if err != nil {
			return err
		}
		if err := sb.ForEach(func(k, v []byte) error {
			var m sandboxMeta
			if err := json.Unmarshal(v, &m); err != nil {
				return fmt.Errorf("decode %s: %w", k, err)
			}
			st.sandboxes[string(k)] = m
			return nil
		}); err != nil {
			return err
		}
		return cb.ForEach(func(k, v []byte) error {
			var m commandMeta
			if err := json.Unmarshal(v, &m); err != nil {
				return fmt.Errorf("decode %s: %w", k, err)
			}
			st.commands[string(k)] = m
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("open e2b store: %w", err)
	}
	return st, nil
}

func (st *store) sandbox(id string) (sandboxMeta, bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	m, ok := st.sandboxes[id]
	return m, ok
}

// expired returns the sandboxes whose deadline is before now.
func (st *store) expired(now time.Time) []string {
	st.mu.Lock()
	defer st.mu.Unlock()
	var ids []string
	for id, m := range st.sandboxes {
		if !m.Deadline.IsZero() && !m.Paused && now.After(m.Deadline) {
			ids = append(ids, id)
		}
	}
	return ids
}

func (st *store) putSandbox(id string, m sandboxMeta) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	if err := boltgroup.Update(st.db, func(tx *bbolt.Tx) error { return tx.Bucket(bucketSandboxes).Put([]byte(id), b) }); err != nil {
		return fmt.Errorf("persist e2b sandbox %s: %w", id, err)
	}
	st.mu.Lock()
	st.sandboxes[id] = m
	st.mu.Unlock()
	return nil
}

func (st *store) command(sandboxID, commandID string) (commandMeta, bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	m, ok := st.commands[sandboxID+"/"+commandID]
	return m, ok
}

// putCommand records a command's E2B configuration. It is persisted in the
// background: a command's start does not wait for bbolt's batch delay, and a
// crash in between loses only what E2B's process list shows of it (it then
// shows the command's argv as Shoal ran it). done, if not nil, gets the
// outcome.
func (st *store) putCommand(sandboxID, commandID string, m commandMeta, done func(error)) {
	k := sandboxID + "/" + commandID
	st.mu.Lock()
	st.commands[k] = m
	st.mu.Unlock()
	go func() {
		b, err := json.Marshal(m)
		if err == nil {
			err = boltgroup.Update(st.db, func(tx *bbolt.Tx) error {
				st.mu.Lock()
				_, live := st.commands[k]
				st.mu.Unlock()
				if !live {
					return nil // its sandbox is gone meanwhile
				}
				return tx.Bucket(bucketCommands).Put([]byte(k), b)
			})
		}
		if err != nil {
			err = fmt.Errorf("persist e2b command %s: %w", k, err)
		}
		if done != nil {
			done(err)
		}
	}()
}

// commandsByTag returns the IDs of a sandbox's commands started with tag.
func (st *store) commandsByTag(sandboxID, tag string) []string {
	prefix := sandboxID + "/"
	st.mu.Lock()
	defer st.mu.Unlock()
	var ids []string
	for k, m := range st.commands {
		if m.Tag == tag && strings.HasPrefix(k, prefix) {
			ids = append(ids, k[len(prefix):])
		}
	}
	return ids
}

// dropCommands forgets some commands of a sandbox.
func (st *store) dropCommands(sandboxID string, ids []string) error {
	keys := make([][]byte, 0, len(ids))
	st.mu.Lock()
	for _, id := range ids {
		k := sandboxID + "/" + id
		if _, ok := st.commands[k]; ok {
			delete(st.commands, k)
			keys = append(keys, []byte(k))
		}
	}
	st.mu.Unlock()
	if len(keys) == 0 {
		return nil
	}
	return boltgroup.Update(st.db, func(tx *bbolt.Tx) error {
		for _, k := range keys {
			if err := tx.Bucket(bucketCommands).Delete(k); err != nil {
				return err
			}
		}
		return nil
	})
}

func (st *store) dropSandbox(id string) error {
	return st.drop(func(sandboxID string) bool { return sandboxID == id })
}

// prune drops every sandbox not in live.
func (st *store) prune(live map[string]bool) error {
	return st.drop(func(sandboxID string) bool { return !live[sandboxID] })
}

func (st *store) drop(gone func(sandboxID string) bool) error {
	st.mu.Lock()
	var sbKeys, cmdKeys []string
	for id := range st.sandboxes {
		if gone(id) {
			sbKeys = append(sbKeys, id)
			delete(st.sandboxes, id)
		}
	}
	for k := range st.commands {
		if sid, _, _ := strings.Cut(k, "/"); gone(sid) {
			cmdKeys = append(cmdKeys, k)
			delete(st.commands, k)
		}
	}
	st.mu.Unlock()
	if len(sbKeys) == 0 && len(cmdKeys) == 0 {
		return nil
	}
	return st.db.Update(func(tx *bbolt.Tx) error {
		for _, k := range sbKeys {
			if err := tx.Bucket(bucketSandboxes).Delete([]byte(k)); err != nil {
				return err
			}
		}
		for _, k := range cmdKeys {
			if err := tx.Bucket(bucketCommands).Delete([]byte(k)); err != nil {
				return err
			}
		}
		return nil
	})
}

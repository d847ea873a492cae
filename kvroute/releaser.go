package kvroute

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"log/slog"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bidikv/bidikv/kvroute/internal/bufpool"
	"github.com/bidikv/bidikv/kvroute/internal/entry"
	"github.com/bidikv/bidikv/kvroute/internal/kvhandle"
	"github.com/bidikv/bidikv/kvroute/internal/upstream"
	"github.com/bidikv/bidikv/retention/budget"
)

// Release requests. Where no turn is coming to carry a hold's release
// (the holds over an engine's budget, or in the way of a decode leg that
// arrives at it: memory.go), the router sends one itself: a
// prefill request of a one-token prompt, max_tokens 1, whose
// kv_transfer_params is the hold's handle with remote_num_tokens 0
// (kvhandle.Release). The prefill engine counts nothing to pull, takes
// the notify-only path and tells the decode engine to free the hold; its
// own one-block hold for the decode leg that never comes lapses by its
// lease (kv_lease_duration, 30 s). A release is at most once, as a hit
// is: the handle is taken from the Store first, so among routers sharing
// a store only the one that takes it releases it (a failed take: another
// router's turn or release had it, or it expired). It runs in the
// background, bounded by DecodeMemory's Releases, never on a turn's path;
// a failed one is counted (Stats.ReleaseFailures) and logged once per
// prefill engine, and the hold lapses at its TTL.

// releaseReason is why a hold was released (Stats.Released*).
type releaseReason int

const (
	// releaseSuperseded: a turn took the handle and did not attach it; its
	// own new handle replaces it (lookup.go).
	releaseSuperseded releaseReason = iota
	// releaseUnusable: a handle found past the retention TTL, while its
	// decode engine still holds it.
	releaseUnusable
	// releaseBudget: a hold over its engine's budget, worth least.
	releaseBudget
	// releaseRoom: a hold in the way of a decode leg arriving at its
	// engine, worth least (memory.go, arrive).
	releaseRoom
	// releaseExpired: a hold whose retention TTL ended without a next
	// turn (memory.go, sweep).
	releaseExpired
	// Orphans (below): decode handles the router received and does
	// not keep. releaseNChoices: an answer of n > 1 choices;
	// releaseRefused: a turn not retained; releaseStoreError: a Put that
	// failed; releaseOverwritten: a retained handle under the key a turn
	// retains its own under.
	releaseNChoices
	releaseRefused
	releaseStoreError
	releaseOverwritten
	// releaseFinal: the handle of a turn whose request ended its session
	// (retain.go, sessionFinal).
	releaseFinal
)

// releaser sends the release requests of the holds over budget.
type releaser struct {
	mem     *decodeMemory
	store   Store
	prefill *pool
	decode  *pool
	bufs    *bufpool.Bytes
	timeout time.Duration // WithTimeouts' Prefill
	sem     chan struct{} // release requests in flight
	waiting atomic.Int64  // orphans' releases queued (orphaned, below)
	mu      sync.Mutex
	// running: engines whose holds a goroutine is releasing; again: the
	// engine went over its budget again meanwhile. One goroutine per
	// engine at most, however slow the release requests.
	running, again map[string]bool
	chosen         chosenKeys
}

// chosenKeys are the keys of the victims whose handles their releases
// have not taken yet (releaser.held).
type chosenKeys struct {
	mu sync.Mutex
	m  map[string]int
}

// choose runs pick, the ledger's choice of victims, and marks them until
// their handles are taken, both at once: a turn that finds a key gone
// from the ledger finds it marked (releaser.held).
func (c *chosenKeys) choose(pick func() []budget.Victim) []budget.Victim {
	c.mu.Lock()
	defer c.mu.Unlock()
	victims := pick()
	for _, v := range victims {
		if c.m == nil {
			c.m = map[string]int{}
		}
		c.m[v.Key]++
	}
	return victims
}

// unchoose ends the victims' marks.
func (c *chosenKeys) unchoose(victims []budget.Victim) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, v := range victims {
		if c.m[v.Key]--; c.m[v.Key] <= 0 {
			delete(c.m, v.Key)
		}
	}
}

func (c *chosenKeys) has(key string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.m[key] > 0
}

// nudge has the holds over engine's budget released, in the background.
func (rl *releaser) nudge(engine string) {
	rl.mu.Lock()
	defer rl.mu.Unlock()
	if rl.running[engine] {
		rl.again[engine] = true
		return
	}
	if rl.mem.bg.run(func(ctx context.Context) { rl.run(ctx, engine) }) {
		rl.running[engine] = true
	}
}

// run releases the holds the ledger chooses on engine, least value first,
// until it fits its budget, and again while nudges came meanwhile.
func (rl *releaser) run(ctx context.Context, engine string) {
	defer func() {
		rl.mu.Lock()
		delete(rl.running, engine)
		delete(rl.again, engine)
		rl.mu.Unlock()
	}()
	for {
		if !rl.release(ctx, engine) {
			return
		}
		rl.mu.Lock()
		again := rl.again[engine]
		delete(rl.again, engine)
		rl.mu.Unlock()
		if !again {
			return
		}
	}
}

// release sends the release requests of the holds over engine's budget,
// or in the way of its live decode legs (memory.go, room), now, bounded by DecodeMemory's Releases; false once the work stops.
func (rl *releaser) release(ctx context.Context, engine string) bool {
	return rl.releaseAll(ctx, rl.chosen.choose(func() []budget.Victim {
		return rl.mem.ledger.Victims(engine, rl.mem.room(rl.decode.find(engine)), rl.mem.clock())
	}), releaseBudget)
}

// held reports whether this Router knows of a handle under key in the
// Store: a live hold in the ledger (of any Router sharing it), or a
// victim whose handle its own release has not taken yet (store.go,
// supersede).
func (rl *releaser) held(key string) bool {
	if _, live := rl.mem.ledger.Lookup(key); live {
		return true
	}
	return rl.chosen.has(key)
}

// start sends the release requests of victims already chosen, for why,
// in the background.
func (rl *releaser) start(victims []budget.Victim, why releaseReason) {
	if len(victims) > 0 && !rl.mem.bg.run(func(ctx context.Context) { rl.releaseAll(ctx, victims, why) }) {
		rl.chosen.unchoose(victims)
	}
}

// releaseAll sends the release requests of victims, bounded by
// DecodeMemory's Releases; false once the work stops.
func (rl *releaser) releaseAll(ctx context.Context, victims []budget.Victim, why releaseReason) bool {
	for i, v := range victims {
		select {
		case rl.sem <- struct{}{}:
		case <-ctx.Done():
			rl.chosen.unchoose(victims[i:])
			return false
		}
		e, ok := rl.take(ctx, v)
		rl.chosen.unchoose(victims[i : i+1])
		if !ok {
			<-rl.sem
			continue
		}
		if !rl.mem.bg.run(func(ctx context.Context) {
			defer func() { <-rl.sem }()
			rl.send(ctx, e, why)
		}) {
			<-rl.sem
			rl.chosen.unchoose(victims[i+1:])
			return false
		}
	}
	return true
}

// take takes key's entry from the Store for its release: ok is false
// when it is gone (another router's turn or release took it, it expired,
// the Store failed), and then nothing is released.
func (rl *releaser) take(ctx context.Context, v budget.Victim) (entry.Entry, bool) {
	sctx, cancel := context.WithTimeout(ctx, storeTimeout)
	defer cancel()
	val, ok, err := rl.store.Take(sctx, v.Key)
	if err != nil || !ok {
		rl.mem.stats.releaseGone.Add(1)
		return entry.Entry{}, false
	}
	e, err := entry.Decode(val, nil)
	if err != nil {
		rl.mem.stats.releaseFailures.Add(1)
		return entry.Entry{}, false
	}
	if e.Endpoint != v.Engine || e.Created.After(v.Created) {
		// A later hold under the key, stored since the victim was chosen
		// (by a turn of another router sharing the store, or of one with
		// a ledger of its own): not this release's. It goes back as taken.
		if left := rl.mem.ttl - rl.mem.clock().Sub(e.Created); left > 0 {
			_ = rl.store.Put(sctx, v.Key, e.Raw, rl.mem.storeTTL(left))
		}
		rl.mem.stats.releaseGone.Add(1)
		return entry.Entry{}, false
	}
	return e, true
}

// send sends e's release request to a prefill engine and counts the
// outcome.
func (rl *releaser) send(ctx context.Context, e entry.Entry, why releaseReason) {
	st := rl.mem.stats
	if rl.mem.meter.restarts.restartedSince(&e) || rl.decode.find(e.Endpoint) == nil {
		// Its blocks are gone, or its engine left the pool (a scaled-down
		// Deployment): P could not reach it, and the request would fail
		// on P as a failed KV read.
		st.releaseSkipped.Add(1)
		return
	}
	h, err := kvhandle.ReleaseKnown(e.Handle, 0, e.Blocks) // reads nothing: no block-count check
	ep := rl.pick()
	if err != nil || ep == nil || e.Model == "" {
		// A handle vLLM would not read, no prefill engine, or an entry of
		// a router before version 4 (no model to name): it lapses.
		st.releaseFailures.Add(1)
		return
	}
	ep.inflight.Add(1)
	defer ep.inflight.Add(-1)
	status, err := rl.post(ctx, ep, e, h)
	if err != nil || status != http.StatusOK {
		st.releaseFailures.Add(1)
		msg := "status " + strconv.Itoa(status)
		if status == 0 {
			msg = err.Error()
		}
		rl.mem.log.once(ctx, "release_failed:"+ep.url, "kvroute: a release request failed; the hold lapses at its TTL (logged once per prefill engine)",
			slog.String("endpoint", ep.url), slog.String("err", msg))
		return
	}
	st.released(why)
}

// releaseTimeout bounds a release request when WithTimeouts' Prefill is
// none.
const releaseTimeout = time.Minute

// releaseUserAgent tells release requests from turns in engine logs.
const releaseUserAgent = "bidikv-release"

// post sends the release request to ep: a one-token prompt on the
// hold's own model, to /v1/completions for a hold made there, else to
// /v1/chat/completions.
func (rl *releaser) post(ctx context.Context, ep *endpoint, e entry.Entry, handle []byte) (int, error) {
	model, _ := json.Marshal(e.Model)
	path, body := PathChatCompletions, []byte(`{"model":`)
	body = append(body, model...)
	if e.API == apiCode(PathCompletions) {
		path = PathCompletions
		body = append(body, `,"prompt":"."`...)
	} else {
		body = append(body, `,"messages":[{"role":"user","content":"."}]`...)
	}
	body = append(body, `,"max_tokens":1,"stream":false,"kv_transfer_params":`...)
	body = append(append(body, handle...), '}')
	timeout := rl.timeout
	if timeout <= 0 {
		timeout = releaseTimeout // WithTimeouts' Prefill none: a release is bounded all the same
	}
	var id [8]byte
	_, _ = rand.Read(id[:])
	return rl.mem.client.Call(ctx, ep.ep, upstream.Call{Method: http.MethodPost, Path: path, Body: body,
		ID: "bidikv-release-" + hex.EncodeToString(id[:]), UserAgent: releaseUserAgent, Timeout: timeout, Limit: upstream.MaxErrorBody}, nil)
}

// pick returns the eligible prefill engine with the fewest requests open,
// or nil.
func (rl *releaser) pick() *endpoint {
	now := rl.prefill.hp.now()
	var best *endpoint
	for _, e := range rl.prefill.list() {
		if e.health.Eligible(now) && (best == nil || e.inflight.Load() < best.inflight.Load()) {
			best = e
		}
	}
	return best
}

// Orphan holds. A vLLM decode engine holds the blocks of every request
// that carried P's handle and finished normally, whether or not the
// router keeps the handle it answers with (the protocol's "Decode
// memory"). A handle the router receives and does not keep is an orphan:
// nothing would ever attach or release it, and the engine would pin its
// blocks for its TTL (480 s) while the ledger counts none of them. So
// every such handle is released at once by a release request
// (above: a one-token prefill request carrying the handle with
// remote_num_tokens 0), in the background, bounded by DecodeMemory's
// Releases, never on the turn's path, and counted by reason:
//
//   - an answer of n > 1 choices (releaseNChoices): which choice's tokens
//     the blocks hold is unknown (retain.go);
//   - a turn not retained (releaseRefused): a finish the router does not
//     retain, the Identifier's refusal, no render to seal the entry with,
//     an entry too large for the Store, reuse off;
//   - a Put that failed (releaseStoreError): released once a Take shows
//     that the Store does not hold it, since a failed Put may have stored
//     the value all the same (a Redis SET whose answer was lost), and a
//     handle in the Store may be attached by a later turn;
//   - a retained handle under the key a turn retains its own under
//     (releaseOverwritten; store.go, supersede): two turns of one
//     conversation at once, each of which looked the key up before the
//     other retained. A Put would overwrite it silently.
//
// A handle vLLM would misread or ignore, or one of push mode, is sent
// nowhere (Stats.Unreleasable), nor is anything with the management off
// (DecodeMemory's Budget negative: every hold is kept to the TTL).

// maxWaitingReleases bounds the orphans' release requests waiting for one
// of DecodeMemory's Releases: past it (a prefill engine that stopped
// answering while orphans keep coming), an orphan's hold lapses at its
// TTL and counts in Stats.ReleaseFailures.
const maxWaitingReleases = 1024

// orphaned has the hold of handle, which the turn's decode leg on engine
// answered with and the turn does not keep, released for why.
func orphaned(t *turn, engine string, handle []byte, why releaseReason) {
	if handle == nil {
		return
	}
	e := entry.Entry{Created: t.r.cfg.clock(), Endpoint: engine, Handle: handle, Model: t.req.model(), API: apiCode(t.req.Path)}
	t.r.mem.rel.orphan(e, why)
}

// releasable returns a copy of e for a release in the background, or
// false, counted, when its handle is not one to send anywhere: vLLM would
// misread or ignore it (kvhandle.Check), or it is of push mode.
func (rl *releaser) releasable(e entry.Entry) (entry.Entry, bool) {
	if !rl.mem.cfg.on {
		return entry.Entry{}, false
	}
	// No block-count check: a release reads nothing (remote_num_tokens 0).
	hi, err := kvhandle.Check(e.Handle, 0)
	if err != nil || hi.PushMode {
		rl.mem.stats.unreleasable.Add(1)
		return entry.Entry{}, false
	}
	return entry.Entry{Created: e.Created, Endpoint: e.Endpoint, Tokens: hi.Tokens, Handle: bytes.Clone(e.Handle),
		Model: e.Model, API: e.API}, true
}

// orphan releases e's hold for why, in the background; e's buffers are
// copied first (they may be the turn's).
func (rl *releaser) orphan(e entry.Entry, why releaseReason) {
	if e, ok := rl.releasable(e); ok {
		rl.queue(why, func(context.Context) (entry.Entry, bool) { return e, true })
	}
}

// unstored releases the hold of e, whose value val a Put under key failed
// to store, once a Take shows that the Store does not hold it (or takes
// it back): a failed Put may have stored it all the same. A Store that
// cannot answer the Take leaves the hold to its TTL (Stats.Unreleasable).
// An entry stored under key since (another turn's, or another router's)
// goes back untouched.
func (rl *releaser) unstored(key string, e entry.Entry, val []byte) {
	e, ok := rl.releasable(e)
	if !ok {
		return
	}
	val = bytes.Clone(val)
	rl.queue(releaseStoreError, func(ctx context.Context) (entry.Entry, bool) {
		sctx, cancel := context.WithTimeout(ctx, storeTimeout)
		defer cancel()
		v, ok, err := rl.store.Take(sctx, key)
		switch {
		case err != nil:
			rl.mem.stats.unreleasable.Add(1)
			return entry.Entry{}, false
		case ok && !bytes.Equal(v, val):
			if other, err := entry.Decode(v, nil); err == nil {
				if left := rl.mem.ttl - rl.mem.clock().Sub(other.Created); left > 0 {
					_ = rl.store.Put(sctx, key, v, rl.mem.storeTTL(left))
				}
			}
		}
		return e, true
	})
}

// queue runs a release for why in the background: get returns the entry
// to release, or false for none; the request then waits for one of
// DecodeMemory's Releases.
func (rl *releaser) queue(why releaseReason, get func(ctx context.Context) (entry.Entry, bool)) {
	if rl.waiting.Add(1) > maxWaitingReleases {
		rl.waiting.Add(-1)
		rl.mem.stats.releaseFailures.Add(1)
		rl.mem.log.once(context.Background(), "release_backlog", "kvroute: too many release requests waiting for the prefill engines; holds not released lapse at their TTL (logged once)",
			slog.Int("waiting", maxWaitingReleases))
		return
	}
	if !rl.mem.bg.run(func(ctx context.Context) {
		defer rl.waiting.Add(-1)
		e, ok := get(ctx)
		if !ok {
			return
		}
		select {
		case rl.sem <- struct{}{}:
		case <-ctx.Done():
			return
		}
		defer func() { <-rl.sem }()
		rl.send(ctx, e, why)
	}) {
		rl.waiting.Add(-1)
	}
}

// background runs the management's work off the turns' paths, and stops
// it once.
type background struct {
	mu     sync.Mutex
	closed bool
	wg     sync.WaitGroup
	ctx    context.Context
	cancel context.CancelFunc
}

// run runs f in a goroutine unless the work was stopped; it reports
// whether it did.
func (b *background) run(f func(ctx context.Context)) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return false
	}
	b.wg.Go(func() { f(b.ctx) })
	return true
}

func (b *background) stop() {
	b.mu.Lock()
	b.closed = true
	b.mu.Unlock()
	b.cancel()
	b.wg.Wait()
}

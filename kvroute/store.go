package kvroute

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bidikv/bidikv/kvroute/internal/bufpool"
	"github.com/bidikv/bidikv/kvroute/internal/entry"
	"github.com/bidikv/bidikv/kvroute/internal/kvhandle"
	"github.com/bidikv/bidikv/retention"
	"github.com/bidikv/bidikv/retention/budget"
)

// Store retains decode handles between turns. Package retention has an
// in-memory Store (the default), retention/redisstore one shared by router
// replicas; kvroutetest.TestStore checks any implementation against this
// contract. It is a public seam (ARCHITECTURE.md, Seams): a Store of one's
// own is given with WithStore (ExampleStore).
//
// Values are opaque bytes produced by the Router (a small header, the
// decode engine's kv_transfer_params, its token fingerprint); a Store must
// return them exactly as stored. Keys are opaque strings. The value given
// to Put belongs to the caller once Put returns: a Store that keeps bytes
// copies them (the Router builds values in buffers it reuses). The value
// Take returns belongs to the caller.
//
// Take must be atomic: among any number of concurrent and later callers, at
// most one receives a given stored value, because a decode handle may be
// attached to at most one prefill request, ever. A Store is safe for
// concurrent use.
//
// With decode memory management on (WithDecodeMemory), the Router takes a
// key it retained a handle under before it puts a new value there (one
// key at a time within a Router), so that the value it would overwrite is
// released on its decode engine rather than left pinned there. After a
// failed Put, it releases the handle only once a Take shows that the
// Store does not hold it: a Put that fails may have stored the value all
// the same.
//
// Errors: a Put refused for the value's size returns an error wrapping
// retention.ErrTooLarge (the turn reports StoreRefusal "handle_too_large",
// counted in Stats.TooLarge, not as a Store failure). Any other error is a
// Store failure: the turn goes on as a miss (Stats.StoreErrors), and the
// Router logs the outage once, and again when the Store answers.
type Store interface {
	// Put stores value under key for ttl, replacing any earlier value.
	// A ttl <= 0 is an error.
	Put(ctx context.Context, key string, value []byte, ttl time.Duration) error
	// Take removes and returns the value stored under key. ok is false
	// when there is none (never stored, expired, evicted or already taken).
	Take(ctx context.Context, key string) (value []byte, ok bool, err error)
}

// storeTimeout bounds the Put that retains a handle after the turn; it runs
// even if the client's context ended right after the last event.
const storeTimeout = 2 * time.Second

// handles is the Router's side of the Store: it takes, puts back and
// retains entries, keeps the ledger of the KV they hold in step (the
// decode memory's, memory.go: DecodeKV, the budget, the gap model), and
// turns Store failures into two log lines per outage.
type handles struct {
	store    Store
	mem      *decodeMemory
	ttl      time.Duration // WithRetentionTTL
	maxEntry int           // WithMaxEntryBytes
	clock    func() time.Time
	bufs     *bufpool.Bytes
	stats    *counters
	log      *logger
	locks    keyLocks // a key's supersede and Put, one at a time

	down   atomic.Bool
	failed atomic.Int64 // failures in the current outage
}

// take removes the entry under key from the Store; a failure is counted
// and the turn goes on as a miss.
func (h *handles) take(ctx context.Context, key, requestID string) ([]byte, bool, error) {
	v, ok, err := h.store.Take(ctx, key)
	if err != nil {
		h.storeFailed(ctx, "take", requestID, err)
		return nil, false, err
	}
	h.storeOK(ctx)
	// The conversation came back whether or not its hold is still
	// retained: the ledger observes the gap of one released or expired
	// (its tombstone) as well as a live one's, else the gap model would
	// learn that released conversations never return.
	h.mem.returned(key)
	return v, ok, nil
}

// putBack returns a taken, unused entry to the Store for the rest of its
// retention time (age is its age when taken); the ledger holds it again
// from now, for the conversation's next attempt. tenant is the turn's.
// An entry stored under key since e was taken (a later turn of the
// conversation's) is not overwritten: it stays, and e's hold is released
// (releaser.go, orphans).
func (h *handles) putBack(ctx context.Context, key, tenant string, e *entry.Entry, age time.Duration, requestID string) {
	left := h.ttl - age
	if left <= 0 {
		return
	}
	defer h.locks.lock(key)()
	if later, ok := h.supersede(ctx, key, requestID); ok {
		h.mem.rel.orphan(*e, releaseOverwritten)
		h.restore(ctx, key, later, requestID)
		return
	}
	if err := h.store.Put(ctx, key, e.Raw, h.mem.storeTTL(left)); err != nil {
		h.storeFailed(ctx, "put-back", requestID, err)
		return
	}
	h.storeOK(ctx)
	h.stats.putBacks.Add(1)
	h.mem.added(h.mem.hold(key, tenant, e, h.clock()), false)
}

// drop ends the conversation stored under key: it takes the entry, ends
// its hold in the ledger (the conversation will not come back) and has the
// hold released (releaseFinal). It reports whether the Store held one.
func (h *handles) drop(values context.Context, key string) (bool, error) {
	ctx, cancel := context.WithTimeout(values, storeTimeout)
	defer cancel()
	defer h.locks.lock(key)()
	v, ok, err := h.store.Take(ctx, key)
	if err != nil {
		h.storeFailed(ctx, "take", "", err)
		return false, err
	}
	h.storeOK(ctx)
	if !ok {
		return false, nil
	}
	h.mem.ledger.End(key, h.clock())
	e, err := entry.Decode(v, nil)
	if err != nil {
		h.stats.unreleasable.Add(1)
		return true, nil
	}
	h.mem.rel.orphan(e, releaseFinal)
	return true, nil
}

// restore puts e, which supersede took from under key, back for the rest
// of its retention time; when the Store does not keep it, its hold is
// released.
func (h *handles) restore(ctx context.Context, key string, e entry.Entry, requestID string) {
	left := h.ttl - h.clock().Sub(e.Created)
	if left > 0 {
		err := h.store.Put(ctx, key, e.Raw, h.mem.storeTTL(left))
		if err == nil {
			return
		}
		h.storeFailed(ctx, "put-back", requestID, err)
		h.mem.rel.unstored(key, e, e.Raw)
	}
	h.mem.ledger.End(key, h.clock())
}

// retain stores e under key for the retention TTL and reports why not, or
// that it did; the ledger records the hold (of the turn's tenant). The
// value is built in a pooled buffer, which the Store contract lets the
// Router reuse once Put returns. What the Store held under key (another
// turn's handle of the conversation) is released, not overwritten; e's
// own hold is released when the Store does not keep it.
func (h *handles) retain(values context.Context, key, tenant string, e entry.Entry, placed budget.Placement, requestID string) (Refusal, bool) {
	val := e.Encode(h.bufs.Get(e.EncodedSize()), h.bufs)
	defer h.bufs.Put(val)
	if len(val) > h.maxEntry {
		h.mem.rel.orphan(e, releaseRefused)
		return h.tooLarge(len(val)), false
	}
	ctx, cancel := context.WithTimeout(values, storeTimeout)
	defer cancel()
	defer h.locks.lock(key)()
	prev, took := h.supersede(ctx, key, requestID)
	if took {
		h.mem.rel.orphan(prev, releaseOverwritten)
	}
	if err := h.store.Put(ctx, key, val, h.mem.storeTTL(h.ttl)); err != nil {
		if took {
			// The ledger's hold under key went with what supersede took.
			h.mem.ledger.End(key, h.clock())
		}
		if errors.Is(err, retention.ErrTooLarge) {
			h.mem.rel.orphan(e, releaseRefused)
			return h.tooLarge(len(val)), false
		}
		h.storeFailed(ctx, "put", requestID, err)
		h.mem.rel.unstored(key, e, val)
		return RefuseStoreError, false
	}
	h.storeOK(ctx)
	h.stats.stored.Add(1)
	if h.mem.cfg.on {
		// where the next turn finds the history cached: P's prefix cache
		// (prefillFor), D's CPU tier (lookup.go, placedOf); recorded
		// before the hold is added, so that the budget's release of it
		// (at once, over the budget) marks the record as released
		h.mem.ledger.SetPlaced(key, placed, h.clock())
	}
	h.mem.added(h.mem.hold(key, tenant, &e, e.Created), true)
	return "", true
}

// supersede takes what the Store holds under key before a Put there, with
// the key locked (a Put would overwrite it, and nothing would ever attach
// or release its hold), and returns it: the caller keeps or releases it.
// It reads the Store only where this Router knows of a handle under key (a
// live hold in its ledger, or a victim its release has not taken yet:
// releaser.held), so that a turn costs no store read more than before;
// nothing with the management off (every hold kept to the TTL, a Put
// overwriting as before) or while the Store is failing.
func (h *handles) supersede(ctx context.Context, key, requestID string) (entry.Entry, bool) {
	if !h.mem.cfg.on || h.down.Load() || !h.mem.rel.held(key) {
		return entry.Entry{}, false
	}
	v, ok, err := h.store.Take(ctx, key)
	if err != nil {
		h.storeFailed(ctx, "take", requestID, err)
		return entry.Entry{}, false
	}
	if !ok {
		return entry.Entry{}, false
	}
	prev, err := entry.Decode(v, nil)
	if err != nil {
		h.stats.unreleasable.Add(1)
		return entry.Entry{}, false
	}
	return prev, true
}

// tooLarge counts a handle whose entry is over a size bound and logs it
// once, not on every turn.
func (h *handles) tooLarge(n int) Refusal {
	h.stats.tooLarge.Add(1)
	h.log.once(context.Background(), "too_large", "kvroute: a decode handle is too large to retain; raise WithMaxEntryBytes and the Store's value bound",
		slog.Int("bytes", n), slog.Int("limit", h.maxEntry))
	return RefuseHandleTooLarge
}

// storeFailed records a failed Store call; the turn goes on as a miss.
func (h *handles) storeFailed(ctx context.Context, op, requestID string, err error) {
	h.stats.storeErrors.Add(1)
	h.failed.Add(1)
	if h.down.Swap(true) {
		return
	}
	h.log.LogAttrs(ctx, slog.LevelWarn, "kvroute: store failing; turns go on as plain prefills (logged once until it answers again)",
		slog.String("op", op), slog.String("request_id", requestID), slog.String("err", err.Error()))
}

// storeOK records a Store call that succeeded, ending an outage.
func (h *handles) storeOK(ctx context.Context) {
	if !h.down.Load() || !h.down.Swap(false) {
		return
	}
	h.log.LogAttrs(ctx, slog.LevelInfo, "kvroute: store answering again",
		slog.Int64("failed_calls", h.failed.Swap(0)))
}

// keyLocks serializes the Router's writes under one key: a supersede and
// its Put (or put-back) run one at a time per key, so that of two turns of
// one conversation retaining at once, the second takes the first's handle
// and releases it rather than overwrite it. Keys not being written take no
// memory.
type keyLocks struct {
	mu sync.Mutex
	m  map[string]*keyLock
}

type keyLock struct {
	mu    sync.Mutex
	users int // holders and waiters, under keyLocks.mu
}

// lock locks key and returns its unlock.
func (l *keyLocks) lock(key string) func() {
	l.mu.Lock()
	if l.m == nil {
		l.m = map[string]*keyLock{}
	}
	k := l.m[key]
	if k == nil {
		k = &keyLock{}
		l.m[key] = k
	}
	k.users++
	l.mu.Unlock()
	k.mu.Lock()
	return func() {
		k.mu.Unlock()
		l.mu.Lock()
		if k.users--; k.users == 0 {
			delete(l.m, key)
		}
		l.mu.Unlock()
	}
}

// The kv_transfer_params member name.
const kvKey = kvhandle.Key

var (
	jsonTrue  = []byte("true")
	jsonFalse = []byte("false")
	jsonOne   = []byte("1")
)

var errStop = errors.New("stop")

// invalidHandle counts a handle checkHandle refused as invalid, in phase
// (PhasePrefill: P's handle; PhaseDecode: D's, not retained; PhaseLookup:
// a retained one, not attached), and logs it once per phase and member.
func (r *Router) invalidHandle(phase Phase, endpoint string, err error) {
	r.stats.invalidHandles.Add(1)
	r.log.once(context.Background(), "invalid_handle:"+string(phase)+":"+kvhandle.InvalidMember(err),
		"kvroute: a KV handle holds a value vLLM cannot read correctly; it is refused (see Stats.InvalidHandles)",
		slog.String("phase", string(phase)), slog.String("endpoint", endpoint), slog.String("err", err.Error()))
}

// Holds past their retention. The Store drops a retained entry at the
// retention TTL and no turn attaches one older, but the decode engine pins
// its blocks until its decoder_kv_blocks_ttl (30 s more by default). So
// the ledger counts a hold until the engine's TTL (budget.WithGrace), and
// with the management on the router releases it when its retention ends:
// every sweepInterval it takes the holds past it on each managed engine
// from the ledger (budget.Budget.Expired) and sends their release
// requests, as for holds over the budget (releaser.go), counted in
// Stats.ReleasedExpired. The Store keeps each entry linger past the
// retention TTL for that take (a turn that finds it then does not attach
// it: MissExpired). A hold the sweep does not release (an engine of
// unknown capacity) stays counted until the engine's TTL; one whose
// entry is gone from the Store (a turn or another router took it) is
// counted in Stats.ReleaseGone.

// sweepInterval is how often, in wall time, the holds past their
// retention are looked for.
const sweepInterval = time.Second

// sweep reads the capacity of the decode engines that have none
// configured, then releases the holds past their retention, every
// sweepInterval, until ctx ends.
func (m *decodeMemory) sweep(ctx context.Context) {
	tick := time.NewTicker(sweepInterval)
	defer tick.Stop()
	// At start, each decode engine's capacity is read (pressure.go:
	// capacityUnknown warns of one unknown), not at the first turn.
	for _, e := range m.rel.decode.list() {
		if m.ledger.Capacity(e.url) <= 0 {
			m.refresh(e, m.clock())
		}
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		now := m.clock()
		for _, e := range m.rel.decode.list() {
			if !m.managed(e.url) {
				continue
			}
			victims := m.rel.chosen.choose(func() []budget.Victim {
				var v []budget.Victim
				for _, h := range m.ledger.Expired(e.url, now) {
					v = append(v, budget.Victim{Held: h})
				}
				return v
			})
			if !m.rel.releaseAll(ctx, victims, releaseExpired) {
				return
			}
		}
		forgetLeft(m, now)
		syncLedger(ctx, m)
	}
}

// syncLedger syncs the ledger with the other processes' through its
// journal (DecodeMemory.Journal), every sweepInterval, within
// storeTimeout; a failure is logged once (the ledger counts each one).
// With the management off it runs alone (syncLoop).
func syncLedger(ctx context.Context, m *decodeMemory) {
	sctx, cancel := context.WithTimeout(ctx, storeTimeout)
	defer cancel()
	if err := m.ledger.Sync(sctx, m.clock()); err != nil && ctx.Err() == nil {
		m.log.once(ctx, "ledger_journal",
			"kvroute: the decode-memory ledger's journal failed; the router processes' ledgers drift apart until it is back (the ledger's Stats().Journal counts the failures)",
			slog.String("err", err.Error()))
	}
}

// syncLoop syncs the ledger every sweepInterval until ctx ends: the
// sweep does it with the management on.
func syncLoop(ctx context.Context, m *decodeMemory) {
	tick := time.NewTicker(sweepInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			syncLedger(ctx, m)
		}
	}
}

// forgetLeft drops from the ledger the decode engines that left the Router's
// pool (SetEndpoints) once they hold and run nothing, so that the ledger
// follows the engines in use (budget.Budget.Forget): every sweepInterval,
// and at each SetEndpoints of the decode phase (with the management off
// too).
func forgetLeft(m *decodeMemory, now time.Time) {
	m.ledger.Forget(now, func(engine string) bool { return m.rel.decode.find(engine) != nil })
}

// storeTTL is the Store's TTL of an entry with left of its retention.
func (m *decodeMemory) storeTTL(left time.Duration) time.Duration { return left + m.linger }

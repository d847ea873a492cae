package redisstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/bidikv/bidikv/retention/budget"
)

var _ budget.Journal = (*Journal)(nil)

// DefaultJournalWindow is how long a [Journal] keeps its records: 10
// minutes, more than the decode engine's TTL (vLLM's
// decoder_kv_blocks_ttl, 480 s), so that a router process that starts
// reads every hold that may still be live, and the returns and ends of
// the holds the window's records added.
const DefaultJournalWindow = 10 * time.Minute

// JournalKey is the key of the Journal's stream, after the Store's
// prefix ([WithPrefix]).
const JournalKey = "ledger-journal"

// Journal is a [budget.Journal] in Redis: the decode-memory ledgers of
// router processes that share a Store share their holds, capacities,
// running requests and learned pauses through it (budget.WithJournal;
// kvroute's DecodeMemory.Journal). It is a Redis stream beside the
// Store's entries, under its prefix ([JournalKey]): Append is a pipeline
// of XADD, one per record, each trimming the records older than the
// window (MINID, approximate: Redis drops whole nodes of the stream, so
// a little more than the window may stay); Read is an XRANGE after the
// cursor, a stream ID. The window is on Redis's clock (the IDs' times).
//
// Its memory is the records of a window: a turn appends an addition
// (about 150 bytes plus 8 per prefix position the ledger samples: about
// 600 bytes for a 25,000-token conversation in token verification) and a
// return or an end (about 70 bytes), and each process a report of its
// running requests about every 5 s; with Redis's per-entry overhead,
// about 1 KB a turn: 100 turns a second keep about 60 MB for the default
// window of 10 minutes.
//
// Every call is bounded by the Store's timeout ([WithTimeout]); a failure
// is returned (budget.Budget.Sync counts it) and counts in the Store's
// outages, as its Puts' and Takes' do: an outage of Redis is logged once
// when it starts and once when it ends, whichever calls fail in it. A
// call that fails because the caller's context ended is no outage. A
// Journal is safe for concurrent use.
type Journal struct {
	client  redis.UniversalClient
	key     string
	window  time.Duration
	timeout time.Duration
	health  *health // the Store's
	mu      sync.Mutex
	last    int64 // the newest ID's milliseconds seen (Redis's clock)
	errors  atomic.Int64
}

// Journal returns the store's [Journal], keeping window of records
// (0: [DefaultJournalWindow]; negative is invalid and panics, a
// programming error). It does no network I/O.
func (s *Store) Journal(window time.Duration) *Journal {
	if window < 0 {
		panic(fmt.Sprintf("redisstore: Journal(%v): the window must not be negative", window))
	}
	if window == 0 {
		window = DefaultJournalWindow
	}
	return &Journal{client: s.client, key: s.prefix + JournalKey, window: window, timeout: s.timeout, health: &s.health}
}

// Append adds records to the stream, trimming those older than the
// window.
func (j *Journal) Append(ctx context.Context, records [][]byte) error {
	if len(records) == 0 {
		return nil
	}
	cctx, cancel := context.WithTimeout(ctx, j.timeout)
	defer cancel()
	j.mu.Lock()
	minID := ""
	if j.last > 0 {
		minID = strconv.FormatInt(j.last-j.window.Milliseconds(), 10)
	}
	j.mu.Unlock()
	pipe := j.client.Pipeline()
	cmds := make([]*redis.StringCmd, len(records))
	for i, r := range records {
		cmds[i] = pipe.XAdd(cctx, &redis.XAddArgs{Stream: j.key, MinID: minID, Approx: minID != "", Values: []any{"e", r}})
	}
	if _, err := pipe.Exec(cctx); err != nil {
		return j.failed(ctx, "append", err)
	}
	j.seen(cmds[len(cmds)-1].Val())
	j.ok(ctx)
	return nil
}

// Read returns at most n records after cursor ("": from the oldest).
func (j *Journal) Read(ctx context.Context, cursor string, n int) ([][]byte, string, error) {
	cctx, cancel := context.WithTimeout(ctx, j.timeout)
	defer cancel()
	start := "-"
	if cursor != "" {
		start = "(" + cursor
	}
	msgs, err := j.client.XRangeN(cctx, j.key, start, "+", int64(max(n, 1))).Result()
	if err != nil {
		return nil, cursor, j.failed(ctx, "read", err)
	}
	j.ok(ctx)
	out := make([][]byte, 0, len(msgs))
	next := cursor
	for _, m := range msgs {
		next = m.ID
		if v, ok := m.Values["e"].(string); ok {
			out = append(out, []byte(v))
		} else {
			out = append(out, nil) // not a record: the ledger counts it invalid
		}
	}
	if len(msgs) > 0 {
		j.seen(next)
	}
	return out, next, nil
}

// Len returns the records the stream keeps (XLEN).
func (j *Journal) Len(ctx context.Context) (int64, error) {
	cctx, cancel := context.WithTimeout(ctx, j.timeout)
	defer cancel()
	return j.client.XLen(cctx, j.key).Result()
}

// Errors counts the calls that failed.
func (j *Journal) Errors() int64 { return j.errors.Load() }

// seen records a stream ID's time, the newest so far: the trim's clock.
func (j *Journal) seen(id string) {
	ms, _, _ := strings.Cut(id, "-")
	t, err := strconv.ParseInt(ms, 10, 64)
	if err != nil {
		return
	}
	j.mu.Lock()
	j.last = max(j.last, t)
	j.mu.Unlock()
}

// failed counts and wraps a failed call; one that failed because ctx
// ended (the caller stopping) is no outage.
func (j *Journal) failed(ctx context.Context, op string, err error) error {
	j.errors.Add(1)
	if ctx.Err() == nil {
		j.health.fail(ctx, "journal "+op, err)
	}
	if errors.Is(err, redis.Nil) {
		return err
	}
	return fmt.Errorf("redisstore: journal %s: %w", op, err)
}

func (j *Journal) ok(ctx context.Context) { j.health.ok(ctx) }

package kvroute_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/retention"
)

// clockStore is a retention.Memory whose entries expire on a virtual
// clock: a Take at or after an entry's Put time plus its ttl misses, as a
// Redis store's would.
type clockStore struct {
	kvroute.Store
	clk   *kvroutetest.VirtualClock
	mu    sync.Mutex
	until map[string]time.Time
}

func newClockStore(t *testing.T, clk *kvroutetest.VirtualClock) *clockStore {
	m, err := retention.NewMemory()
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close() })
	return &clockStore{Store: m, clk: clk, until: map[string]time.Time{}}
}

func (s *clockStore) Put(ctx context.Context, key string, value []byte, ttl time.Duration) error {
	s.mu.Lock()
	s.until[key] = s.clk.Now().Add(ttl)
	s.mu.Unlock()
	return s.Store.Put(ctx, key, value, ttl)
}

func (s *clockStore) Take(ctx context.Context, key string) ([]byte, bool, error) {
	v, ok, err := s.Store.Take(ctx, key)
	s.mu.Lock()
	defer s.mu.Unlock()
	if ok && !s.clk.Now().Before(s.until[key]) {
		return nil, false, nil
	}
	return v, ok, err
}

// ledgerHeld is what r's ledger counts on its one decode engine, in tokens.
func ledgerHeld(r *kvroute.Router) int64 {
	var n int64
	for _, d := range r.DecodeKV() {
		n += d.HeldTokens
	}
	return n
}

// A retained handle's retention TTL (450 s) ends 30 s before D frees its
// blocks by itself (decoder_kv_blocks_ttl, 480 s). With the engine's
// capacity known, the router releases the hold when its retention ends
// (one release request, D frees it then, not at its TTL) and the ledger
// stops counting it then; with the capacity unknown nothing is released,
// and the ledger counts the hold as long as D pins it. Either way the
// ledger's usage is what D holds.
func TestHoldReleasedWhenRetentionEnds(t *testing.T) {
	ttls := kvroute.Defaults().TTLs
	t.Run("managed", func(t *testing.T) {
		clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
		st := newClockStore(t, clk)
		c, r, srv, front := memoryRig(t, "", 1, []kvroutetest.Option{kvroutetest.WithClock(clk)}, kvroute.WithStore(st), kvroute.WithClock(clk.Now))
		d := c.Decode[0]
		conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
		conv.say(userText(1))
		conv.hear(releaseTurn(t, srv, conv.path, conv.body(), nil))
		knowCapacity(t, r)
		held := d.Stats()
		require.Positive(t, held.UsedBlocks, "D holds turn 1's blocks")
		require.EqualValues(t, held.UsedBlocks*16, ledgerHeld(r), "the ledger counts what D holds")

		clk.Advance(ttls.Retention - time.Second)
		time.Sleep(2 * time.Second) // sweeps run: nothing is due yet
		assert.Zero(t, front.releases.Load(), "nothing released within the retention TTL")
		assert.Equal(t, held.UsedBlocks, d.Stats().UsedBlocks)

		clk.Advance(2 * time.Second) // the retention TTL ended; D's TTL is 29 s away
		for i := 0; i < 5000 && (d.Stats().UsedBlocks > 0 || r.Stats().ReleasedExpired == 0); i++ {
			time.Sleep(time.Millisecond) // the release request's answer is counted after D freed the hold
		}
		after := d.Stats()
		assert.Zero(t, after.UsedBlocks, "D freed the hold when its retention ended")
		assert.Equal(t, held.NotifiedHolds+1, after.NotifiedHolds, "by a release request")
		assert.Zero(t, after.TTLBlocks, "nothing lapsed at D's TTL")
		assert.EqualValues(t, 1, front.releases.Load())
		assert.Zero(t, ledgerHeld(r), "the ledger counts what D holds")
		s := r.Stats()
		assert.EqualValues(t, 1, s.ReleasedExpired)
		assert.Zero(t, s.ReleaseFailures+s.ReleaseGone)

		// The conversation's next turn misses (its handle was released)
		// and is answered right.
		conv.say(userText(2))
		releaseTurn(t, srv, conv.path, conv.body(), nil)
		assert.Zero(t, d.Stats().WrongOutputs)
	})
	t.Run("capacity unknown", func(t *testing.T) {
		clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
		st := newClockStore(t, clk)
		c, r, srv, front := memoryRig(t, "", 1, []kvroutetest.Option{kvroutetest.WithClock(clk)}, kvroute.WithStore(st), kvroute.WithClock(clk.Now),
			kvroute.WithDecodeMemory(kvroute.DecodeMemory{Budget: 0.5, MetricsInterval: -1}))
		d := c.Decode[0]
		conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
		conv.say(userText(1))
		conv.hear(releaseTurn(t, srv, conv.path, conv.body(), nil))
		held := d.Stats()
		require.Positive(t, held.UsedBlocks)
		clk.Advance(ttls.Retention + time.Second)
		time.Sleep(2 * time.Second) // sweeps run: the engine is not managed
		assert.Zero(t, front.releases.Load(), "nothing released on an engine of unknown capacity")
		assert.Equal(t, held.UsedBlocks, d.Stats().UsedBlocks, "D still pins the hold")
		assert.EqualValues(t, held.UsedBlocks*16, ledgerHeld(r), "the ledger counts it until D's TTL")
		clk.Advance(ttls.DecoderBlocks - ttls.Retention)
		assert.Zero(t, d.Stats().UsedBlocks, "D freed it at its TTL")
		assert.Zero(t, ledgerHeld(r), "and the ledger stopped counting it")
	})
}

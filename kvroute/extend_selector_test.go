package kvroute_test

import (
	"context"
	"net/http"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// Extension example: a selection policy is one file (this one) and one
// registration line (WithSelector). firstFit fills the engines in their
// configuration order: a leg goes to the first candidate with fewer than
// limit requests in flight (the decode engine that holds the
// conversation's KV first), else to the least loaded one. It keeps small
// deployments on few engines.
func firstFit(limit int) kvroute.Selector {
	return kvroute.SelectorFunc(func(_ context.Context, s *kvroute.Selection) (int, error) {
		for i, c := range s.Candidates {
			if c.URL == s.Affinity && c.InFlight < limit {
				return i, nil
			}
		}
		best := 0
		for i, c := range s.Candidates {
			if c.InFlight < limit {
				return i, nil
			}
			if c.InFlight < s.Candidates[best].InFlight {
				best = i
			}
		}
		return best, nil
	})
}

func TestExtendSelector(t *testing.T) {
	c := kvroutetest.NewCluster(t, 3, 3)
	rec := &kvroutetest.Records{}
	url := serve(t, newRouter(t, c, kvroute.WithSelector(firstFit(4)), kvroute.WithObserver(rec))) // the registration line
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 8}
	for i := range 4 {
		conv.say(userText(i))
		res := post(t, url, conv.path, conv.body(), nil)
		require.Equal(t, http.StatusOK, res.status)
		conv.hear(res.text)
		// One turn at a time: every leg fits the first engine.
		assert.Equal(t, c.Prefill[0].URL(), rec.Last().PrefillEndpoint, "turn %d", i)
		assert.Equal(t, c.Decode[0].URL(), rec.Last().DecodeEndpoint, "turn %d", i)
	}
	assert.Empty(t, c.Prefill[1].Requests(), "the other engines stay idle")
	assert.Empty(t, c.Decode[2].Requests())
}

// heldSeen is a Selector that records what the decode candidates showed of
// the Router's holds, and then chooses as LeastLoaded does.
type heldSeen struct {
	kvroute.LeastLoaded
	mu   sync.Mutex
	seen map[string][2]int64 // URL: HeldTokens, BudgetTokens
}

func (h *heldSeen) Select(ctx context.Context, s *kvroute.Selection) (int, error) {
	if s.Phase == kvroute.PhaseDecode {
		h.mu.Lock()
		for _, c := range s.Candidates {
			h.seen[c.URL] = [2]int64{c.HeldTokens, c.BudgetTokens}
		}
		h.mu.Unlock()
	}
	return h.LeastLoaded.Select(ctx, s)
}

// A Selector sees each decode candidate's held tokens and budget as the
// Router's ledger has them (Router.DecodeKV): it needs no ledger of its
// own.
func TestSelectorSeesHeldTokens(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 2)
	sel := &heldSeen{seen: map[string][2]int64{}}
	r := newRouter(t, c, kvroute.WithSelector(sel),
		kvroute.WithDecodeMemory(kvroute.DecodeMemory{Capacity: 1_000_000, MetricsInterval: -1}))
	url := serve(t, r)
	for i := range 3 {
		conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 8, messages: []message{{Role: "system", Content: systemPrompt}}}
		conv.say(userText(i))
		before := r.DecodeKV()
		res := post(t, url, conv.path, conv.body(), nil)
		require.Equal(t, http.StatusOK, res.status)
		sel.mu.Lock()
		for _, kv := range before {
			assert.Equal(t, [2]int64{kv.HeldTokens, kv.Budget}, sel.seen[kv.Endpoint], "turn %d, %s", i, kv.Endpoint)
			if kv.HeldTokens > 0 {
				assert.Equal(t, int64(900_000), kv.Budget, "the Router's Budget (0.9) of Capacity")
			}
		}
		sel.mu.Unlock()
	}
	var held int64
	for _, kv := range r.DecodeKV() {
		held += kv.HeldTokens
	}
	assert.Positive(t, held)
}

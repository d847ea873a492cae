package kvroute_test

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/retention/budget"
)

// preferP sends a prefill leg without affinity to the prefill engine set
// in want (else, and for every decode leg and prefill leg with affinity,
// LeastLoaded decides), and records each prefill leg's affinity.
type preferP struct {
	mu       sync.Mutex
	want     string
	affinity []string
	ll       kvroute.LeastLoaded
}

func (p *preferP) Select(ctx context.Context, s *kvroute.Selection) (int, error) {
	if s.Phase == kvroute.PhasePrefill {
		p.mu.Lock()
		p.affinity = append(p.affinity, s.Affinity)
		want := p.want
		p.mu.Unlock()
		if s.Affinity == "" {
			if i := slices.IndexFunc(s.Candidates, func(c kvroute.Candidate) bool { return c.URL == want }); i >= 0 {
				return i, nil
			}
		}
	}
	return p.ll.Select(ctx, s)
}

func (p *preferP) prefer(url string) {
	p.mu.Lock()
	p.want = url
	p.mu.Unlock()
}

// A turn whose hold the decode memory management released is prefilled on
// the engine that prefilled the turn before (whose prefix cache holds that
// prompt), not wherever load would send it, also through another router
// replica sharing the ledger: the release then costs the turn the reply's
// tokens, not its history.
func TestReleasedHoldsNextTurnPrefilledWhereItsHistoryIs(t *testing.T) {
	clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
	c := kvroutetest.NewCluster(t, 2, 1, kvroutetest.WithStreamHandles(true), kvroutetest.WithClock(clk))
	ledger, err := budget.New()
	require.NoError(t, err)
	// A budget no hold fits: each is released as soon as it is retained.
	mem := kvroute.DecodeMemory{Budget: 0.0002, Ledger: ledger}
	sel := &preferP{}
	store := newClockStore(t, clk)
	rec := &kvroutetest.Records{}
	var urls []string
	for range 2 {
		r := newRouter(t, c, kvroute.WithStore(store), kvroute.WithDecodeMemory(mem), kvroute.WithSelector(sel), kvroute.WithObserver(rec))
		urls = append(urls, serve(t, r))
		warm := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: "warm-up. " + systemPrompt}}}
		warm.say(userText(0))
		releaseTurn(t, urls[len(urls)-1], warm.path, warm.body(), nil)
		knowCapacity(t, r)
	}
	p0, p1 := c.Prefill[0].URL(), c.Prefill[1].URL()

	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
	sel.prefer(p1)
	conv.say(userText(1))
	conv.hear(releaseTurn(t, urls[0], conv.path, conv.body(), nil))
	first := rec.Last()
	require.Equal(t, p1, first.PrefillEndpoint)
	// its hold is over the budget: released
	for range 5000 {
		if ledger.Stats().Released > 0 && ledger.Stats().Holds == 0 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	require.Zero(t, ledger.Stats().Holds, "the hold was released")

	sel.prefer(p0) // where load would send the next turn
	conv.say(userText(2))
	conv.hear(releaseTurn(t, urls[1], conv.path, conv.body(), nil))
	next := rec.Last()
	assert.Equal(t, kvroute.ReuseMiss, next.Reuse)
	assert.Equal(t, p1, next.PrefillEndpoint, "prefilled where the turn before was, through the other replica")
	sel.mu.Lock()
	assert.Equal(t, p1, sel.affinity[len(sel.affinity)-1])
	sel.mu.Unlock()
	cached := 0
	for _, r := range c.Prefill[1].FinishedRequests(next.EngineRequestID) {
		cached += r.CachedTokens
	}
	assert.Positive(t, cached, "P's prefix cache served the history")
}

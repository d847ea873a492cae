package kvroute_test

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// placement is what one run of conversations over 4P4D measured.
type placement struct {
	movedPerTurn     float64 // tokens moved P→D per later turn
	ttftP50, ttftP99 time.Duration
}

// runPlacement runs convs conversations of turns turns, interleaved, on a
// 4P4D cluster with the qwen3-32b profile on a virtual clock, and measures
// the later turns (2..turns) from the engines' request records.
func runPlacement(t *testing.T, sel kvroute.Selector, convs, turns int) placement {
	prof, ok := kvroutetest.LookupProfile("qwen3-32b")
	require.True(t, ok)
	clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
	c := kvroutetest.NewCluster(t, 4, 4, kvroutetest.WithProfile(prof), kvroutetest.WithClock(clk))
	r := newRouter(t, c, kvroute.WithSelector(sel))
	url := serve(t, r)
	cs := make([]*conversation, convs)
	for k := range cs {
		cs[k] = &conversation{path: kvroute.PathChatCompletions, maxTok: 64, messages: []message{{Role: "system", Content: fmt.Sprintf("Conversation %d. %s", k, systemPrompt)}}}
	}
	later := map[string]bool{}
	for i := 1; i <= turns; i++ {
		for k, conv := range cs {
			conv.say(userText(i))
			id := fmt.Sprintf("c%d-t%d", k, i)
			res := post(t, url, conv.path, conv.body(), http.Header{"X-Request-Id": {id}})
			require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
			require.Equal(t, reference(t, conv.path, conv.body()), res.text)
			conv.hear(res.text)
			later[id] = i > 1
		}
	}
	ttft := map[string]time.Duration{}
	moved, n := 0, 0
	for _, e := range append(append([]*kvroutetest.Engine(nil), c.Prefill...), c.Decode...) {
		assert.Zero(t, e.Stats().FreedReads)
		assert.Zero(t, e.Stats().ExpiredReads)
		for _, rec := range e.Requests() {
			// The engines saw the client's id with the router's suffix.
			id := rec.RequestID[:max(0, strings.LastIndexByte(rec.RequestID, '-'))]
			if !later[id] || rec.Status != http.StatusOK {
				continue
			}
			ttft[id] += rec.Transfer + rec.Prefill
			if rec.Role == "decode" {
				moved += rec.PulledTokens
				n++
			}
		}
	}
	require.Equal(t, convs*(turns-1), n)
	var all []time.Duration
	for _, d := range ttft {
		all = append(all, d)
	}
	slices.Sort(all)
	pct := func(p float64) time.Duration { return all[min(len(all)-1, int(p*float64(len(all))))] }
	return placement{movedPerTurn: float64(moved) / float64(n), ttftP50: pct(0.50), ttftP99: pct(0.99)}
}

// TestDecodeAffinityMeasured compares decode affinity with round-robin on
// 4P4D: with affinity the decode engine's own prefix cache covers the
// history, so only the new suffix crosses from P to D.
func TestDecodeAffinityMeasured(t *testing.T) {
	const convs, turns = 7, 10 // 7: round-robin must not line up with 4 engines
	aff := runPlacement(t, &kvroute.LeastLoaded{MaxInFlight: 64}, convs, turns)
	rr := runPlacement(t, &kvroutetest.RoundRobin{}, convs, turns)
	t.Logf("4P4D qwen3-32b, %d conversations x %d turns, later turns only:", convs, turns)
	t.Logf("  affinity:    %.1f tokens P->D per turn, modelled TTFT p50 %v p99 %v", aff.movedPerTurn, aff.ttftP50, aff.ttftP99)
	t.Logf("  round-robin: %.1f tokens P->D per turn, modelled TTFT p50 %v p99 %v", rr.movedPerTurn, rr.ttftP50, rr.ttftP99)
	t.Logf("  ratio round-robin/affinity: tokens %.1fx, TTFT p50 %.2fx, p99 %.2fx", rr.movedPerTurn/aff.movedPerTurn,
		float64(rr.ttftP50)/float64(aff.ttftP50), float64(rr.ttftP99)/float64(aff.ttftP99))
	assert.Less(t, aff.movedPerTurn*2, rr.movedPerTurn, "affinity should move far fewer tokens")
	assert.LessOrEqual(t, aff.ttftP50, rr.ttftP50)
}

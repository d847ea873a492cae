package main

import (
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// The bound on a hand-made engine: two holds of 80 tokens over the same
// minute with 100 tokens free can keep one whole (worth 80) and a quarter
// of the other (worth 15 of its 60): the relaxation's optimum is 95, and
// the bound is at least that and at most what both are worth; the
// feasible schedule keeps the more valuable one. Running legs take their
// room: with a leg of 30 tokens over the minute, 70 are free, no hold
// fits whole and the optimum is 70 of the first's value.
func TestEngineBound(t *testing.T) {
	items := []boundItem{{start: 10, end: 70, size: 80, value: 80}, {start: 10, end: 70, size: 80, value: 60}}
	bound, schedule := engineBound(items, nil, 100)
	assert.Equal(t, 80.0, schedule)
	assert.GreaterOrEqual(t, bound, 95.0-1e-6)
	assert.Less(t, bound, 100.0, "the subgradient steps bring it near the optimum")
	bound, schedule = engineBound(items, []boundLeg{{start: 0, end: 80, size: 30}}, 100)
	assert.Zero(t, schedule)
	assert.GreaterOrEqual(t, bound, 70.0-1e-6)
	assert.Less(t, bound, 80.0)
	// holds in sequence do not compete: both fit
	items[1].start, items[1].end = 80, 140
	bound, schedule = engineBound(items, nil, 100)
	assert.Equal(t, 140.0, schedule)
	assert.InDelta(t, 140.0, bound, 1e-6)
}

// The bound on recorded turns: a hold is worth the next turn's prompt
// tokens it covers beyond P's prefix cache hit (or the pull, if more),
// nothing when the next turn comes after the retention TTL; it is held
// from the answer to the next turn's send on the engine that decoded it;
// the common system prompt's blocks are free.
func TestOfflineBoundItems(t *testing.T) {
	plan := []sessionPlan{{shared: true}, {}}
	turn := func(s, k int, sent, answered time.Duration, reused, cached int) fleetTurn {
		return fleetTurn{session: s, turn: k, sent: sent, answered: answered, reused: reused, cached: cached, decode: 0,
			decodeTime: time.Second, prompt: 10500, dPrompt: 10000, dCompletion: 200}
	}
	arm := armResult{turns: []fleetTurn{turn(0, 0, 0, 2*time.Second, 0, 0), turn(0, 1, 30*time.Second, 32*time.Second, 0, 5200),
		turn(1, 0, 0, 2*time.Second, 0, 0), turn(1, 1, 30*time.Second, 32*time.Second, 9000, 0),
		turn(1, 2, 600*time.Second, 602*time.Second, 0, 0)}}
	b := offlineBound(arm, plan, 1<<20, 450*time.Second)
	assert.Equal(t, 2, b.holds, "the third turn came after the TTL")
	assert.Equal(t, int64(5000+10200), b.reusable)
	assert.Equal(t, b.reusable, b.schedule, "everything fits")
	assert.InDelta(t, b.reusable, b.bound, 1)
	// room for the private hold (10,192 tokens less its last block) but
	// not for both: the shared session's costs 4,176 tokens less
	b = offlineBound(arm, plan, 16000, 450*time.Second)
	assert.Less(t, b.bound, b.reusable)
	assert.GreaterOrEqual(t, b.bound, int64(9000))
}

// The plan's world: about the asked share of sessions share the common
// system prompt, verbatim; a tool call is always answered (a session ends
// after a call only at its last planned turn, sent with tool_choice none).
func TestPlanWorld(t *testing.T) {
	plan := planFleet(1, 400, time.Minute, 40, 120000, 0.5)
	shared := 0
	for _, sp := range plan {
		last := len(sp.turns) - 1
		for k := range sp.turns {
			assert.Equal(t, k == last, sp.ends(k, true), "a call ends the session only at its last turn")
			assert.Equal(t, k == last, toolChoice(k, len(sp.turns)) == "none")
		}
		if sp.shared {
			shared++
			assert.Equal(t, sharedSystemTokens, sp.system)
		}
	}
	assert.InDelta(t, 200, shared, 30)
	a, b := newSession(1, sessionPlan{id: 1, shared: true}), newSession(1, sessionPlan{id: 2, shared: true})
	assert.Equal(t, a.messages[0], b.messages[0], "one common system prompt")
	assert.NotEqual(t, a.messages[0], newSession(1, sessionPlan{id: 1, system: 100}).messages[0])
}

// --quick sizes a small fleet; a flag given explicitly wins.
func TestQuickFlags(t *testing.T) {
	c, err := parseFleetFlags([]string{"--fleet", "--quick", "--sessions", "5"}, io.Discard)
	assert.NoError(t, err)
	assert.Equal(t, 5, c.sessions)
	assert.Equal(t, 2*time.Minute, c.window)
	assert.Equal(t, 1, c.prefill)
	assert.Equal(t, 4, c.replicas)
	assert.True(t, c.spread)
	assert.False(t, c.perReplica, "one ledger for every replica")
	c, err = parseFleetFlags([]string{"--fleet", "--ledger", "per-replica"}, io.Discard)
	assert.NoError(t, err)
	assert.True(t, c.perReplica)
	_, err = parseFleetFlags([]string{"--fleet", "--ledger", "redis"}, io.Discard)
	assert.ErrorContains(t, err, "want shared or per-replica")
	_, err = parseFleetFlags([]string{"--fleet", "--replica-routing", "sticky"}, io.Discard)
	assert.ErrorContains(t, err, "want spread or pinned")
}

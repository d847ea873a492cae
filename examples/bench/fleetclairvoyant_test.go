package main

import (
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/retention/budget"
)

// The clairvoyant value: the sooner a hold's next turn comes, the more it
// is worth; a hold whose session ends, whose next turn comes after it
// expires, or whose key the recorder never saw is worth nothing.
func TestClairvoyantValue(t *testing.T) {
	two := func(tool, human time.Duration) sessionPlan {
		return sessionPlan{turns: []turnPlan{{toolPause: tool, humanPause: human}, {}}}
	}
	cv := &clairvoyant{plan: []sessionPlan{two(5*time.Second, 600*time.Second), two(time.Second, 200*time.Second),
		two(time.Second, 600*time.Second), {turns: []turnPlan{{}}}}}
	created := fleetEpoch
	held := func(key string) budget.Held {
		return budget.Held{Key: key, Tokens: 1000, Blocks: 63, Created: created, Expires: created.Add(480 * time.Second)}
	}
	for id, key := range []string{"k0", "k1", "k2", "k3"} {
		cv.keys.Store(key, id)
	}
	cv.turn(0, 0, true)  // a tool call: its result after 5 s
	cv.turn(1, 0, false) // text: a person answers after 200 s
	cv.turn(2, 0, false) // after the hold expires
	cv.turn(3, 0, true)  // the session's last turn
	soon, later := cv.value(held("k0"), time.Second, 0.5), cv.value(held("k1"), time.Second, 0.5)
	assert.Greater(t, soon, later)
	assert.Positive(t, later)
	assert.Zero(t, cv.value(held("k2"), time.Second, 0.5))
	assert.Zero(t, cv.value(held("k3"), time.Second, 0.5))
	assert.Zero(t, cv.value(held("unknown"), time.Second, 0.5))
	assert.Greater(t, cv.value(held("k1"), 190*time.Second, 0.5), later, "closer to its next turn, worth more")
}

// keyRecorder notes the session of the key the router's Identifier
// retains under, from the turn's X-Request-Id, and the pause after the
// turn as its reply decides it (a tool call: the tool's), and changes
// nothing else.
func TestKeyRecorder(t *testing.T) {
	plan := make([]sessionPlan, 43)
	plan[42].turns = make([]turnPlan, 5)
	plan[42].turns[3] = turnPlan{toolPause: 7 * time.Second, humanPause: 90 * time.Second}
	cv := &clairvoyant{plan: plan}
	k := keyRecorder{Identifier: stubIdentifier{key: "key-1"}, cv: cv}
	req := &kvroute.Request{Header: http.Header{"X-Request-Id": {"s0042-t03"}}}
	for _, tc := range []struct {
		reply *kvroute.Reply
		pause time.Duration
	}{
		{&kvroute.Reply{Content: "ok", FinishReason: "stop"}, 90 * time.Second},
		{&kvroute.Reply{ToolCalls: []byte(`[{"id":"c","type":"function","function":{"name":"run","arguments":"{}"}}]`), FinishReason: "tool_calls"}, 7 * time.Second},
	} {
		ret, err := k.Key(req, kvroute.Candidates{}, tc.reply)
		require.NoError(t, err)
		assert.Equal(t, "key-1", ret.Key)
		id, ok := cv.keys.Load("key-1")
		require.True(t, ok)
		assert.Equal(t, 42, id)
		p, ok := cv.pause.Load(42)
		require.True(t, ok)
		assert.Equal(t, tc.pause, p)
	}
}

type stubIdentifier struct {
	kvroute.Identifier
	key string
}

func (s stubIdentifier) Key(*kvroute.Request, kvroute.Candidates, *kvroute.Reply) (kvroute.Retention, error) {
	return kvroute.Retention{Key: s.key}, nil
}

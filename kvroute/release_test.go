package kvroute_test

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/threshold"
)

// recomputeChooser chooses to recompute every verified turn (the cost
// model's PathRecompute).
type recomputeChooser struct{}

func (recomputeChooser) Reuse(threshold.Input) bool { return true }
func (recomputeChooser) Choose(threshold.Turn) threshold.Choice {
	return threshold.Choice{Path: threshold.PathRecompute}
}

// releaseCase is a second turn that takes the first turn's handle and
// cannot attach it, so that the handle is dead once the turn retains its
// own: the turn's prefill leg must release D's hold at that moment.
type releaseCase struct {
	name string
	opts []kvroute.Option
	// header is sent with both turns.
	header http.Header
	// first and second build the turns' bodies; second gets the first
	// turn's reply.
	first  func() *conversation
	second func(c *conversation, reply string) []byte
	// wait is how long passes between the turns.
	wait time.Duration
	miss kvroute.MissReason
	// reason picks the Stats counter of the release.
	reason func(kvroute.Stats) int64
}

func releaseCases() []releaseCase {
	session := http.Header{"Authorization": {"Bearer key-a"}, "X-Session-Id": {"c1"}}
	byID := []kvroute.Option{kvroute.WithIdentifier(kvroute.ContinuationKeys{ByConversationID: true}),
		kvroute.WithVerification(kvroute.Verification{Mode: kvroute.VerifyContent})}
	chat := func(system string) func() *conversation {
		return func() *conversation {
			c := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: system}}}
			c.say(userText(1))
			return c
		}
	}
	completion := func(prompt string) func() *conversation {
		return func() *conversation {
			c := &conversation{path: kvroute.PathCompletions, maxTok: 16, prompt: prompt}
			c.say(userText(1))
			return c
		}
	}
	// another: a different prompt under the same conversation id.
	another := func(system string) func(*conversation, string) []byte {
		return func(c *conversation, _ string) []byte {
			if c.path == kvroute.PathCompletions {
				d := &conversation{path: c.path, maxTok: c.maxTok, prompt: system}
				d.say(userText(2))
				return d.body()
			}
			d := &conversation{path: c.path, maxTok: c.maxTok, messages: []message{{Role: "system", Content: system}}}
			d.say(userText(2))
			return d.body()
		}
	}
	// compacted: the same short system prompt, the history replaced by
	// a summary (the verified prefix is below the threshold).
	compacted := func(c *conversation, _ string) []byte {
		d := &conversation{path: c.path, maxTok: c.maxTok, messages: []message{c.messages[0],
			{Role: "user", Content: "Summary of our conversation so far: " + strings.Repeat("we discussed the build. ", 12)}}}
		return d.body()
	}
	continued := func(c *conversation, reply string) []byte {
		c.hear(reply)
		c.say(userText(2))
		return c.body()
	}
	// edited: the conversation's earlier user message edited, a new
	// question after the reply.
	edited := func(c *conversation, reply string) []byte {
		c.hear(reply)
		c.messages[1].Content = "Edited: " + userText(9)
		c.say(userText(2))
		return c.body()
	}
	tokensByID := []kvroute.Option{kvroute.WithIdentifier(kvroute.ContinuationKeys{ByConversationID: true})}
	superseded := func(s kvroute.Stats) int64 { return s.ReleasedSuperseded }
	return []releaseCase{
		{name: "conversation id, another prompt (chat)", opts: byID, header: session, first: chat(systemPrompt),
			second: another(otherPrompt), miss: kvroute.MissMismatch, reason: superseded},
		{name: "conversation id, compacted history", opts: byID, header: session, first: chat("Be terse."),
			second: compacted, miss: kvroute.MissMismatch, reason: superseded},
		{name: "conversation id, earlier message edited (tokens)", opts: tokensByID, header: session, first: chat("Be terse."),
			second: edited, miss: kvroute.MissThreshold, reason: superseded},
		{name: "session hint, earlier message edited, below the threshold", opts: []kvroute.Option{kvroute.WithThreshold(4096)},
			header: session, first: chat(systemPrompt), second: edited, miss: kvroute.MissThreshold, reason: superseded},
		{name: "verified prefix below the threshold", opts: []kvroute.Option{kvroute.WithThreshold(4096)},
			first: chat(systemPrompt), second: continued, miss: kvroute.MissThreshold, reason: superseded},
		{name: "verified prefix below the threshold (completions)", opts: []kvroute.Option{kvroute.WithThreshold(4096)},
			first: completion(systemPrompt), second: continued, miss: kvroute.MissThreshold, reason: superseded},
		{name: "cost model recomputes", opts: []kvroute.Option{kvroute.WithDecodeMemory(kvroute.DecodeMemory{Local: true}),
			kvroute.WithThresholdPolicy(recomputeChooser{})}, first: chat(systemPrompt), second: continued,
			miss: kvroute.MissCostModel, reason: superseded},
		{name: "past the retention TTL, still held", opts: []kvroute.Option{kvroute.WithTTLs(kvroute.TTLs{Retention: time.Minute})},
			first: chat(systemPrompt), second: continued, wait: 2 * time.Minute, miss: kvroute.MissExpired,
			reason: func(s kvroute.Stats) int64 { return s.ReleasedUnusable }},
	}
}

// Issue 23.1: every handle a turn takes and does not attach, and which
// the turn's own handle replaces, is released through the turn's prefill
// leg: D frees the hold at that moment (the simulator's notification
// counters), not at its TTL; the answer is a single engine's, and no
// request is added.
func TestReleaseThroughPrefillLeg(t *testing.T) {
	for _, tc := range releaseCases() {
		t.Run(tc.name, func(t *testing.T) {
			clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
			c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true), kvroutetest.WithClock(clk))
			rec := &kvroutetest.Records{}
			r := newRouter(t, c, append([]kvroute.Option{kvroute.WithObserver(rec)}, tc.opts...)...)
			url := serve(t, r)
			d, p := c.Decode[0], c.Prefill[0]
			conv := tc.first()
			reply := releaseTurn(t, url, conv.path, conv.body(), tc.header)
			require.True(t, rec.Last().Stored, "turn 1 retained nothing: %s", rec.Last().StoreRefusal)
			knowCapacity(t, r)
			held := d.Stats()
			require.Positive(t, held.UsedBlocks, "D holds turn 1's blocks")
			pBefore := len(roleRecords(p, "prefill"))
			clk.Advance(tc.wait)

			releaseTurn(t, url, conv.path, tc.second(conv, reply), tc.header)
			tr := rec.Last()
			assert.Equal(t, tc.miss, tr.MissReason)
			assert.True(t, tr.Released, "the turn released the hold it replaced")
			assert.True(t, tr.Stored)
			assert.Equal(t, 1, tr.PrefillAttempts, "no request added")
			assert.Len(t, roleRecords(p, "prefill"), pBefore+1, "no request added")
			after := d.Stats()
			assert.Equal(t, held.NotifiedHolds+1, after.NotifiedHolds, "D freed the hold when the turn's prefill leg ran")
			assert.Equal(t, held.UsedBlocks, after.NotifiedBlocks-held.NotifiedBlocks, "all of turn 1's blocks")
			assert.Zero(t, after.TTLBlocks, "nothing lapsed at the TTL")
			s := r.Stats()
			assert.EqualValues(t, 1, tc.reason(s))
			assert.Zero(t, s.ReleaseFailures)
			assert.Zero(t, after.WrongOutputs)
		})
	}
}

// knowCapacity waits, boundedly, until r has read every decode engine's KV
// capacity from its /metrics (in the background, after the first turn
// that considered it): the management applies from then on.
func knowCapacity(t *testing.T, r *kvroute.Router) {
	t.Helper()
	for range 5000 {
		known := true
		for _, d := range r.DecodeKV() {
			known = known && d.Capacity > 0
		}
		if known {
			return
		}
		time.Sleep(time.Millisecond)
	}
	t.Fatal("the decode engines' capacity was never read")
}

// releaseTurn sends one turn, checks its answer against a single engine's
// and returns it.
func releaseTurn(t *testing.T, url, path string, body []byte, header http.Header) string {
	t.Helper()
	res := post(t, url, path, body, header)
	require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
	want, err := kvroutetest.Reference(path, body)
	require.NoError(t, err)
	assert.Equal(t, want.Text, res.text, "the answer differs from a single engine's")
	return res.text
}

// A release rides on the first prefill attempt only and never fails the
// turn: when that attempt fails, the leg goes on as a plain miss (at once
// on another engine for a failure only the handle could explain, a 500;
// by the retry policy for one a miss meets too, a 503), the failure is
// counted, and D's hold lapses at its TTL.
func TestReleaseFailureLapsesAtTTL(t *testing.T) {
	for _, status := range []int{http.StatusInternalServerError, http.StatusServiceUnavailable} {
		t.Run(http.StatusText(status), func(t *testing.T) {
			clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
			c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true), kvroutetest.WithClock(clk))
			rec := &kvroutetest.Records{}
			r := newRouter(t, c, kvroute.WithObserver(rec), kvroute.WithThreshold(4096))
			url := serve(t, r)
			d := c.Decode[0]
			conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
			conv.say(userText(1))
			reply := releaseTurn(t, url, conv.path, conv.body(), nil)
			knowCapacity(t, r)
			held := d.Stats()
			for _, p := range c.Prefill {
				p.FailNext(1, status)
			}
			conv.hear(reply)
			conv.say(userText(2))
			releaseTurn(t, url, conv.path, conv.body(), nil)
			tr := rec.Last()
			assert.False(t, tr.Released)
			assert.Equal(t, 2, tr.PrefillAttempts)
			assert.True(t, tr.Stored)
			s := r.Stats()
			assert.EqualValues(t, 1, s.ReleaseFailures)
			assert.Zero(t, s.ReleasedSuperseded)
			after := d.Stats()
			assert.Equal(t, held.NotifiedHolds, after.NotifiedHolds, "the retry is a plain miss: it releases nothing")
			clk.Advance(kvroute.Defaults().TTLs.DecoderBlocks + time.Second)
			lapsed := d.Stats()
			assert.GreaterOrEqual(t, lapsed.TTLBlocks, held.UsedBlocks, "the hold lapsed at the TTL")
			assert.Zero(t, lapsed.UsedBlocks)
		})
	}
}

// A handle whose decode engine restarted since is not released (its
// blocks are gone): it is dropped and counted.
func TestReleaseSkipsRestartedEngine(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true))
	rec := &kvroutetest.Records{}
	const check = 20 * time.Millisecond
	r := newRouter(t, c, kvroute.WithObserver(rec), kvroute.WithThreshold(4096), kvroute.WithHealth(kvroute.Health{RestartCheck: check}))
	url := serve(t, r)
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
	conv.say(userText(1))
	conv.hear(releaseTurn(t, url, conv.path, conv.body(), nil))
	knowCapacity(t, r)
	// A restart takes longer than RestartCheck (the simulator's is
	// instant): the reading of turn 1 (pressure's, the restart check's
	// too) is too old to vouch for the engine's process when turn 2 comes.
	time.Sleep(2 * check)
	c.Decode[0].Restart()
	conv.say(userText(2))
	releaseTurn(t, url, conv.path, conv.body(), nil)
	tr := rec.Last()
	assert.Equal(t, kvroute.MissRestarted, tr.MissReason)
	assert.False(t, tr.Released)
	s := r.Stats()
	assert.EqualValues(t, 1, s.ReleaseSkipped)
	assert.Zero(t, s.ReleasedSuperseded+s.ReleaseFailures)
	assert.Zero(t, c.Decode[0].Stats().StaleNotifies)
}

package kvroute_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/transport"
)

// runTurns runs a conversation of n turns and checks every answer against
// the single-engine reference; it returns the turn records.
func runTurns(t *testing.T, url string, rec *kvroutetest.Records, conv *conversation, n int, ref []kvroutetest.Option, mutate func(turn int, c *conversation)) []kvroute.TurnRecord {
	t.Helper()
	var out []kvroute.TurnRecord
	for i := 0; i < n; i++ {
		if mutate != nil && i > 0 {
			mutate(i, conv)
		}
		conv.say(userText(i))
		body := conv.body()
		res := post(t, url, conv.path, body, conv.header)
		require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
		assert.NotContains(t, string(res.raw), "token_ids", "token ids the client did not ask for")
		want, err := kvroutetest.Reference(conv.path, body, ref...)
		require.NoError(t, err)
		assert.Equal(t, want.Text, res.text, "turn %d differs from the single-engine answer", i)
		out = append(out, rec.Last())
		conv.hear(res.text)
	}
	return out
}

func TestTokenVerificationHonestContinuation(t *testing.T) {
	for _, path := range []string{kvroute.PathChatCompletions, kvroute.PathCompletions} {
		for _, stream := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s stream=%v", path, stream), func(t *testing.T) {
				c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true))
				rec := &kvroutetest.Records{}
				r := newRouter(t, c, kvroute.WithObserver(rec))
				url := serve(t, r)
				conv := &conversation{path: path, stream: stream, maxTok: 24}
				if path == kvroute.PathChatCompletions {
					conv.messages = []message{{Role: "system", Content: systemPrompt}}
				} else {
					conv.prompt = systemPrompt
				}
				recs := runTurns(t, url, rec, conv, 6, nil, nil)
				assert.Equal(t, kvroute.ReuseMiss, recs[0].Reuse)
				for i, tr := range recs[1:] {
					require.Equal(t, kvroute.ReuseHit, tr.Reuse, "turn %d: %s", i+1, tr.MissReason)
					assert.Equal(t, kvroute.VerifyTokens, tr.Verification)
					if path == kvroute.PathChatCompletions {
						assert.False(t, tr.Partial, "an honest chat continuation reuses the whole handle")
						assert.Equal(t, tr.HandleTokens, tr.ReusableTokens)
					}
					assert.Positive(t, tr.VerifiedTokens)
					assert.Equal(t, kvroute.TokensFromRender, tr.TokenSource)
				}
				for _, e := range append(c.Prefill, c.Decode...) {
					assert.Zero(t, e.Stats().WrongOutputs)
					assert.Zero(t, e.Stats().FreedReads)
				}
			})
		}
	}
}

// Reasoning the template strips from past turns: the verified prefix is the
// previous prompt and more, and the answers stay right.
func TestTokenVerificationReasoning(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			opts := []kvroutetest.Option{kvroutetest.WithReasoning(true), kvroutetest.WithStreamHandles(true)}
			c := kvroutetest.NewCluster(t, 1, 1, opts...)
			rec := &kvroutetest.Records{}
			r := newRouter(t, c, kvroute.WithObserver(rec))
			url := serve(t, r)
			conv := &conversation{path: kvroute.PathChatCompletions, stream: stream, maxTok: 64,
				messages: []message{{Role: "system", Content: systemPrompt}}}
			recs := runTurns(t, url, rec, conv, 6, opts, nil)
			for i, tr := range recs[1:] {
				require.Equal(t, kvroute.ReuseHit, tr.Reuse, "turn %d: %s", i+1, tr.MissReason)
				assert.True(t, tr.Partial, "reasoning stripped from history: a prefix")
				prev := recs[i].PromptTokens
				if prev > 0 {
					assert.GreaterOrEqual(t, float64(tr.ReusableTokens), 0.9*float64(prev), "turn %d reuses %d of the previous prompt's %d", i+1, tr.ReusableTokens, prev)
				}
			}
			for _, e := range append(c.Prefill, c.Decode...) {
				assert.Zero(t, e.Stats().WrongOutputs)
				assert.Zero(t, e.Stats().FreedReads)
			}
		})
	}
}

// An edit in the middle of the history: the unedited prefix is reused.
func TestTokenVerificationEditedHistory(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1)
	rec := &kvroutetest.Records{}
	r := newRouter(t, c, kvroute.WithObserver(rec))
	url := serve(t, r)
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 24,
		messages: []message{{Role: "system", Content: systemPrompt}}}
	recs := runTurns(t, url, rec, conv, 6, nil, func(turn int, c *conversation) {
		if turn == 4 {
			c.messages[3].Content += " (edited)"
		}
	})
	tr := recs[4]
	require.Equal(t, kvroute.ReuseHit, tr.Reuse, tr.MissReason)
	assert.True(t, tr.Partial)
	assert.Less(t, tr.ReusableTokens, tr.HandleTokens)
	assert.Equal(t, kvroute.ReuseHit, recs[5].Reuse)
	assert.Zero(t, c.Decode[0].Stats().WrongOutputs)
	assert.Zero(t, c.Prefill[0].Stats().WrongOutputs)
}

// Engines without any render endpoint: content verification stands in,
// once logged and counted; with neither render nor a usable /tokenize and a
// handle retained only for tokens, the turn is a plain prefill.
func TestTokenVerificationFallbacks(t *testing.T) {
	t.Run("tokenize", func(t *testing.T) {
		c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithRenderRoutes(false))
		rec := &kvroutetest.Records{}
		r := newRouter(t, c, kvroute.WithObserver(rec))
		url := serve(t, r)
		conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 24, messages: []message{{Role: "system", Content: systemPrompt}}}
		recs := runTurns(t, url, rec, conv, 3, nil, nil)
		assert.Equal(t, kvroute.ReuseHit, recs[2].Reuse, recs[2].MissReason)
		assert.Equal(t, kvroute.TokensFromTokenize, recs[2].TokenSource)
	})
	t.Run("content", func(t *testing.T) {
		c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithRenderRoutes(false))
		rec := &kvroutetest.Records{}
		r := newRouter(t, c, kvroute.WithObserver(rec))
		url := serve(t, r)
		// documents: /tokenize ignores them, so it cannot verify.
		conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 24, messages: []message{{Role: "system", Content: systemPrompt}},
			extra: map[string]any{"documents": []map[string]string{{"title": "a", "text": "b"}}}}
		recs := runTurns(t, url, rec, conv, 3, nil, nil)
		assert.Equal(t, kvroute.ReuseHit, recs[2].Reuse, recs[2].MissReason)
		assert.Equal(t, kvroute.VerifyContent, recs[2].Verification)
		assert.Positive(t, r.Stats().TokenFallbacks)
	})
	t.Run("reasoning without a renderer", func(t *testing.T) {
		opts := []kvroutetest.Option{kvroutetest.WithRenderer(false), kvroutetest.WithReasoning(true)}
		c := kvroutetest.NewCluster(t, 1, 1, opts...)
		rec := &kvroutetest.Records{}
		r := newRouter(t, c, kvroute.WithObserver(rec))
		url := serve(t, r)
		conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 64, messages: []message{{Role: "system", Content: systemPrompt}},
			extra: map[string]any{"documents": []map[string]string{{"title": "a", "text": "b"}}}}
		recs := runTurns(t, url, rec, conv, 3, opts, nil)
		for _, tr := range recs[1:] {
			assert.Equal(t, kvroute.ReuseMiss, tr.Reuse)
			assert.Equal(t, kvroute.MissUnverified, tr.MissReason)
		}
		assert.Positive(t, r.Stats().PutBacks, "an unverifiable handle is put back, not destroyed")
	})
}

// The client's own return_token_ids is honoured: the ids reach it.
func TestTokenIDsAskedByClient(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1)
	r := newRouter(t, c)
	url := serve(t, r)
	body := []byte(`{"model":"sim-model","max_tokens":8,"return_token_ids":true,"messages":[{"role":"user","content":"hello there"}]}`)
	res := post(t, url, kvroute.PathChatCompletions, body, nil)
	require.Equal(t, http.StatusOK, res.status)
	assert.True(t, strings.Contains(string(res.raw), `"prompt_token_ids"`) && strings.Contains(string(res.raw), `"token_ids"`), "%s", res.raw)
}

// A model with several KV groups: a verified prefix cuts every group's
// block list from the front, and the answers stay right (a group left
// uncut would read the wrong blocks).
func TestTokenVerificationKVGroups(t *testing.T) {
	opts := []kvroutetest.Option{kvroutetest.WithReasoning(true), kvroutetest.WithKVGroups(2), kvroutetest.WithPrefixCaching(false), kvroutetest.WithRecomputeThreshold(0)}
	c := kvroutetest.NewCluster(t, 1, 1, opts...)
	rec := &kvroutetest.Records{}
	r := newRouter(t, c, kvroute.WithObserver(rec))
	url := serve(t, r)
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 64, messages: []message{{Role: "system", Content: systemPrompt}}}
	recs := runTurns(t, url, rec, conv, 5, opts, nil)
	for i, tr := range recs[1:] {
		require.Equal(t, kvroute.ReuseHit, tr.Reuse, "turn %d: %s", i+1, tr.MissReason)
		assert.True(t, tr.Partial)
	}
	for _, e := range append(c.Prefill, c.Decode...) {
		assert.Zero(t, e.Stats().WrongOutputs)
		assert.Zero(t, e.Stats().AssertFailures)
	}
	// The cut handles P received: two groups of equal, shorter length.
	for _, pr := range roleRecords(c.Prefill[0], "prefill")[1:] {
		var body struct {
			KV struct {
				Blocks [][]int `json:"remote_block_ids"`
				N      int     `json:"remote_num_tokens"`
			} `json:"kv_transfer_params"`
		}
		require.NoError(t, json.Unmarshal(pr.Body, &body))
		require.Len(t, body.KV.Blocks, 2)
		assert.Len(t, body.KV.Blocks[1], len(body.KV.Blocks[0]))
		assert.Equal(t, (body.KV.N+15)/16, len(body.KV.Blocks[0]))
		assert.Zero(t, body.KV.N%16, "a block-aligned prefix")
	}
}

// A completions client that sends token ids (as RL and agent frameworks
// do): its prompt is verified as it stands, with no render call, and every
// answer is the single engine's.
func TestTokenVerificationPromptIDs(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithPrefixCaching(false), kvroutetest.WithRecomputeThreshold(0))
	rec := &kvroutetest.Records{}
	r := newRouter(t, c, kvroute.WithObserver(rec))
	url := serve(t, r)
	sys, err := kvroutetest.Reference(kvroute.PathCompletions, []byte(`{"model":"sim-model","max_tokens":1,"prompt":`+strconvQuote(systemPrompt)+`}`))
	require.NoError(t, err)
	prompt := append([]uint32(nil), sys.PromptTokenIDs...)
	for turn := range 4 {
		user, err := kvroutetest.Reference(kvroute.PathCompletions, []byte(`{"model":"sim-model","max_tokens":1,"prompt":`+strconvQuote(userText(turn))+`}`))
		require.NoError(t, err)
		prompt = append(prompt, user.PromptTokenIDs...)
		body, err := json.Marshal(map[string]any{"model": kvroutetest.DefaultModel, "max_tokens": 16, "prompt": prompt})
		require.NoError(t, err)
		res := post(t, url, kvroute.PathCompletions, body, nil)
		require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
		want, err := kvroutetest.Reference(kvroute.PathCompletions, body)
		require.NoError(t, err)
		assert.Equal(t, want.Text, res.text, "turn %d", turn)
		tr := rec.Last()
		if turn > 0 {
			require.Equal(t, kvroute.ReuseHit, tr.Reuse, "turn %d: %s", turn, tr.MissReason)
			assert.Equal(t, kvroute.TokensFromPrompt, tr.TokenSource)
			assert.Zero(t, tr.Render, "no render call")
		}
		prompt = append(prompt, want.TokenIDs...)
	}
	assert.Zero(t, c.Prefill[0].Stats().RenderRequests)
	for _, e := range append(c.Prefill, c.Decode...) {
		assert.Zero(t, e.Stats().WrongOutputs)
	}
}

func strconvQuote(s string) string { b, _ := json.Marshal(s); return string(b) }

// TestTokenHitsTakeRenderedPromptIDs runs token-verified conversations
// over the token-aware canned engines: on every hit D's prompt ids, spelled
// as P's render answer spells the same ids, are taken as the rendered ones
// without being parsed again, and the fingerprint stored from them verifies
// the next turn in full. When D spells them otherwise (a space after each
// comma) they are parsed, with the same outcomes.
func TestTokenHitsTakeRenderedPromptIDs(t *testing.T) {
	for _, spaced := range []bool{false, true} {
		t.Run(fmt.Sprintf("spaced=%v", spaced), func(t *testing.T) {
			te := newTokenEngines(t)
			te.spacedPromptIDs.Store(spaced)
			obs := &kvroutetest.Records{}
			rt, err := transport.NewTransport()
			require.NoError(t, err)
			t.Cleanup(rt.CloseIdleConnections)
			r, err := kvroute.New(kvroute.WithPrefill(te.prefill), kvroute.WithDecode(te.decode), kvroute.WithTransport(rt),
				kvroute.WithVerification(kvroute.Verification{Mode: kvroute.VerifyTokens}),
				kvroute.WithObserver(obs))
			require.NoError(t, err)
			t.Cleanup(func() { _ = r.Close() })
			const turns = 2 * turnsPerConv
			hits := 0
			var conv *benchConv
			for i := range turns {
				if i%turnsPerConv == 0 {
					conv = newBenchConv(fmt.Sprintf("c%d ", i), 4<<10)
				}
				resp, err := r.Do(context.Background(), &kvroute.Request{Path: kvroute.PathChatCompletions, Header: http.Header{}, Body: conv.body()})
				require.NoError(t, err)
				var out bytes.Buffer
				_, err = resp.WriteTo(&out)
				require.NoError(t, err)
				require.NoError(t, resp.Close())
				assert.NotContains(t, out.String(), "token_ids")
				last := obs.Last()
				require.NoError(t, checkTurn(&last, kvroute.VerifyTokens, i%turnsPerConv == 0), "turn %d", i)
				if i%turnsPerConv != 0 {
					hits++
				}
				conv.messages = append(conv.messages,
					map[string]string{"role": "assistant", "content": toyReply},
					map[string]string{"role": "user", "content": fmt.Sprintf("Now run step %d.", i)})
			}
			want := int64(hits)
			if spaced {
				want = 0
			}
			assert.Equal(t, want, kvroute.RenderedPromptIDs(r), "turns whose prompt ids were the rendered ones")
		})
	}
}

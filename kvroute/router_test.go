package kvroute_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// TestConversation runs a 20-turn conversation through the router for each
// API, streaming or not, on stock and PR #40186 engines.
func TestConversation(t *testing.T) {
	for _, path := range []string{kvroute.PathChatCompletions, kvroute.PathCompletions} {
		for _, stream := range []bool{false, true} {
			for _, handles := range []bool{false, true} {
				name := strings.TrimPrefix(path, "/v1/")
				name += map[bool]string{false: "/body", true: "/stream"}[stream]
				name += map[bool]string{false: "/stock", true: "/pr40186"}[handles]
				t.Run(name, func(t *testing.T) {
					t.Parallel()
					runConversation(t, path, stream, handles)
				})
			}
		}
	}
}

func runConversation(t *testing.T, path string, stream, handles bool) {
	// Prefix caching off, as on the published experiment's prefill engine:
	// everything P does not pull, it computes.
	c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(handles), kvroutetest.WithPrefixCaching(false))
	r := newRouter(t, c)
	url := serve(t, r)
	conv := &conversation{path: path, stream: stream, maxTok: 24}
	if path == kvroute.PathChatCompletions {
		conv.messages = []message{{Role: "system", Content: systemPrompt}}
	} else {
		conv.prompt = systemPrompt
	}
	canReuse := !stream || handles
	const turns = 20
	for i := 1; i <= turns; i++ {
		conv.say(userText(i))
		body := conv.body()
		res := post(t, url, path, body, nil)
		require.Equal(t, http.StatusOK, res.status, "turn %d: %s", i, res.raw)
		require.Equal(t, reference(t, path, body), res.text, "turn %d answer differs from the single-engine reference", i)
		want := kvroute.ReuseMiss
		if i > 1 && canReuse {
			want = kvroute.ReuseHit
		}
		assert.Equal(t, want, kvroute.ReuseOutcome(res.header.Get("X-Bidikv-Reuse")), "turn %d", i)
		conv.hear(res.text)
	}
	p, d := c.Prefill[0], c.Decode[0]
	pre := roleRecords(p, "prefill")
	require.Len(t, pre, turns)
	for i, rec := range pre[1:] {
		prev := pre[i]
		if !canReuse {
			assert.Equal(t, "none", rec.Pull, "turn %d", i+2)
			continue
		}
		// P computes only what it could not pull: the new messages
		// (plus the last generated token, whose KV D never computed).
		assert.Equal(t, "pull", rec.Pull, "turn %d", i+2)
		assert.Equal(t, rec.PromptTokens, rec.PulledTokens+rec.ComputedTokens+rec.CachedTokens, "turn %d", i+2)
		newTokens := rec.PromptTokens - prev.PromptTokens - roleRecords(d, "decode")[i].CompletionTokens
		assert.LessOrEqual(t, rec.ComputedTokens, newTokens+1, "turn %d computed more than the new tokens", i+2)
	}
	for _, e := range []*kvroutetest.Engine{p, d} {
		st := e.Stats()
		assert.Zero(t, st.FreedReads, "reads of freed blocks")
		assert.Zero(t, st.ExpiredReads, "reads of expired blocks")
		assert.Zero(t, st.WrongOutputs, "outputs differing from the reference")
	}
	if stream && !handles {
		assert.Equal(t, int64(turns), r.Stats().NoStreamHandle)
	} else {
		assert.Equal(t, int64(turns), r.Stats().Stored)
	}
}

// TestPrefillRewrites checks messages 1, 2 and 4 of docs/kvroute.md's Wire
// protocol byte for byte.
func TestPrefillRewrites(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true))
	r := newRouter(t, c)
	url := serve(t, r)
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, stream: true, messages: []message{{Role: "system", Content: systemPrompt}}, extra: map[string]any{
		"max_completion_tokens": 16, "min_tokens": 2, "stream_options": map[string]any{"include_usage": true},
		"conversation_id":    "conv-1",
		"kv_transfer_params": map[string]any{"remote_engine_id": "evil", "do_remote_prefill": true},
	}}
	conv.say("hello there")
	hdr := http.Header{"X-Request-Id": {"req-turn-1"}}
	res := post(t, url, kvroute.PathChatCompletions, conv.body(), hdr)
	require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
	res0ID := res.header.Get("X-Request-Id")
	conv.hear(res.text)
	conv.say("and again")
	res = post(t, url, kvroute.PathChatCompletions, conv.body(), http.Header{"X-Request-Id": {"req-turn-2"}})
	require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
	assert.Equal(t, kvroute.ReuseHit, kvroute.ReuseOutcome(res.header.Get("X-Bidikv-Reuse")))

	pre := roleRecords(c.Prefill[0], "prefill")
	dec := roleRecords(c.Decode[0], "decode")
	require.Len(t, pre, 2)
	require.Len(t, dec, 2)
	for i, rec := range pre {
		var b map[string]json.RawMessage
		require.NoError(t, json.Unmarshal(rec.Body, &b))
		assert.JSONEq(t, "false", string(b["stream"]))
		assert.JSONEq(t, "1", string(b["max_tokens"]))
		for _, k := range []string{"max_completion_tokens", "min_tokens", "min_completion_tokens", "stream_options", "conversation_id"} {
			assert.NotContains(t, b, k, "prefill turn %d", i+1)
		}
		assert.Equal(t, dec[i].RequestID, rec.RequestID, "both legs carry one X-Request-Id")
		assert.Equal(t, "", rec.Header.Get("Authorization"))
	}
	assert.Regexp(t, `^req-turn-1-[0-9a-f]{16}$`, pre[0].RequestID, "the client's id, made unique for the engines")
	assert.Equal(t, "req-turn-1", res0ID, "the client sees its own id")
	// Message 1: the miss handle, never the client's.
	var b1 map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(pre[0].Body, &b1))
	assert.JSONEq(t, `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`, string(b1["kv_transfer_params"]))
	// Message 2: D's handle with the role flags forced, every other key verbatim.
	var b2 map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(pre[1].Body, &b2))
	var sent, emitted map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(b2["kv_transfer_params"], &sent))
	require.NoError(t, json.Unmarshal(dec[0].Handle, &emitted))
	assert.Equal(t, "true", string(sent["do_remote_decode"]))
	assert.Equal(t, "false", string(sent["do_remote_prefill"]))
	for k, v := range emitted {
		if k == "do_remote_decode" || k == "do_remote_prefill" {
			continue
		}
		assert.Equal(t, string(v), string(sent[k]), "key %s forwarded verbatim", k)
	}
	assert.Len(t, sent, len(emitted))
	// Message 4: P's handle, verbatim; the client's fields kept.
	for i, rec := range dec {
		var b map[string]json.RawMessage
		require.NoError(t, json.Unmarshal(rec.Body, &b))
		assert.JSONEq(t, string(pre[i].Handle), string(b["kv_transfer_params"]))
		assert.NotContains(t, b, "conversation_id")
		assert.Contains(t, b, "max_completion_tokens")
		assert.Contains(t, b, "stream_options")
	}
}

// TestConcurrentFollowUps sends 64 identical follow-ups at once: exactly one
// may carry the handle, and no engine reads freed blocks.
func TestConcurrentFollowUps(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1)
	r := newRouter(t, c)
	url := serve(t, r)
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
	conv.say(userText(1))
	res := post(t, url, kvroute.PathChatCompletions, conv.body(), nil)
	require.Equal(t, http.StatusOK, res.status)
	conv.hear(res.text)
	conv.say(userText(2))
	body := conv.body()
	want := reference(t, kvroute.PathChatCompletions, body)

	const n = 64
	var wg sync.WaitGroup
	results := make([]turnResult, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = post(t, url, kvroute.PathChatCompletions, body, nil)
		}()
	}
	wg.Wait()
	hits := 0
	for _, res := range results {
		require.Equal(t, http.StatusOK, res.status)
		assert.Equal(t, want, res.text)
		if res.header.Get("X-Bidikv-Reuse") == string(kvroute.ReuseHit) {
			hits++
		}
	}
	// The first handle goes to one request. A request that finishes
	// retains its own handle under the conversation's anchor, and a later
	// one of the 64 may reuse its verified prefix: every hit is a
	// different handle, each attached once.
	assert.GreaterOrEqual(t, hits, 1)
	// The 64 retain under one key: each retain releases the handle it
	// finds there (a release request: a prefill request carrying the
	// handle with remote_num_tokens 0). A handle is attached or released,
	// once.
	attached, used := map[string]int{}, map[string]int{}
	for _, rec := range roleRecords(c.Prefill[0], "prefill") {
		var b struct {
			KV struct {
				RemoteRequestID *string `json:"remote_request_id"`
			} `json:"kv_transfer_params"`
		}
		require.NoError(t, json.Unmarshal(rec.Body, &b))
		if id := b.KV.RemoteRequestID; id != nil {
			used[*id]++
			if rec.Header.Get("User-Agent") != "bidikv-release" {
				attached[*id]++
			}
		}
	}
	assert.Len(t, attached, hits, "prefill requests carrying a decode handle")
	for id, n := range used {
		assert.Equal(t, 1, n, "handle %s attached or released more than once", id)
	}
	for _, e := range []*kvroutetest.Engine{c.Prefill[0], c.Decode[0]} {
		assert.Zero(t, e.Stats().FreedReads)
		assert.Zero(t, e.Stats().WrongOutputs)
	}
}

// TestRetentionTTL: once the retention TTL has passed, the next turn is a
// plain prefill with a correct answer.
func TestRetentionTTL(t *testing.T) {
	clock := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
	c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithClock(clock))
	obs := &kvroutetest.Records{}
	r := newRouter(t, c, kvroute.WithObserver(obs))
	url := serve(t, r)
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
	conv.say(userText(1))
	res := post(t, url, kvroute.PathChatCompletions, conv.body(), nil)
	require.Equal(t, http.StatusOK, res.status)
	conv.hear(res.text)
	clock.Advance(kvroute.Defaults().TTLs.Retention + time.Second)
	conv.say(userText(2))
	body := conv.body()
	res = post(t, url, kvroute.PathChatCompletions, body, nil)
	require.Equal(t, http.StatusOK, res.status)
	assert.Equal(t, reference(t, kvroute.PathChatCompletions, body), res.text)
	assert.Equal(t, kvroute.ReuseMiss, kvroute.ReuseOutcome(res.header.Get("X-Bidikv-Reuse")))
	recs := obs.All()
	require.Len(t, recs, 2)
	assert.Equal(t, kvroute.MissExpired, recs[1].MissReason)
	for _, e := range []*kvroutetest.Engine{c.Prefill[0], c.Decode[0]} {
		assert.Zero(t, e.Stats().ExpiredReads)
		assert.Zero(t, e.Stats().WrongOutputs)
	}
}

// TestClientCancelAbortsDecode: a client that goes away mid-stream aborts
// the decode request on the engine, and nothing is retained.
func TestClientCancelAbortsDecode(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true),
		kvroutetest.WithProfile(kvroutetest.Profile{Name: "slow-decode", InterTokenLatency: 20 * time.Millisecond}),
		kvroutetest.WithSpeed(1))
	r := newRouter(t, c)
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 200, stream: true}
	conv.say(userText(1))
	ctx, cancel := context.WithCancel(context.Background())
	resp, err := r.Do(ctx, &kvroute.Request{Path: kvroute.PathChatCompletions, Body: conv.body()})
	require.NoError(t, err)
	ev, err := resp.Next()
	require.NoError(t, err)
	require.NotEmpty(t, ev)
	cancel()
	for {
		if _, err = resp.Next(); err != nil {
			break
		}
	}
	require.ErrorIs(t, err, context.Canceled)
	require.NoError(t, resp.Close())
	d := c.Decode[0]
	require.Eventually(t, func() bool { return d.Stats().Aborted == 1 }, 10*time.Second, 5*time.Millisecond)
	assert.Zero(t, r.Stats().Stored)
}

// TestBadRequests: malformed input gets a 4xx in OpenAI's error shape and
// reaches no engine.
func TestBadRequests(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1)
	r := newRouter(t, c, kvroute.WithLimits(kvroute.Limits{Body: 1 << 16}))
	url := serve(t, r)
	cases := []struct {
		name, method, path, body string
		status                   int
	}{
		{"not json", http.MethodPost, kvroute.PathChatCompletions, `{"model":`, 400},
		{"array body", http.MethodPost, kvroute.PathChatCompletions, `[1,2]`, 400},
		{"no messages", http.MethodPost, kvroute.PathChatCompletions, `{"model":"m"}`, 400},
		{"empty messages", http.MethodPost, kvroute.PathChatCompletions, `{"model":"m","messages":[]}`, 400},
		{"message not object", http.MethodPost, kvroute.PathChatCompletions, `{"messages":["hi"]}`, 400},
		{"stream not bool", http.MethodPost, kvroute.PathChatCompletions, `{"messages":[{"role":"user","content":"x"}],"stream":"maybe"}`, 400},
		{"no prompt", http.MethodPost, kvroute.PathCompletions, `{"model":"m"}`, 400},
		{"wrong method", http.MethodGet, kvroute.PathChatCompletions, ``, 405},
		{"unknown path", http.MethodPost, "/v1/embeddings", `{}`, 404},
		{"too large", http.MethodPost, kvroute.PathCompletions, `{"prompt":"` + strings.Repeat("a", 1<<17) + `"}`, 413},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			req, err := http.NewRequest(tc.method, url+tc.path, strings.NewReader(tc.body))
			require.NoError(t, err)
			resp, err := http.DefaultClient.Do(req)
			require.NoError(t, err)
			defer resp.Body.Close()
			assert.Equal(t, tc.status, resp.StatusCode)
			var e struct {
				Error struct {
					Message string  `json:"message"`
					Type    string  `json:"type"`
					Param   *string `json:"param"`
					Code    string  `json:"code"`
				} `json:"error"`
			}
			require.NoError(t, json.NewDecoder(resp.Body).Decode(&e))
			assert.NotEmpty(t, e.Error.Message)
			assert.Equal(t, "invalid_request_error", e.Error.Type)
		})
	}
	assert.Zero(t, c.Prefill[0].Stats().Requests)
	assert.Zero(t, c.Decode[0].Stats().Requests)
}

// TestPrefillWithoutHandle: when P answers without kv_transfer_params the
// miss handle never reaches D: the turn fails with 502, or with the local
// fallback D gets a plain request.
func TestPrefillWithoutHandle(t *testing.T) {
	noHandleP := newFakeEngine(t, func(w http.ResponseWriter, _ []byte) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"a"},"finish_reason":"length"}],"kv_transfer_params":null}`)
	})
	for _, fallback := range []bool{false, true} {
		t.Run(map[bool]string{false: "fail", true: "fallback"}[fallback], func(t *testing.T) {
			c := kvroutetest.NewCluster(t, 0, 1)
			r, err := kvroute.New(kvroute.WithPrefill(noHandleP), kvroute.WithDecode(c.Decode[0].URL()),
				kvroute.WithFailover(kvroute.Failover{LocalPrefill: fallback}))
			require.NoError(t, err)
			defer r.Close()
			url := serve(t, r)
			conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 8}
			conv.say("hi")
			res := post(t, url, kvroute.PathChatCompletions, conv.body(), nil)
			dec := c.Decode[0].Requests()
			if !fallback {
				assert.Equal(t, http.StatusBadGateway, res.status)
				assert.Contains(t, string(res.raw), "no KV transfer handle")
				assert.Empty(t, dec)
				return
			}
			require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
			require.Len(t, dec, 1)
			assert.Equal(t, "plain", dec[0].Role)
			assert.NotContains(t, string(dec[0].Body), "kv_transfer_params")
			assert.Equal(t, reference(t, kvroute.PathChatCompletions, conv.body()), res.text)
		})
	}
}

// newFakeEngine serves completions with fn; it stands for engines that
// misbehave in ways the simulator does not.
func newFakeEngine(t *testing.T, fn func(w http.ResponseWriter, body []byte)) string {
	srv := newServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		fn(w, b)
	}))
	return srv
}

// TestNew validates options with errors naming them.
func TestNew(t *testing.T) {
	cases := []struct {
		name string
		opts []kvroute.Option
		want string
	}{
		{"no prefill", []kvroute.Option{kvroute.WithDecode("127.0.0.1:1")}, "WithPrefill"},
		{"no decode", []kvroute.Option{kvroute.WithPrefill("127.0.0.1:1")}, "WithDecode"},
		{"bad url", []kvroute.Option{kvroute.WithPrefill("ftp://x"), kvroute.WithDecode("127.0.0.1:1")}, "WithPrefill"},
		{"ttl over decoder ttl", []kvroute.Option{kvroute.WithPrefill("127.0.0.1:1"), kvroute.WithDecode("127.0.0.1:2"), kvroute.WithTTLs(kvroute.TTLs{Retention: 478 * time.Second})}, "WithTTLs"},
		{"ttl negative", []kvroute.Option{kvroute.WithPrefill("127.0.0.1:1"), kvroute.WithDecode("127.0.0.1:2"), kvroute.WithTTLs(kvroute.TTLs{Retention: -time.Second})}, "WithTTLs"},
		{"negative threshold", []kvroute.Option{kvroute.WithPrefill("127.0.0.1:1"), kvroute.WithDecode("127.0.0.1:2"), kvroute.WithThreshold(-1)}, "WithThreshold"},
		{"negative timeout", []kvroute.Option{kvroute.WithPrefill("127.0.0.1:1"), kvroute.WithDecode("127.0.0.1:2"), kvroute.WithTimeouts(kvroute.Timeouts{Render: -time.Second})}, "WithTimeouts"},
		{"nil store", []kvroute.Option{kvroute.WithPrefill("127.0.0.1:1"), kvroute.WithDecode("127.0.0.1:2"), kvroute.WithStore(nil)}, "WithStore"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r, err := kvroute.New(tc.opts...)
			require.Error(t, err)
			assert.Nil(t, r)
			assert.ErrorIs(t, err, kvroute.ErrInvalidConfig)
			assert.Contains(t, err.Error(), tc.want)
		})
	}
	r, err := kvroute.New(kvroute.WithPrefill("[::1]:8100"), kvroute.WithDecode("http://127.0.0.1:8200"),
		kvroute.WithTTLs(kvroute.TTLs{Retention: 600 * time.Second, DecoderBlocks: 900 * time.Second}))
	require.NoError(t, err)
	require.NoError(t, r.Close())
	_, err = r.Do(context.Background(), &kvroute.Request{Path: kvroute.PathChatCompletions, Body: []byte(`{"messages":[{"role":"user","content":"x"}]}`)})
	assert.True(t, errors.Is(err, kvroute.ErrClosed))
}

package kvroute_test

import (
	"encoding/json"
	"maps"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/capability"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// learnedStates returns an endpoint's learned facts as name -> state.
func learnedStates(t *testing.T, r *kvroute.Router, phase kvroute.Phase) map[string]capability.State {
	t.Helper()
	eps := r.Endpoints(phase)
	require.Len(t, eps, 1)
	out := map[string]capability.State{}
	for _, n := range eps[0].Learned {
		_, dup := out[n.Name]
		require.False(t, dup, "%s reported twice", n.Name)
		require.NotEmpty(t, n.Fact.Why, n.Name)
		if n.Fact.Is(capability.Absent) {
			require.NotEmpty(t, n.Fact.Fix, n.Name)
		}
		out[n.Name] = n.Fact.State
	}
	return out
}

// Issue 24, item 1: what real turns show of the engines, each missing
// capability under one reason. The router learns per engine and per API
// whether decode streams carry a handle, whether decode transfers both
// ways, whether a prefill engine takes kv_transfer_params on Responses
// and Messages, and which render routes it lacks (404 or 501, from the
// renderers); Router.Endpoints reports it under kvroute/capability's
// names, and the turns a missing capability cost name it in
// TurnRecord.Missing.
func TestCapabilitiesLearned(t *testing.T) {
	toolChoice := map[string]any{"tool_choice": "none", "tools": []any{map[string]any{"type": "function",
		"function": map[string]any{"name": "ls", "parameters": map[string]any{"type": "object"}}}}}
	for _, tc := range []struct {
		name    string
		engine  []kvroutetest.Option
		opts    []kvroute.Option
		path    string
		stream  bool
		turns   int
		extra   map[string]any
		missing string
		prefill map[string]capability.State // every fact learned of the prefill engine
		decode  map[string]capability.State // every fact learned of the decode engine
	}{
		{name: "stock chat stream", path: kvroute.PathChatCompletions, stream: true, turns: 1, missing: "no_stream_handle",
			decode: map[string]capability.State{"stream_handles_chat": capability.Absent}},
		{name: "stock completions stream", path: kvroute.PathCompletions, stream: true, turns: 1, missing: "no_stream_handle",
			decode: map[string]capability.State{"stream_handles_completions": capability.Absent}},
		{name: "messages stream", path: kvroute.PathMessages, stream: true, turns: 1, missing: "no_stream_handle",
			engine: []kvroutetest.Option{kvroutetest.WithStreamHandles(true)},
			decode: map[string]capability.State{"stream_handles_messages": capability.Absent}},
		{name: "chat stream with PR 40186", path: kvroute.PathChatCompletions, stream: true, turns: 2,
			engine: []kvroutetest.Option{kvroutetest.WithStreamHandles(true)},
			decode: map[string]capability.State{"stream_handles_chat": capability.Present, "bidirectional": capability.Present}},
		{name: "non-streaming", path: kvroute.PathChatCompletions, turns: 2,
			decode: map[string]capability.State{"bidirectional": capability.Present}},
		{name: "no render routes: messages", path: kvroute.PathMessages, turns: 1, missing: "no_render_route",
			engine:  []kvroutetest.Option{kvroutetest.WithRenderRoutes(false)},
			prefill: map[string]capability.State{"render_messages": capability.Absent},
			decode:  map[string]capability.State{"bidirectional": capability.Present}},
		{name: "no renderer: responses", path: kvroute.PathResponses, turns: 1, missing: "no_render_route",
			engine:  []kvroutetest.Option{kvroutetest.WithRenderer(false)},
			prefill: map[string]capability.State{"render_responses": capability.Absent},
			decode:  map[string]capability.State{"bidirectional": capability.Present}},
		{name: "no render routes: chat through /tokenize", path: kvroute.PathChatCompletions, turns: 2,
			engine:  []kvroutetest.Option{kvroutetest.WithRenderRoutes(false)},
			prefill: map[string]capability.State{"render_chat": capability.Absent},
			decode:  map[string]capability.State{"bidirectional": capability.Present}},
		{name: "no render routes: chat /tokenize cannot render", path: kvroute.PathChatCompletions, turns: 2, extra: toolChoice, missing: "no_render_route",
			engine:  []kvroutetest.Option{kvroutetest.WithRenderRoutes(false)},
			prefill: map[string]capability.State{"render_chat": capability.Absent},
			decode:  map[string]capability.State{"bidirectional": capability.Present}},
		{name: "no render routes, no tokenize", path: kvroute.PathChatCompletions, turns: 2, missing: "no_render_route",
			engine:  []kvroutetest.Option{kvroutetest.WithRenderRoutes(false), kvroutetest.WithTokenize(false)},
			prefill: map[string]capability.State{"render_chat": capability.Absent, "tokenize": capability.Absent},
			decode:  map[string]capability.State{"bidirectional": capability.Present}},
		{name: "messages without kv_transfer_params", path: kvroute.PathMessages, turns: 1, missing: "no_api_handle",
			engine:  []kvroutetest.Option{kvroutetest.WithMessagesKV(false)},
			opts:    []kvroute.Option{kvroute.WithFailover(kvroute.Failover{LocalPrefill: true})},
			prefill: map[string]capability.State{"handles_messages": capability.Absent}},
		{name: "bidirectional off", path: kvroute.PathChatCompletions, turns: 1, missing: "no_bidirectional",
			engine: []kvroutetest.Option{kvroutetest.WithBidirectional(false)},
			decode: map[string]capability.State{"bidirectional": capability.Absent}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := kvroutetest.NewCluster(t, 1, 1, tc.engine...)
			obs := &kvroutetest.Records{}
			r := newRouter(t, c, append([]kvroute.Option{kvroute.WithObserver(obs), kvroute.WithThreshold(0)}, tc.opts...)...)
			url := serve(t, r)
			for i := range tc.turns {
				res := send(t, url, tc.path, learnedBody(t, tc.path, tc.stream, i, tc.extra), nil)
				require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
			}
			assert.Equal(t, tc.missing, obs.Last().Missing, "the last turn's missing capability")
			assert.Equal(t, orEmpty(tc.prefill), learnedStates(t, r, kvroute.PhasePrefill), "learned of the prefill engine")
			assert.Equal(t, orEmpty(tc.decode), learnedStates(t, r, kvroute.PhaseDecode), "learned of the decode engine")
			if tc.missing == "no_stream_handle" {
				assert.Equal(t, int64(1), r.Stats().NoStreamHandle, "counted on every API")
			}
		})
	}
	t.Run("no token ids", func(t *testing.T) {
		f := newFake(t) // its decode answers carry no token ids
		obs := &kvroutetest.Records{}
		r := fakeRouter(t, f, obs, kvroute.WithVerification(kvroute.Verification{Mode: kvroute.VerifyTokens}))
		_, err := doTurn(t, r, chatBody(false, "hi"), nil)
		require.NoError(t, err)
		assert.Equal(t, "no_token_ids", obs.Last().Missing)
		assert.Equal(t, int64(1), r.Stats().TokenFallbacks)
	})
}

func orEmpty(m map[string]capability.State) map[string]capability.State {
	if m == nil {
		return map[string]capability.State{}
	}
	return m
}

// learnedBody is turn i of a conversation on path, each turn resending
// the history with a fixed reply.
func learnedBody(t *testing.T, path string, stream bool, turn int, extra map[string]any) []byte {
	t.Helper()
	reply := " earlier reply" // a completions prompt's continuation
	if path == kvroute.PathResponses || path == kvroute.PathMessages {
		reply = "earlier reply"
	}
	return convBody(t, path, stream, turn, 8, func(int) string { return reply }, extra)
}

// convBody is turn i of a conversation of the API at path, streamed or
// not, with replies of at most maxTok tokens: each earlier turn's reply
// is reply(its index), extra added to the body's top level.
func convBody(t *testing.T, path string, stream bool, turn, maxTok int, reply func(int) string, extra map[string]any) []byte {
	t.Helper()
	var b []byte
	switch path {
	case kvroute.PathResponses, kvroute.PathMessages:
		c := &agentConv{path: path, stream: stream, base: codexBase()}
		if path == kvroute.PathMessages {
			c.base = claudeBase()
		}
		for i := range turn + 1 {
			if i > 0 {
				c.hear(reply(i-1), i)
			}
			c.say(userText(i))
		}
		b = c.body()
		if len(extra) > 0 {
			var m map[string]any
			require.NoError(t, json.Unmarshal(b, &m))
			maps.Copy(m, extra)
			var err error
			b, err = json.Marshal(m)
			require.NoError(t, err)
		}
	default:
		c := &conversation{path: path, stream: stream, maxTok: maxTok, extra: extra}
		if path == kvroute.PathChatCompletions {
			c.messages = []message{{Role: "system", Content: systemPrompt}}
		} else {
			c.prompt = systemPrompt
		}
		for i := range turn + 1 {
			if i > 0 {
				c.hear(reply(i - 1))
			}
			c.say(userText(i))
		}
		b = c.body()
	}
	require.True(t, json.Valid(b))
	return b
}

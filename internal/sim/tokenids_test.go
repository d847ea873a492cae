package sim_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
)

// postRaw sends body to path and returns the status and raw answer.
func postRaw(t *testing.T, url, path string, body any) (int, []byte) {
	t.Helper()
	raw, ok := body.([]byte)
	if !ok {
		var err error
		raw, err = json.Marshal(body)
		require.NoError(t, err)
	}
	resp, err := http.Post(url+path, "application/json", bytes.NewReader(raw))
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, b
}

// idsOf is the answer's token ids: prompt ids, the first choice's ids, and
// the first choice's text, from a non-streaming body or a stream (the
// concatenation of every chunk's token_ids).
type idsOf struct {
	prompt, gen []uint32
	text        string
	// promptChunks counts chunks carrying a non-null prompt_token_ids;
	// chunks counts token chunks.
	promptChunks, chunks int
}

func parseIDs(t *testing.T, path string, b []byte) idsOf {
	t.Helper()
	type choice struct {
		Text    string `json:"text"`
		Message struct {
			Content string `json:"content"`
		} `json:"message"`
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
		TokenIDs       []uint32 `json:"token_ids"`
		PromptTokenIDs []uint32 `json:"prompt_token_ids"`
	}
	type body struct {
		Choices        []choice `json:"choices"`
		PromptTokenIDs []uint32 `json:"prompt_token_ids"`
	}
	var out idsOf
	if !bytes.HasPrefix(b, []byte("data:")) {
		var v body
		require.NoError(t, json.Unmarshal(b, &v), string(b))
		require.NotEmpty(t, v.Choices)
		c := v.Choices[0]
		out.gen, out.text = c.TokenIDs, c.Message.Content+c.Text
		out.prompt = v.PromptTokenIDs
		if path == sim.PathCompletions {
			out.prompt = c.PromptTokenIDs
		}
		return out
	}
	for _, ev := range readSSE(t, bytes.NewReader(b)).events {
		var v body
		require.NoError(t, json.Unmarshal([]byte(ev), &v), ev)
		if v.PromptTokenIDs != nil {
			out.prompt = v.PromptTokenIDs
			out.promptChunks++
		}
		for _, c := range v.Choices {
			if c.PromptTokenIDs != nil {
				out.prompt = c.PromptTokenIDs
				out.promptChunks++
			}
			if c.TokenIDs != nil {
				out.chunks++
				out.gen = append(out.gen, c.TokenIDs...)
			}
			out.text += c.Delta.Content + c.Text
		}
	}
	return out
}

func promptIDs(t *testing.T, cfg sim.Config, path string, body any) []uint32 {
	t.Helper()
	raw, err := json.Marshal(body)
	require.NoError(t, err)
	req, err := cfg.ParseRequest(path, raw)
	require.NoError(t, err)
	return tokIDs(req.Prompt)
}

func completion(prompt string) map[string]any {
	return map[string]any{"model": "sim-model", "prompt": prompt}
}

// return_token_ids: prompt_token_ids is the rendered prompt, token_ids every
// generated id (EOS and tokens cut by a stop string included), the same in
// the body and concatenated over the stream.
func TestReturnTokenIDs(t *testing.T) {
	long := words("tell me", 40)
	tests := []struct {
		name      string
		path      string
		reasoning bool
		body      map[string]any
	}{
		{"chat", sim.PathChat, false, chat(msg{"user", long})},
		{"chat reasoning", sim.PathChat, true, chat(msg{"user", long})},
		{"chat max_tokens", sim.PathChat, false, with(chat(msg{"user", long}), "max_tokens", 3)},
		{"chat reasoning max_tokens", sim.PathChat, true, with(chat(msg{"user", long}), "max_tokens", 4)},
		{"completions", sim.PathCompletions, false, completion(long)},
		{"completions max_tokens", sim.PathCompletions, false, with(completion(long), "max_tokens", 2)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			mod := func(c *sim.Config) { c.Reasoning = tt.reasoning }
			e := start(t, nil, nil, mod)
			cfg := e.Config()
			body := with(tt.body, "return_token_ids", true)
			raw, _ := json.Marshal(body)
			req, err := cfg.ParseRequest(tt.path, raw)
			require.NoError(t, err)
			ref := sim.Reference("sim-model", tokIDs(req.Prompt), cfg.GenParams(req, 0))

			status, b := postRaw(t, e.url, tt.path, body)
			require.Equal(t, http.StatusOK, status, string(b))
			got := parseIDs(t, tt.path, b)
			assert.Equal(t, tokIDs(req.Prompt), got.prompt)
			assert.Equal(t, tokIDs(ref.Tokens), got.gen)
			if ref.Finish == "stop" {
				assert.Equal(t, uint32(151645), got.gen[len(got.gen)-1], "the final EOS <|im_end|> is in token_ids")
			}

			status, sb := postRaw(t, e.url, tt.path, with(body, "stream", true))
			require.Equal(t, http.StatusOK, status, string(sb))
			st := parseIDs(t, tt.path, sb)
			assert.Equal(t, got.gen, st.gen, "streamed token_ids concatenate to the body's")
			assert.Equal(t, got.prompt, st.prompt)
			assert.Equal(t, 1, st.promptChunks, "prompt_token_ids on the first chunk only")
			assert.Len(t, got.gen, st.chunks, "one chunk per generated token, text or not")
			assert.Equal(t, got.text, st.text)
		})
	}
}

// A stop string cuts the text, not the ids.
func TestReturnTokenIDsStopString(t *testing.T) {
	e := start(t, nil, nil, nil)
	body := chat(msg{"user", "hello there"})
	ref := reference(t, sim.PathChat, body)
	require.GreaterOrEqual(t, len(ref.Tokens), 4)
	stop := ref.Tokens[2].Text // the third word, with its leading space
	stopped := with(body, "stop", []string{stop}, "return_token_ids", true)
	status, b := postRaw(t, e.url, sim.PathChat, stopped)
	require.Equal(t, http.StatusOK, status, string(b))
	got := parseIDs(t, sim.PathChat, b)
	assert.Equal(t, tokIDs(ref.Tokens[:3]), got.gen, "the token holding the stop string is in token_ids")
	assert.Equal(t, ref.Tokens[0].Text+ref.Tokens[1].Text, got.text, "the text is cut before the stop string")

	_, sb := postRaw(t, e.url, sim.PathChat, with(stopped, "stream", true))
	st := parseIDs(t, sim.PathChat, sb)
	assert.Equal(t, got.gen, st.gen)
	assert.Equal(t, got.text, st.text)
}

// Without return_token_ids vLLM writes the keys as null (model_dump, and
// explicitly set fields under exclude_unset in streams).
func TestTokenIDsNullWithoutFlag(t *testing.T) {
	e := start(t, nil, nil, nil)
	tests := []struct {
		name string
		path string
		body map[string]any
		want []string
		not  []string
	}{
		{"chat body", sim.PathChat, chat(msg{"user", "hi"}), []string{`"prompt_token_ids":null`, `"token_ids":null`}, nil},
		{"completions body", sim.PathCompletions, completion("hi"), []string{`"prompt_token_ids":null`, `"token_ids":null`}, nil},
		{"chat stream", sim.PathChat, with(chat(msg{"user", "hi"}), "stream", true), []string{`"prompt_token_ids":null`, `"token_ids":null`}, []string{`"token_ids":[`}},
		{"completions stream", sim.PathCompletions, with(completion("hi"), "stream", true), []string{`"prompt_token_ids":null`, `"token_ids":null`}, []string{`"token_ids":[`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			status, b := postRaw(t, e.url, tt.path, tt.body)
			require.Equal(t, http.StatusOK, status, string(b))
			for _, w := range tt.want {
				assert.Contains(t, string(b), w)
			}
			for _, w := range tt.not {
				assert.NotContains(t, string(b), w)
			}
		})
	}
}

// readBlocks reads a handle's blocks through the side channel and returns
// the kv values of its first n positions.
func readBlocks(t *testing.T, reg *sim.Registry, h json.RawMessage, bs, n int) []uint64 {
	t.Helper()
	p, err := sim.ParseParams(h)
	require.NoError(t, err)
	peer := reg.Lookup(p.Host, p.Port)
	require.NotNil(t, peer)
	data, err := peer.Read(context.Background(), p.EngineID, p.RequestID, p.Blocks, 0)
	require.NoError(t, err)
	var flat []uint64
	for _, b := range data {
		require.Len(t, b, bs)
		flat = append(flat, b...)
	}
	require.GreaterOrEqual(t, len(flat), n)
	return flat[:n]
}

// The router's invariant: D's handle covers R = len(prompt_token_ids) +
// len(token_ids) - 1 positions and D's blocks hold exactly the KV of
// (prompt_token_ids ++ token_ids)[:R], for bodies and streams, chat and
// completions, with and without reasoning.
func TestTokenIDsMatchDecodeHandle(t *testing.T) {
	long := words("explain", 50)
	for _, path := range []string{sim.PathChat, sim.PathCompletions} {
		for _, reasoning := range []bool{false, true} {
			for _, streaming := range []bool{false, true} {
				name := path
				if reasoning {
					name += " reasoning"
				}
				if streaming {
					name += " stream"
				}
				t.Run(name, func(t *testing.T) {
					reg := sim.NewRegistry()
					mod := func(c *sim.Config) { c.Reasoning = reasoning }
					p := start(t, reg, nil, mod)
					d := start(t, reg, nil, mod)
					body := chat(msg{"user", long})
					if path == sim.PathCompletions {
						body = completion(long)
					}
					rp := post(t, p.url, path, with(body, "max_tokens", 1, "kv_transfer_params", missHandle()))
					require.Equal(t, http.StatusOK, rp.Status, string(rp.Body))
					require.NotNil(t, rp.KV)
					status, b := postRaw(t, d.url, path, with(body, "kv_transfer_params", rp.KV, "return_token_ids", true, "stream", streaming))
					require.Equal(t, http.StatusOK, status, string(b))
					got := parseIDs(t, path, b)
					rec := lastRecord(d)
					require.NotNil(t, rec.Handle)
					require.False(t, rec.Wrong)
					h := decodeHandle(t, rec.Handle)
					r := int(h["remote_num_tokens"].(float64))
					assert.Equal(t, len(got.prompt)+len(got.gen)-1, r)
					full := append(append([]uint32(nil), got.prompt...), got.gen...)
					assert.Equal(t, sim.Chain("sim-model", full[:r]), readBlocks(t, reg, rec.Handle, d.Config().BlockSize, r))
				})
			}
		}
	}
}

// sleepClock is a virtual clock that records the modelled durations.
type sleepClock struct {
	vclock
	mu    sync.Mutex
	slept []time.Duration
}

func (c *sleepClock) Sleep(_ context.Context, d time.Duration) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.slept = append(c.slept, d)
	return nil
}

func (c *sleepClock) durations() []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]time.Duration(nil), c.slept...)
}

func renderedIDs(t *testing.T, path string, b []byte) []uint32 {
	t.Helper()
	var one struct {
		TokenIDs []uint32 `json:"token_ids"`
	}
	if path == sim.PathCompletionsRender {
		var list []json.RawMessage
		require.NoError(t, json.Unmarshal(b, &list), string(b))
		require.Len(t, list, 1)
		b = list[0]
	}
	require.NoError(t, json.Unmarshal(b, &one), string(b))
	return one.TokenIDs
}

// The render endpoints return the exact prompt ids generation uses for the
// same body, in vLLM's GenerateRequest shape.
func TestRender(t *testing.T) {
	tools := []any{map[string]any{"type": "function", "function": map[string]any{"name": "f", "parameters": map[string]any{}}}}
	hist := chat(msg{"system", "be brief"}, msg{"user", "hi"}, msg{"assistant", "<think>x</think>\n\nhello"}, msg{"user", "again"})
	tests := []struct {
		name   string
		render string
		path   string
		body   map[string]any
	}{
		{"chat", sim.PathChatRender, sim.PathChat, chat(msg{"user", "hello there"})},
		{"chat history", sim.PathChatRender, sim.PathChat, hist},
		{"chat tools", sim.PathChatRender, sim.PathChat, with(hist, "tools", tools)},
		{"chat documents", sim.PathChatRender, sim.PathChat, with(hist, "documents", []any{map[string]any{"title": "a", "text": "b"}})},
		{"chat reasoning_effort", sim.PathChatRender, sim.PathChat, with(hist, "reasoning_effort", "low")},
		{"chat truncate", sim.PathChatRender, sim.PathChat, with(hist, "truncate_prompt_tokens", 5)},
		{"chat stream", sim.PathChatRender, sim.PathChat, with(hist, "stream", true, "stream_options", map[string]any{"include_usage": true})},
		{"completions", sim.PathCompletionsRender, sim.PathCompletions, completion("once upon a time")},
		{"completions ids", sim.PathCompletionsRender, sim.PathCompletions, map[string]any{"prompt": []int{1, 2, 151645}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := start(t, nil, nil, nil)
			status, b := postRaw(t, e.url, tt.render, tt.body)
			require.Equal(t, http.StatusOK, status, string(b))
			rendered := renderedIDs(t, tt.render, b)
			assert.Equal(t, promptIDs(t, e.Config(), tt.path, tt.body), rendered)
			status, gb := postRaw(t, e.url, tt.path, with(tt.body, "return_token_ids", true, "stream", false, "stream_options", nil))
			require.Equal(t, http.StatusOK, status, string(gb))
			assert.Equal(t, parseIDs(t, tt.path, gb).prompt, rendered, "render gives the ids generation used")

			one := b
			if tt.render == sim.PathCompletionsRender {
				var list []json.RawMessage
				require.NoError(t, json.Unmarshal(b, &list))
				one = list[0]
			}
			var gr map[string]json.RawMessage
			require.NoError(t, json.Unmarshal(one, &gr))
			keys := []string{}
			for k := range gr {
				keys = append(keys, k)
			}
			assert.ElementsMatch(t, []string{"request_id", "token_ids", "features", "sampling_params", "model",
				"stream", "stream_options", "cache_salt", "priority", "kv_transfer_params"}, keys)
			assert.Equal(t, "null", string(gr["features"]))
			assert.Equal(t, "null", string(gr["kv_transfer_params"]))
			assert.Equal(t, "0", string(gr["priority"]))
			var sp map[string]any
			require.NoError(t, json.Unmarshal(gr["sampling_params"], &sp))
			assert.Contains(t, sp, "max_tokens")
			assert.Contains(t, sp, "temperature")
			var rid string
			require.NoError(t, json.Unmarshal(gr["request_id"], &rid))
			if tt.render == sim.PathChatRender {
				assert.Regexp(t, `^chatcmpl-[0-9a-f]{32}$`, rid)
			} else {
				assert.Regexp(t, `^cmpl-[0-9a-f]{32}$`, rid)
			}
		})
	}
}

func TestRenderSamplingParams(t *testing.T) {
	e := start(t, nil, nil, nil)
	body := with(chat(msg{"user", "hi"}), "max_tokens", 7, "temperature", 0.5, "stop", "x", "ignore_eos", true,
		"stream", true, "stream_options", map[string]any{"include_usage": true}, "cache_salt", "salt", "priority", 3,
		"kv_transfer_params", map[string]any{"do_remote_decode": true})
	status, b := postRaw(t, e.url, sim.PathChatRender, body)
	require.Equal(t, http.StatusOK, status, string(b))
	var gr struct {
		SamplingParams map[string]any `json:"sampling_params"`
		Model          string         `json:"model"`
		Stream         bool           `json:"stream"`
		StreamOptions  map[string]any `json:"stream_options"`
		CacheSalt      string         `json:"cache_salt"`
		Priority       int            `json:"priority"`
		KV             any            `json:"kv_transfer_params"`
	}
	require.NoError(t, json.Unmarshal(b, &gr))
	sp := gr.SamplingParams
	assert.Equal(t, 7.0, sp["max_tokens"])
	assert.Equal(t, 0.5, sp["temperature"])
	assert.Equal(t, []any{"x"}, sp["stop"])
	assert.Equal(t, true, sp["ignore_eos"])
	assert.Equal(t, 1.0, sp["output_kind"], "stream: DELTA")
	assert.Equal(t, map[string]any{"kv_transfer_params": map[string]any{"do_remote_decode": true}}, sp["extra_args"])
	assert.Nil(t, gr.KV, "the request's kv_transfer_params is not copied to the top level")
	assert.Equal(t, "sim-model", gr.Model)
	assert.True(t, gr.Stream)
	assert.Equal(t, map[string]any{"include_usage": true}, gr.StreamOptions)
	assert.Equal(t, "salt", gr.CacheSalt)
	assert.Equal(t, 3, gr.Priority)

	status, b = postRaw(t, e.url, sim.PathChatRender, chat(msg{"user", "hi"}))
	require.Equal(t, http.StatusOK, status)
	require.NoError(t, json.Unmarshal(b, &gr))
	n := len(promptIDs(t, e.Config(), sim.PathChat, chat(msg{"user", "hi"})))
	assert.Equal(t, float64(e.Config().NumBlocks*e.Config().BlockSize-n), gr.SamplingParams["max_tokens"], "max_model_len - prompt")
	assert.Equal(t, 2.0, gr.SamplingParams["output_kind"], "FINAL_ONLY")
}

func TestRenderModes(t *testing.T) {
	tests := []struct {
		mode   string
		status int
		body   string
	}{
		{sim.RenderEnabled, http.StatusOK, ""},
		{sim.RenderDisabled, http.StatusNotImplemented, `{"error":{"message":"The model does not support Chat Completions Render API","type":"NotImplementedError","param":null,"code":501}}`},
		{sim.RenderAbsent, http.StatusNotFound, `{"detail":"Not Found"}`},
	}
	for _, tt := range tests {
		t.Run(tt.mode, func(t *testing.T) {
			e := start(t, nil, nil, func(c *sim.Config) { c.Render = tt.mode })
			status, b := postRaw(t, e.url, sim.PathChatRender, chat(msg{"user", "hi"}))
			assert.Equal(t, tt.status, status)
			if tt.body != "" {
				assert.JSONEq(t, tt.body, string(b))
			}
			status, _ = postRaw(t, e.url, sim.PathCompletionsRender, completion("hi"))
			assert.Equal(t, tt.status, status)
			status, _ = postRaw(t, e.url, sim.PathTokenize, completion("hi"))
			assert.Equal(t, http.StatusOK, status, "/tokenize is served in every mode")
		})
	}
	_, err := sim.New(func() sim.Config { c := sim.DefaultConfig(); c.Render = "maybe"; return c }())
	assert.ErrorIs(t, err, sim.ErrInvalidConfig)
}

func TestRenderErrors(t *testing.T) {
	e := start(t, nil, nil, nil)
	tests := []struct {
		name   string
		path   string
		body   any
		status int
	}{
		{"no messages", sim.PathChatRender, map[string]any{"model": "sim-model"}, http.StatusBadRequest},
		{"bad json", sim.PathChatRender, []byte("{"), http.StatusBadRequest},
		{"wrong model", sim.PathChatRender, with(chat(msg{"user", "hi"}), "model", "other"), http.StatusNotFound},
		{"no prompt", sim.PathCompletionsRender, map[string]any{}, http.StatusBadRequest},
		{"tokenize wrong model", sim.PathTokenize, with(completion("hi"), "model", "other"), http.StatusNotFound},
		{"tokenize bad", sim.PathTokenize, []byte("[]"), http.StatusBadRequest},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			status, b := postRaw(t, e.url, tt.path, tt.body)
			assert.Equal(t, tt.status, status, string(b))
			assert.Contains(t, string(b), `"error"`)
		})
	}
	resp, err := http.Get(e.url + sim.PathChatRender)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusMethodNotAllowed, resp.StatusCode)
}

// /tokenize applies a reduced field set: bodies using documents or
// reasoning_effort tokenize differently from what chat renders.
func TestTokenizeEndpoint(t *testing.T) {
	e := start(t, nil, nil, nil)
	base := chat(msg{"user", "hello there"}, msg{"assistant", "hi"}, msg{"user", "more"})
	tools := []any{map[string]any{"type": "function", "function": map[string]any{"name": "f"}}}
	tests := []struct {
		name string
		body map[string]any
		same bool
	}{
		{"plain", base, true},
		{"tools", with(base, "tools", tools), true},
		{"kwargs", with(base, "chat_template_kwargs", map[string]any{"x": 1}), true},
		{"no generation prompt", with(base, "add_generation_prompt", false), true},
		{"special tokens", with(base, "add_special_tokens", true), true},
		{"documents", with(base, "documents", []any{map[string]any{"text": "d"}}), false},
		{"reasoning_effort", with(base, "reasoning_effort", "high"), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			status, b := postRaw(t, e.url, sim.PathTokenize, tt.body)
			require.Equal(t, http.StatusOK, status, string(b))
			var out struct {
				Count       int      `json:"count"`
				MaxModelLen int      `json:"max_model_len"`
				Tokens      []uint32 `json:"tokens"`
				TokenStrs   []string `json:"token_strs"`
			}
			require.NoError(t, json.Unmarshal(b, &out))
			assert.Len(t, out.Tokens, out.Count)
			assert.Equal(t, e.Config().NumBlocks*e.Config().BlockSize, out.MaxModelLen)
			assert.Nil(t, out.TokenStrs)
			assert.Contains(t, string(b), `"token_strs":null`)
			status, rb := postRaw(t, e.url, sim.PathChatRender, tt.body)
			require.Equal(t, http.StatusOK, status)
			if tt.same {
				assert.Equal(t, renderedIDs(t, sim.PathChatRender, rb), out.Tokens)
			} else {
				assert.NotEqual(t, renderedIDs(t, sim.PathChatRender, rb), out.Tokens)
			}
		})
	}

	status, b := postRaw(t, e.url, sim.PathTokenize, with(completion("once upon a time"), "return_token_strs", true))
	require.Equal(t, http.StatusOK, status, string(b))
	var out struct {
		Tokens    []uint32 `json:"tokens"`
		TokenStrs []string `json:"token_strs"`
	}
	require.NoError(t, json.Unmarshal(b, &out))
	assert.Equal(t, promptIDs(t, e.Config(), sim.PathCompletions, completion("once upon a time")), out.Tokens)
	assert.Equal(t, []string{"once", " upon", " a", " time"}, out.TokenStrs)
}

// Render and tokenize calls sleep Profile.Render(n), count in their own
// stats (not in Requests) and are recorded.
func TestRenderCostAndStats(t *testing.T) {
	clk := &sleepClock{vclock: vclock{now: time.Unix(1_700_000_000, 0)}}
	prof := sim.Profile{RenderOverhead: time.Millisecond, RenderPerToken: time.Microsecond}
	e := start(t, nil, clk, func(c *sim.Config) { c.Profile = prof })
	body := chat(msg{"user", "hello there"})
	n := len(promptIDs(t, e.Config(), sim.PathChat, body))
	for _, path := range []string{sim.PathChatRender, sim.PathTokenize, sim.PathTokenize} {
		status, b := postRaw(t, e.url, path, body)
		require.Equal(t, http.StatusOK, status, string(b))
	}
	assert.Equal(t, []time.Duration{prof.Render(n), prof.Render(n), prof.Render(n)}, clk.durations())
	st := e.Stats()
	assert.Equal(t, 1, st.RenderRequests)
	assert.Equal(t, 2, st.TokenizeRequests)
	assert.Zero(t, st.Requests)
	recs := e.Records()
	require.Len(t, recs, 3)
	assert.Equal(t, []string{sim.RoleRender, sim.RoleTokenize, sim.RoleTokenize}, []string{recs[0].Role, recs[1].Role, recs[2].Role})
	assert.Equal(t, n, recs[0].PromptTokens)
	assert.Equal(t, http.StatusOK, recs[0].Status)
}

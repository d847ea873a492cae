package sim_test

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// Logprobs as vLLM's OpenAI server shapes them
// (chat_completion/serving.py _create_chat_logprobs, _get_top_logprobs;
// completion/serving.py _create_completion_logprobs; the engine's dict per
// position, v1/engine/logprobs.py _make_logprob_dict: the sampled token
// first).

type chatLP struct {
	Token       string  `json:"token"`
	Logprob     float64 `json:"logprob"`
	Bytes       []int   `json:"bytes"`
	TopLogprobs []struct {
		Token   string  `json:"token"`
		Logprob float64 `json:"logprob"`
		Bytes   []int   `json:"bytes"`
	} `json:"top_logprobs"`
}

type completionLP struct {
	TextOffset    []int                `json:"text_offset"`
	TokenLogprobs []float64            `json:"token_logprobs"`
	Tokens        []string             `json:"tokens"`
	TopLogprobs   []map[string]float64 `json:"top_logprobs"`
}

// choiceLogprobs returns choices[0].logprobs of a non-streaming answer,
// raw.
func choiceLogprobs(t *testing.T, body []byte) json.RawMessage {
	t.Helper()
	var out struct {
		Choices []struct {
			Logprobs json.RawMessage `json:"logprobs"`
		} `json:"choices"`
	}
	require.NoError(t, json.Unmarshal(body, &out), string(body))
	require.NotEmpty(t, out.Choices)
	return out.Choices[0].Logprobs
}

// streamAt posts a streaming body to path and returns its data events.
func streamAt(t *testing.T, url, path string, body any) []string {
	t.Helper()
	raw, _ := json.Marshal(body)
	resp, err := http.Post(url+path, "application/json", bytes.NewReader(raw))
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	s := readSSE(t, resp.Body)
	require.True(t, s.done)
	return s.events
}

// chunkLogprobs returns choices[0].logprobs of each chunk that has a
// choice.
func chunkLogprobs(t *testing.T, events []string) []json.RawMessage {
	t.Helper()
	var out []json.RawMessage
	for _, ev := range events {
		var c struct {
			Choices []struct {
				Logprobs json.RawMessage `json:"logprobs"`
			} `json:"choices"`
		}
		require.NoError(t, json.Unmarshal([]byte(ev), &c), ev)
		if len(c.Choices) > 0 {
			out = append(out, c.Choices[0].Logprobs)
		}
	}
	return out
}

func TestChatLogprobs(t *testing.T) {
	e := start(t, nil, nil, nil)
	body := with(chat(msg{"user", words("logprobs", 30)}), "logprobs", true, "top_logprobs", 3)
	r := post(t, e.url, sim.PathChat, body)
	require.Equal(t, http.StatusOK, r.Status, string(r.Body))
	raw := choiceLogprobs(t, r.Body)
	var lp struct{ Content []chatLP }
	require.NoError(t, json.Unmarshal(raw, &lp))
	require.Len(t, lp.Content, r.Complete, "one entry per generated token, EOS included")
	var text strings.Builder
	for i, c := range lp.Content {
		assert.Equal(t, textBytes(c.Token), c.Bytes, "bytes: the token's UTF-8")
		require.Len(t, c.TopLogprobs, 3)
		assert.Equal(t, c.Token, c.TopLogprobs[0].Token, "the sampled token first")
		assert.Equal(t, c.Logprob, c.TopLogprobs[0].Logprob)
		assert.Negative(t, c.Logprob)
		for j := 1; j < 3; j++ {
			assert.Less(t, c.TopLogprobs[j].Logprob, c.TopLogprobs[j-1].Logprob, "rank order")
			assert.NotEqual(t, c.Token, c.TopLogprobs[j].Token)
		}
		if i < len(lp.Content)-1 {
			text.WriteString(c.Token)
		}
	}
	assert.Equal(t, r.Text, text.String(), "the tokens spell the reply")
	assert.Equal(t, sim.TokIMEnd, lp.Content[len(lp.Content)-1].Token, "EOS with special tokens kept")
	assert.Contains(t, string(raw), `{"token":`, "keys in vLLM's order")

	ref, err := kvroutetest.Reference(kvroutetest.PathChat, mustJSON(t, body))
	require.NoError(t, err)
	assert.Equal(t, string(ref.Logprobs), string(raw), "Reference agrees byte for byte")

	// top_logprobs 0 (the default): the sampled token, no alternatives
	r = post(t, e.url, sim.PathChat, with(chat(msg{"user", "hi"}), "logprobs", true))
	var zero struct{ Content []chatLP }
	require.NoError(t, json.Unmarshal(choiceLogprobs(t, r.Body), &zero))
	assert.Empty(t, zero.Content[0].TopLogprobs)
	assert.Contains(t, string(choiceLogprobs(t, r.Body)), `"top_logprobs":[]`)

	// not asked: null
	r = post(t, e.url, sim.PathChat, chat(msg{"user", "hi"}))
	assert.Equal(t, "null", string(choiceLogprobs(t, r.Body)))
}

// A chat stream carries each token's entry in its chunk: the entries of
// the chunks are the non-streaming answer's, byte for byte; the role chunk
// carries null.
func TestChatLogprobsStream(t *testing.T) {
	e := start(t, nil, nil, nil)
	body := with(chat(msg{"user", words("stream logprobs", 30)}), "logprobs", true, "top_logprobs", 5)
	whole := post(t, e.url, sim.PathChat, body)
	var lp struct{ Content []json.RawMessage }
	require.NoError(t, json.Unmarshal(choiceLogprobs(t, whole.Body), &lp))

	chunks := chunkLogprobs(t, streamAt(t, e.url, sim.PathChat, with(body, "stream", true)))
	require.Equal(t, "null", string(chunks[0]), "the role chunk")
	var streamed []json.RawMessage
	for _, c := range chunks[1:] {
		var one struct{ Content []json.RawMessage }
		require.NoError(t, json.Unmarshal(c, &one), string(c))
		require.Len(t, one.Content, 1, "one token a chunk")
		streamed = append(streamed, one.Content...)
	}
	require.Equal(t, len(lp.Content), len(streamed))
	for i := range streamed {
		assert.Equal(t, string(lp.Content[i]), string(streamed[i]))
	}
}

func TestCompletionLogprobs(t *testing.T) {
	e := start(t, nil, nil, nil)
	body := map[string]any{"model": "sim-model", "prompt": words("complete", 20), "max_tokens": 12, "logprobs": 2}
	r := post(t, e.url, sim.PathCompletions, body)
	require.Equal(t, http.StatusOK, r.Status, string(r.Body))
	raw := choiceLogprobs(t, r.Body)
	var lp completionLP
	require.NoError(t, json.Unmarshal(raw, &lp))
	require.Len(t, lp.Tokens, r.Complete)
	require.Len(t, lp.TokenLogprobs, r.Complete)
	require.Len(t, lp.TopLogprobs, r.Complete)
	off := 0
	for i, tok := range lp.Tokens {
		assert.Equal(t, off, lp.TextOffset[i], "offsets: the lengths of the tokens before")
		off += utf8.RuneCountInString(tok)
		require.Len(t, lp.TopLogprobs[i], 2, "logprobs 2: two entries (the sampled token is the most likely)")
		assert.Equal(t, lp.TokenLogprobs[i], lp.TopLogprobs[i][tok])
	}
	assert.Equal(t, r.Text, strings.TrimSuffix(strings.Join(lp.Tokens, ""), sim.TokIMEnd), "the tokens spell the text (and EOS)")
	// the dict's keys in Python's insertion order: the sampled token first
	first, _ := json.Marshal(lp.Tokens[0])
	assert.Contains(t, string(raw), `"top_logprobs":[{`+string(first)+`:`)

	ref, err := kvroutetest.Reference(kvroutetest.PathCompletions, mustJSON(t, body))
	require.NoError(t, err)
	assert.Equal(t, string(ref.Logprobs), string(raw))

	// streamed: the same tokens and logprobs, offsets from the text sent
	chunks := chunkLogprobs(t, streamAt(t, e.url, sim.PathCompletions, with(body, "stream", true)))
	var toks []string
	sent := 0
	for _, c := range chunks {
		var one completionLP
		require.NoError(t, json.Unmarshal(c, &one), string(c))
		require.Len(t, one.Tokens, 1)
		assert.Equal(t, []int{sent}, one.TextOffset)
		assert.Equal(t, lp.TokenLogprobs[len(toks)], one.TokenLogprobs[0])
		toks = append(toks, one.Tokens...)
		sent += utf8.RuneCountInString(one.Tokens[0])
	}
	assert.Equal(t, lp.Tokens, toks)

	// logprobs 0: the sampled token's entry alone
	r = post(t, e.url, sim.PathCompletions, with(body, "logprobs", 0))
	var zero completionLP
	require.NoError(t, json.Unmarshal(choiceLogprobs(t, r.Body), &zero))
	assert.Len(t, zero.TopLogprobs[0], 1)
}

// Requests vLLM refuses (ChatCompletionRequest and CompletionRequest
// check_logprobs; the input processor's max_logprobs, 20 by default).
func TestLogprobsValidation(t *testing.T) {
	e := start(t, nil, nil, nil)
	hi := chat(msg{"user", "hi"})
	for name, tc := range map[string]struct {
		path string
		body map[string]any
		msg  string
	}{
		"top_logprobs without logprobs": {sim.PathChat, with(hi, "top_logprobs", 2), "when using `top_logprobs`, `logprobs` must be set to true."},
		"top_logprobs negative":         {sim.PathChat, with(hi, "logprobs", true, "top_logprobs", -2), "`top_logprobs` must be a positive value or -1."},
		"top_logprobs over the max":     {sim.PathChat, with(hi, "logprobs", true, "top_logprobs", 21), "Requested sample logprobs of 21, which is greater than max allowed: 20"},
		"top_logprobs -1 (vocabulary)":  {sim.PathChat, with(hi, "logprobs", true, "top_logprobs", -1), "which is greater than max allowed: 20"},
		"completions negative":          {sim.PathCompletions, map[string]any{"prompt": "hi", "logprobs": -3}, "`logprobs` must be a positive value or -1."},
		"completions over the max":      {sim.PathCompletions, map[string]any{"prompt": "hi", "logprobs": 30}, "Requested sample logprobs of 30"},
	} {
		t.Run(name, func(t *testing.T) {
			r := post(t, e.url, tc.path, tc.body)
			assert.Equal(t, http.StatusBadRequest, r.Status)
			assert.Contains(t, string(r.Body), tc.msg)
		})
	}
	r := post(t, e.url, sim.PathChat, with(hi, "logprobs", true, "top_logprobs", 20))
	assert.Equal(t, http.StatusOK, r.Status, "20 is allowed")
}

// Disaggregated, D's logprobs are a single engine's: they come from the KV
// D holds, so a correct read gives the reference's bytes, and top_logprobs
// 20 makes answers large (about 1.4 KB a token).
func TestLogprobsDisaggregated(t *testing.T) {
	reg := sim.NewRegistry()
	p := start(t, reg, nil, nil)
	d := start(t, reg, nil, nil)
	single := start(t, nil, nil, nil)
	body := with(chat(msg{"user", words("disaggregated", 200)}), "logprobs", true, "top_logprobs", 20, "max_tokens", 40, "ignore_eos", true)
	rp := post(t, p.url, sim.PathChat, with(body, "max_tokens", 1, "kv_transfer_params", missHandle()))
	require.NotNil(t, rp.KV)
	rd := post(t, d.url, sim.PathChat, with(body, "kv_transfer_params", rp.KV))
	require.Equal(t, http.StatusOK, rd.Status)
	assert.Equal(t, sim.PullRead, lastRecord(d).Pull)
	want := choiceLogprobs(t, post(t, single.url, sim.PathChat, body).Body)
	assert.Equal(t, string(want), string(choiceLogprobs(t, rd.Body)))
	assert.Greater(t, len(rd.Body), 40*1200, "a large answer")
}

func textBytes(s string) []int {
	out := []int{}
	for _, b := range []byte(s) {
		out = append(out, int(b))
	}
	return out
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return b
}

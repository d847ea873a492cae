package sim_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
)

func TestPlainMatchesReference(t *testing.T) {
	e := start(t, nil, nil, nil)
	tests := []struct {
		name string
		path string
		body map[string]any
	}{
		{"chat", sim.PathChat, chat(msg{"user", "hello there"})},
		{"chat max_tokens", sim.PathChat, with(chat(msg{"user", "hello there"}), "max_tokens", 3)},
		{"completions", sim.PathCompletions, map[string]any{"model": "sim-model", "prompt": "once upon a time"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := post(t, e.url, tt.path, tt.body)
			require.Equal(t, http.StatusOK, r.Status, string(r.Body))
			ref := reference(t, tt.path, tt.body)
			want := ref.Content
			if tt.path == sim.PathCompletions {
				want = sim.RawText(ref)
			}
			assert.Equal(t, want, r.Text)
			assert.Equal(t, ref.Finish, r.Finish)
			assert.Equal(t, len(ref.Tokens), r.Complete)
			assert.Nil(t, r.KV, "plain requests carry kv_transfer_params: null")
			assert.Contains(t, string(r.Body), `"kv_transfer_params":null`)
		})
	}
	st := e.Stats()
	assert.Equal(t, 3, st.PlainRequests)
	assert.Zero(t, st.WrongOutputs)
	assert.Zero(t, st.BlocksPinned)
}

func TestMaxTokensGivesLength(t *testing.T) {
	e := start(t, nil, nil, nil)
	r := post(t, e.url, sim.PathChat, with(chat(msg{"user", "hi"}), "max_completion_tokens", 2))
	require.Equal(t, http.StatusOK, r.Status)
	assert.Equal(t, "length", r.Finish)
	assert.Equal(t, 2, r.Complete)
	assert.Len(t, strings.Fields(r.Text), 2)
}

func decodeHandle(t *testing.T, raw json.RawMessage) map[string]any {
	t.Helper()
	var m map[string]any
	require.NoError(t, json.Unmarshal(raw, &m))
	return m
}

var handleKeys = []string{"do_remote_decode", "do_remote_prefill", "remote_block_ids", "remote_engine_id",
	"remote_request_id", "remote_host", "remote_port", "tp_size", "remote_num_tokens",
	"remote_blocks_expiry_time", "dcp_size", "pp_size", "transfer_mode"}

// A hand-driven P→D turn and a D→P→D second turn (the two flows of the
// docs/kvroute.md).
func TestDisaggregatedTwoTurns(t *testing.T) {
	reg := sim.NewRegistry()
	clk := newClock()
	// P without prefix caching, as in the published benchmark.
	p := start(t, reg, clk, func(c *sim.Config) { c.PrefixCaching = false })
	d := start(t, reg, clk, nil)
	d2 := start(t, reg, clk, nil)

	turn1 := chat(msg{"user", words("first", 100)})
	rp := post(t, p.url, sim.PathChat, with(turn1, "max_tokens", 1, "stream", false, "kv_transfer_params", missHandle()))
	require.Equal(t, http.StatusOK, rp.Status, string(rp.Body))
	require.NotNil(t, rp.KV)
	ph := decodeHandle(t, rp.KV)
	for _, k := range handleKeys {
		assert.Contains(t, ph, k)
	}
	assert.Equal(t, true, ph["do_remote_prefill"])
	assert.Equal(t, false, ph["do_remote_decode"])
	assert.Equal(t, p.EngineID(), ph["remote_engine_id"])
	host, port := p.SideChannel()
	assert.Equal(t, host, ph["remote_host"])
	assert.EqualValues(t, port, ph["remote_port"])
	assert.NotContains(t, p.url, fmt.Sprintf("%s:%d", host, port), "side channel differs from HTTP")
	assert.EqualValues(t, rp.Prompt, ph["remote_num_tokens"])
	assert.Equal(t, "pull", ph["transfer_mode"])
	blocks := ph["remote_block_ids"].([]any)
	require.Len(t, blocks, 1, "one KV group")
	assert.Len(t, blocks[0].([]any), (rp.Prompt+15)/16)
	assert.Equal(t, 1, p.Stats().BlocksPinned/len(blocks[0].([]any)), "P holds its blocks for D")

	rd := post(t, d.url, sim.PathChat, with(turn1, "kv_transfer_params", rp.KV))
	require.Equal(t, http.StatusOK, rd.Status, string(rd.Body))
	assert.Equal(t, reference(t, sim.PathChat, turn1).Content, rd.Text)
	assert.Zero(t, p.Stats().BlocksPinned, "P frees once D read")
	assert.Equal(t, rp.Prompt, d.Stats().TokensPulledIn)
	assert.Equal(t, rp.Prompt, p.Stats().TokensPulledOut)
	require.NotNil(t, rd.KV)
	dh := decodeHandle(t, rd.KV)
	assert.Equal(t, true, dh["do_remote_decode"])
	assert.Equal(t, d.EngineID(), dh["remote_engine_id"])
	assert.EqualValues(t, rd.Prompt+rd.Complete-1, dh["remote_num_tokens"])
	exp := dh["remote_blocks_expiry_time"].(float64)
	assert.InDelta(t, d.Mono()+480, exp, 0.001, "expiry on D's monotonic clock")
	assert.Less(t, exp, float64(clk.Now().Unix()), "not Unix time")

	// Turn 2 on P with D's handle: P reads what it lacks from D.
	turn2 := chat(msg{"user", words("first", 100)}, msg{"assistant", rd.Text}, msg{"user", words("second", 120)})
	rp2 := post(t, p.url, sim.PathChat, with(turn2, "max_tokens", 1, "kv_transfer_params", asP(t, rd.KV)))
	require.Equal(t, http.StatusOK, rp2.Status, string(rp2.Body))
	recP := p.Records()[1]
	assert.Equal(t, sim.PullRead, recP.Pull)
	assert.Zero(t, recP.CachedTokens)
	assert.Equal(t, rd.Prompt+rd.Complete-1, recP.PulledTokens)
	assert.Equal(t, rp2.Prompt-recP.PulledTokens, recP.ComputedTokens)
	assert.Zero(t, d.Stats().BlocksPinned, "D frees once P read")

	// The same D pulls only the new suffix; another D pulls everything.
	rd2 := post(t, d.url, sim.PathChat, with(turn2, "kv_transfer_params", rp2.KV))
	require.Equal(t, http.StatusOK, rd2.Status, string(rd2.Body))
	assert.Equal(t, reference(t, sim.PathChat, turn2).Content, rd2.Text)
	recD := d.Records()[1]
	assert.Greater(t, recD.CachedTokens, rp.Prompt-16)
	assert.Equal(t, rp2.Prompt-recD.CachedTokens, recD.PulledTokens)

	rp3 := post(t, p.url, sim.PathChat, with(turn2, "max_tokens", 1, "kv_transfer_params", missHandle()))
	require.Equal(t, http.StatusOK, rp3.Status)
	rd3 := post(t, d2.url, sim.PathChat, with(turn2, "kv_transfer_params", rp3.KV))
	require.Equal(t, http.StatusOK, rd3.Status)
	assert.Equal(t, rd2.Text, rd3.Text)
	assert.Equal(t, rp3.Prompt, d2.Records()[0].PulledTokens)
	for _, e := range []*node{p, d, d2} {
		assert.Zero(t, e.Stats().WrongOutputs)
		assert.Zero(t, e.Stats().FreedReads)
	}
}

// A miss handle sent to D makes it act as a prefiller: the router bug of
// Message 4 of the kvroute Wire protocol.
func TestMissHandleToDecodeActsAsPrefill(t *testing.T) {
	d := start(t, nil, nil, nil)
	r := post(t, d.url, sim.PathChat, with(chat(msg{"user", "hi"}), "max_tokens", 5, "kv_transfer_params", missHandle()))
	require.Equal(t, http.StatusOK, r.Status)
	require.NotNil(t, r.KV)
	assert.Equal(t, true, decodeHandle(t, r.KV)["do_remote_prefill"])
	assert.Equal(t, sim.RolePrefill, d.Records()[0].Role)
	assert.Equal(t, 1, d.Stats().PrefillRequests)
}

// P emits a handle only when it stopped on max_tokens, as vLLM's
// NixlConnector (FINISHED_LENGTH_CAPPED) does.
// An older engine's P emits no handle when it stopped on EOS.
func TestPrefillWithoutMaxTokensEmitsNoHandle(t *testing.T) {
	p := start(t, nil, nil, func(c *sim.Config) { c.PrefillHandleOnLengthOnly = true })
	r := post(t, p.url, sim.PathChat, with(chat(msg{"user", "hi"}), "kv_transfer_params", missHandle()))
	require.Equal(t, http.StatusOK, r.Status)
	assert.Equal(t, "stop", r.Finish)
	assert.Nil(t, r.KV)
	assert.Zero(t, p.Stats().BlocksPinned)
}

// Current vLLM's P emits its handle on a normal stop too (EOS or a stop
// string), not only on the length cap.
func TestPrefillHandleOnStop(t *testing.T) {
	body := chat(msg{"user", "hi"})
	ref := reference(t, sim.PathChat, body)
	tests := []struct {
		name  string
		extra []any
	}{
		{"eos", nil},
		{"stop string", []any{"stop", ref.Tokens[0].Text}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := start(t, nil, nil, nil)
			r := post(t, p.url, sim.PathChat, with(with(body, tt.extra...), "kv_transfer_params", missHandle()))
			require.Equal(t, http.StatusOK, r.Status)
			assert.Equal(t, "stop", r.Finish)
			require.NotNil(t, r.KV)
			assert.Positive(t, p.Stats().BlocksPinned)
		})
	}
}

type sse struct {
	events []string
	done   bool
}

func readSSE(t *testing.T, body io.Reader) sse {
	t.Helper()
	var out sse
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "data: ") {
			continue
		}
		data := strings.TrimPrefix(line, "data: ")
		if data == "[DONE]" {
			out.done = true
			continue
		}
		out.events = append(out.events, data)
	}
	return out
}

func stream(t *testing.T, url string, body any) (sse, http.Header) {
	t.Helper()
	raw, _ := json.Marshal(body)
	resp, err := http.Post(url+sim.PathChat, "application/json", bytes.NewReader(raw))
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	return readSSE(t, resp.Body), resp.Header
}

func TestStreams(t *testing.T) {
	for _, handles := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream handles %v", handles), func(t *testing.T) {
			reg := sim.NewRegistry()
			mod := func(c *sim.Config) { c.StreamHandles = handles }
			p := start(t, reg, nil, mod)
			d := start(t, reg, nil, mod)
			body := chat(msg{"user", words("stream", 40)})
			rp := post(t, p.url, sim.PathChat, with(body, "max_tokens", 1, "kv_transfer_params", missHandle()))
			require.NotNil(t, rp.KV)
			s, hdr := stream(t, d.url, with(body, "stream", true, "stream_options", map[string]any{"include_usage": true}, "kv_transfer_params", rp.KV))
			assert.Contains(t, hdr.Get("Content-Type"), "text/event-stream")
			require.True(t, s.done, "ends with [DONE]")
			require.GreaterOrEqual(t, len(s.events), 3)

			type ch struct {
				Object  string `json:"object"`
				Choices []struct {
					Delta struct {
						Role    string  `json:"role"`
						Content *string `json:"content"`
					} `json:"delta"`
					FinishReason *string `json:"finish_reason"`
				} `json:"choices"`
				Usage *struct {
					CompletionTokens int `json:"completion_tokens"`
				} `json:"usage"`
				KV json.RawMessage `json:"kv_transfer_params"`
			}
			var chunks []ch
			var text strings.Builder
			handleAt := -1
			for i, ev := range s.events {
				var c ch
				require.NoError(t, json.Unmarshal([]byte(ev), &c))
				assert.Equal(t, "chat.completion.chunk", c.Object)
				if c.KV != nil {
					handleAt = i
				}
				for _, choice := range c.Choices {
					if choice.Delta.Content != nil {
						text.WriteString(*choice.Delta.Content)
					}
				}
				chunks = append(chunks, c)
			}
			assert.Equal(t, "assistant", chunks[0].Choices[0].Delta.Role, "role chunk first")
			usage := chunks[len(chunks)-1]
			require.NotNil(t, usage.Usage, "usage chunk last")
			assert.Empty(t, usage.Choices)
			fin := chunks[len(chunks)-2]
			require.NotNil(t, fin.Choices[0].FinishReason)
			assert.Equal(t, "stop", *fin.Choices[0].FinishReason)
			assert.Equal(t, reference(t, sim.PathChat, body).Content, text.String())
			if handles {
				assert.Equal(t, len(chunks)-2, handleAt, "#40186: handle on the final chunk")
				assert.Equal(t, true, decodeHandle(t, fin.KV)["do_remote_decode"])
			} else {
				assert.Equal(t, -1, handleAt, "stock: no handle in any chunk")
			}
			assert.Equal(t, 1, d.Stats().HandlesEmitted, "D holds blocks either way")
		})
	}
}

func TestStreamWithoutUsage(t *testing.T) {
	e := start(t, nil, nil, nil)
	s, _ := stream(t, e.url, with(chat(msg{"user", "hi"}), "stream", true, "stream_options", map[string]any{"include_usage": false}))
	require.True(t, s.done)
	for _, ev := range s.events {
		assert.NotContains(t, ev, `"usage"`)
	}
}

func TestRequestLog(t *testing.T) {
	e := start(t, nil, nil, nil)
	raw := []byte(`{"messages":[{"role":"user","content":"hi"}]}`)
	req, _ := http.NewRequest(http.MethodPost, e.url+sim.PathChat, bytes.NewReader(raw))
	req.Header.Set("X-Request-Id", "req-42")
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	var body struct{ ID string }
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&body))
	resp.Body.Close()
	assert.Equal(t, "chatcmpl-req-42", body.ID)
	recs := e.Records()
	require.Len(t, recs, 1)
	assert.Equal(t, sim.PathChat, recs[0].Path)
	assert.Equal(t, "req-42", recs[0].RequestID)
	assert.Equal(t, "req-42", recs[0].Header.Get("X-Request-Id"))
	assert.Equal(t, raw, recs[0].Body)
	assert.Equal(t, sim.RolePlain, recs[0].Role)
	assert.Equal(t, http.StatusOK, recs[0].Status)
	assert.True(t, strings.HasPrefix(recs[0].EngineRequestID, "chatcmpl-req-42-"))
}

func TestEndpointsAndErrors(t *testing.T) {
	e := start(t, nil, nil, nil)
	resp, err := http.Get(e.url + "/health")
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode)

	resp, err = http.Get(e.url + "/v1/models")
	require.NoError(t, err)
	var models struct {
		Object string
		Data   []struct{ ID, Object string }
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&models))
	resp.Body.Close()
	assert.Equal(t, "list", models.Object)
	require.Len(t, models.Data, 1)
	assert.Equal(t, "sim-model", models.Data[0].ID)

	type errBody struct {
		Error struct {
			Message string  `json:"message"`
			Type    string  `json:"type"`
			Param   *string `json:"param"`
			Code    int     `json:"code"`
		} `json:"error"`
	}
	tests := []struct {
		name   string
		body   string
		status int
		typ    string
	}{
		{"bad json", `{`, 400, "BadRequestError"},
		{"no messages", `{"model":"sim-model"}`, 400, "BadRequestError"},
		{"unknown model", `{"model":"other","messages":[{"role":"user","content":"x"}]}`, 404, "NotFoundError"},
		{"max_tokens 0", `{"messages":[{"role":"user","content":"x"}],"max_tokens":0}`, 400, "BadRequestError"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := post(t, e.url, sim.PathChat, []byte(tt.body))
			require.Equal(t, tt.status, r.Status)
			var b errBody
			require.NoError(t, json.Unmarshal(r.Body, &b))
			assert.Equal(t, tt.typ, b.Error.Type)
			assert.Equal(t, tt.status, b.Error.Code)
			assert.NotEmpty(t, b.Error.Message)
		})
	}
}

func TestConcurrentRequests(t *testing.T) {
	reg := sim.NewRegistry()
	p := start(t, reg, nil, nil)
	d := start(t, reg, nil, nil)
	const n = 16
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		go func() {
			body := chat(msg{"user", words(fmt.Sprintf("user%d", i), 50+i)})
			raw, _ := json.Marshal(with(body, "max_tokens", 1, "kv_transfer_params", missHandle()))
			resp, err := http.Post(p.url+sim.PathChat, "application/json", bytes.NewReader(raw))
			if err != nil {
				errs <- err
				return
			}
			var pr struct {
				KV json.RawMessage `json:"kv_transfer_params"`
			}
			err = json.NewDecoder(resp.Body).Decode(&pr)
			resp.Body.Close()
			if err != nil {
				errs <- err
				return
			}
			raw, _ = json.Marshal(with(body, "kv_transfer_params", pr.KV))
			resp, err = http.Post(d.url+sim.PathChat, "application/json", bytes.NewReader(raw))
			if err == nil {
				resp.Body.Close()
			}
			errs <- err
		}()
	}
	for i := 0; i < n; i++ {
		require.NoError(t, <-errs)
	}
	assert.Zero(t, d.Stats().WrongOutputs)
	assert.Equal(t, n, d.Stats().DecodeRequests)
	assert.Zero(t, p.Stats().BlocksPinned)
}

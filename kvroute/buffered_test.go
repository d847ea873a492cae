package kvroute_test

import (
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// clientStream is what a client reassembles from a stream of any API: the
// text, the reasoning, the finish, and whether the stream ended with its
// final event.
type clientStream struct {
	text, reasoning, finish string
	usage, done             bool
}

func readStream(t testing.TB, raw []byte) clientStream {
	t.Helper()
	var a clientStream
	var text, reasoning strings.Builder
	for data := range sseData(raw) {
		if data == "[DONE]" {
			a.done = true
			continue
		}
		var ev struct {
			Type    string
			Choices []struct {
				Index int
				Text  string
				Delta struct {
					Content, Reasoning, ReasoningContent string `json:",omitempty"`
				}
				FinishReason *string `json:"finish_reason"`
			}
			Delta struct {
				Type, Text, Thinking string
				StopReason           string `json:"stop_reason"`
			}
			Usage json.RawMessage
			Error json.RawMessage
		}
		require.NoError(t, json.Unmarshal([]byte(data), &ev), "%s", data)
		require.Nil(t, ev.Error, "an error event: %s", data)
		for _, c := range ev.Choices {
			if c.Index != 0 {
				continue // the reference is choice 0's
			}
			text.WriteString(c.Delta.Content + c.Text)
			reasoning.WriteString(c.Delta.Reasoning + c.Delta.ReasoningContent)
			if c.FinishReason != nil {
				a.finish = *c.FinishReason
			}
		}
		if ev.Choices != nil && len(ev.Choices) == 0 && len(ev.Usage) > 0 {
			a.usage = true
		}
		switch ev.Type {
		case "content_block_delta":
			text.WriteString(ev.Delta.Text)
			reasoning.WriteString(ev.Delta.Thinking)
		case "message_delta":
			a.finish = map[string]string{"end_turn": "stop", "max_tokens": "length"}[ev.Delta.StopReason]
		case "message_stop":
			a.done = true
		}
	}
	a.text, a.reasoning = text.String(), reasoning.String()
	return a
}

// bufferedBody is turn i of a conversation of the API at path (extra
// members added), streamed, each earlier turn's reply the one its answer
// gave.
func bufferedBody(t *testing.T, path string, turn int, replies []string, extra map[string]any) []byte {
	t.Helper()
	return convBody(t, path, true, turn, 24, func(i int) string { return replies[i] }, extra)
}

// Issue 24, item 3: with WithDecodeMemory's BufferStreams, a streamed turn
// whose decode engine's streams of the API carry no handle runs its decode
// leg non-streaming and reaches the client as the API's own stream: every
// answer is the single engine's, every later turn reuses KV, and an engine
// that streams its handle (vLLM PR #40186) keeps real streaming. Messages
// streams are always buffered; a chat or completions stream is buffered
// once one stream of that API showed the engine's streams carry no handle.
// Without BufferStreams nothing changes: a stock stream never reuses.
func TestBufferedStreams(t *testing.T) {
	all := []string{kvroute.PathChatCompletions, kvroute.PathCompletions, kvroute.PathMessages}
	usage := map[string]any{"stream_options": map[string]any{"include_usage": true}}
	for _, tc := range []struct {
		name     string
		path     string
		buffer   []string
		engine   []kvroutetest.Option
		extra    map[string]any
		buffered []bool // per turn
		hits     []bool // per turn
	}{
		{name: "messages", path: kvroute.PathMessages, buffer: all,
			buffered: []bool{true, true, true, true, true}, hits: []bool{false, true, true, true, true}},
		{name: "messages thinking", path: kvroute.PathMessages, buffer: []string{kvroute.PathMessages},
			engine:   []kvroutetest.Option{kvroutetest.WithReasoning(true)},
			buffered: []bool{true, true, true}, hits: []bool{false, true, true}},
		{name: "chat: the first stream shows the engine's", path: kvroute.PathChatCompletions, buffer: all,
			buffered: []bool{false, true, true, true, true}, hits: []bool{false, false, true, true, true}},
		{name: "chat with usage and reasoning", path: kvroute.PathChatCompletions, buffer: []string{kvroute.PathChatCompletions},
			engine: []kvroutetest.Option{kvroutetest.WithReasoning(true)}, extra: usage,
			buffered: []bool{false, true, true, true}, hits: []bool{false, false, true, true}},
		{name: "completions", path: kvroute.PathCompletions, buffer: all, extra: usage,
			buffered: []bool{false, true, true, true}, hits: []bool{false, false, true, true}},
		{name: "chat with stream handles is never buffered", path: kvroute.PathChatCompletions, buffer: all,
			engine:   []kvroutetest.Option{kvroutetest.WithStreamHandles(true)},
			buffered: []bool{false, false, false, false}, hits: []bool{false, true, true, true}},
		{name: "messages not listed", path: kvroute.PathMessages, buffer: []string{kvroute.PathChatCompletions},
			buffered: []bool{false, false, false}, hits: []bool{false, false, false}},
		{name: "off", path: kvroute.PathChatCompletions,
			buffered: []bool{false, false, false}, hits: []bool{false, false, false}},
		{name: "n=2 is never buffered", path: kvroute.PathChatCompletions, buffer: all, extra: map[string]any{"n": 2},
			buffered: []bool{false, false, false}, hits: []bool{false, false, false}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := kvroutetest.NewCluster(t, 1, 1, tc.engine...)
			rec := &kvroutetest.Records{}
			r := newRouter(t, c, kvroute.WithObserver(rec), kvroute.WithThreshold(0),
				kvroute.WithDecodeMemory(kvroute.DecodeMemory{BufferStreams: tc.buffer}))
			url := serve(t, r)
			var replies []string
			buffered := int64(0)
			for turn := range tc.buffered {
				body := bufferedBody(t, tc.path, turn, replies, tc.extra)
				res := send(t, url, tc.path, body, nil)
				require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
				assert.True(t, strings.HasPrefix(res.header.Get("Content-Type"), "text/event-stream"), "turn %d: %s", turn, res.header.Get("Content-Type"))
				assert.Empty(t, res.header.Get("Content-Length"))
				assert.NotContains(t, string(res.raw), "remote_block_ids")
				assert.NotContains(t, string(res.raw), "kv_transfer_params")
				got := readStream(t, res.raw)
				assert.True(t, got.done, "turn %d: the stream ended with its final event", turn)
				ref, err := kvroutetest.Reference(tc.path, body, tc.engine...)
				require.NoError(t, err)
				assert.Equal(t, ref.Text, got.text, "turn %d differs from the single engine", turn)
				assert.Equal(t, ref.Reasoning, got.reasoning, "turn %d: reasoning", turn)
				assert.Equal(t, ref.FinishReason, got.finish, "turn %d: finish", turn)
				if tc.extra["stream_options"] != nil {
					assert.True(t, got.usage, "turn %d: the usage chunk", turn)
				}
				tr := rec.Last()
				assert.Equal(t, tc.buffered[turn], tr.Buffered, "turn %d buffered", turn)
				want := kvroute.ReuseMiss
				if tc.hits[turn] {
					want = kvroute.ReuseHit
				}
				assert.Equal(t, want, tr.Reuse, "turn %d: %s (stored: %v)", turn, tr.MissReason, tr.StoreRefusal)
				assert.Equal(t, string(tr.Reuse), res.header.Get("X-Bidikv-Reuse"))
				if tr.Buffered {
					buffered++
					assert.Positive(t, tr.TTFT)
					assert.Equal(t, int64(len(res.raw)), tr.Bytes)
				}
				replies = append(replies, got.text)
			}
			assert.Equal(t, buffered, r.Stats().BufferedStreams)
			for _, e := range append(c.Prefill, c.Decode...) {
				assert.Zero(t, e.Stats().WrongOutputs)
				assert.Zero(t, e.Stats().FreedReads)
			}
		})
	}
}

// BufferStreams names APIs by path; Responses, whose streams carry the
// handle, and unknown paths are refused.
func TestBufferStreamsOption(t *testing.T) {
	for _, p := range []string{kvroute.PathResponses, "/v1/embeddings", ""} {
		_, err := kvroute.New(kvroute.WithPrefill("http://127.0.0.1:1"), kvroute.WithDecode("http://127.0.0.1:2"),
			kvroute.WithDecodeMemory(kvroute.DecodeMemory{BufferStreams: []string{p}}))
		require.Error(t, err, p)
		assert.True(t, errors.Is(err, kvroute.ErrInvalidConfig), "%v", err)
		assert.Contains(t, err.Error(), "BufferStreams")
	}
}

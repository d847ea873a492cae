package capture_test

import (
	"encoding/json"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/internal/capture"
	"github.com/bidikv/bidikv/sse"
)

// forwardAll runs a stream through a Reader and a Capture and returns what
// would reach the client.
func forwardAll(t *testing.T, c *capture.Chunks, stream string) string {
	t.Helper()
	r := sse.NewReader(strings.NewReader(stream))
	var out strings.Builder
	for range 1000 {
		e, err := r.Next()
		if err == io.EOF {
			return out.String()
		}
		require.NoError(t, err)
		b, err := c.Forward(e)
		require.NoError(t, err)
		out.Write(b)
	}
	t.Fatal("stream too long")
	return ""
}

const handle = `{"do_remote_prefill":true,"remote_block_ids":[[12,13,14]],"remote_engine_id":"e-1","remote_request_id":"r-1","remote_host":"::1","remote_port":5600,"remote_num_tokens":42,"remote_blocks_expiry_time":1234.500}`

func TestCaptureStripsHandle(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want string
	}{
		{
			"final chunk",
			`data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"kv_transfer_params":` + handle + "}\n\n",
			`data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}` + "\n\n",
		},
		{
			"escaped key",
			`data: {"id":"c","kv\u005ftransfer_params":` + handle + `,"x":1}` + "\n\n",
			`data: {"id":"c","x":1}` + "\n\n",
		},
		{
			"fully escaped key",
			`data: {"\u006b\u0076\u005f\u0074\u0072\u0061\u006e\u0073\u0066\u0065\u0072\u005f\u0070\u0061\u0072\u0061\u006d\u0073":` + handle + "}\n\n",
			"data: {}\n\n",
		},
		{
			"duplicates",
			`data: {"kv_transfer_params":{"a":1},"x":1,"kv_transfer_params":` + handle + "}\r\n\r\n",
			`data: {"x":1}` + "\n\r\n",
		},
		{
			"multi-line data is re-framed, other lines kept",
			"event: chunk\ndata: {\"x\": 1,\ndata:  \"kv_transfer_params\": " + handle + "\n: note\ndata: }\nid: 5\n\n",
			"event: chunk\ndata: {\"x\": 1 }\n: note\nid: 5\n\n",
		},
		{
			"line break inside kept JSON becomes a space",
			"data: {\"x\":\r\ndata: 1,\"kv_transfer_params\":" + handle + "}\r\n\r\n",
			"data: {\"x\": 1}\n\r\n",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := capture.NewChunks()
			got := forwardAll(t, c, tt.in)
			assert.Equal(t, tt.want, got)
			assert.NotContains(t, got, "remote_block_ids")
			assert.JSONEq(t, handle, string(c.Handle()))
			assert.Equal(t, handle, string(c.Handle()), "bytes kept exactly")
		})
	}
}

func TestCaptureUnchangedEventsAreTheSameSlice(t *testing.T) {
	c := capture.NewChunks()
	for _, in := range []string{
		"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"finish_reason\":null}]}\n\n",
		"data: {\"text\":\"\\u00e9 mentions kv_transfer_params in a string\"}\n\n",
		"data: [DONE]\n\n",
		": keep-alive\n\n",
		"data: \"kv_transfer_params\"\n\n",
		"data:\n\n",
	} {
		t.Run(in, func(t *testing.T) {
			e, err := sse.NewReader(strings.NewReader(in)).Next()
			require.NoError(t, err)
			out, err := c.Forward(e)
			require.NoError(t, err)
			require.Len(t, out, len(e.Raw))
			assert.Same(t, &e.Raw[0], &out[0])
		})
	}
	assert.Nil(t, c.Handle())
	assert.True(t, c.Done())
}

// A handle where engines put none is removed; handle members outside a
// kv_transfer_params member fail the event; handle members on a line
// outside the data drop the line.
func TestCaptureNestedHandles(t *testing.T) {
	for in, want := range map[string]string{
		"data: {\"nested\":{\"kv_transfer_params\":1}}\n\n":                                                       "data: {\"nested\":{}}\n\n",
		"data: {\"choices\":[{\"index\":0,\"delta\":{\"kv_transfer_params\":{\"remote_engine_id\":\"d\"}}}]}\n\n": "data: {\"choices\":[{\"index\":0,\"delta\":{}}]}\n\n",
	} {
		e, err := sse.NewReader(strings.NewReader(in)).Next()
		require.NoError(t, err)
		c := capture.NewChunks()
		out, err := c.Forward(e)
		require.NoError(t, err, in)
		assert.Equal(t, want, string(out))
		assert.Nil(t, c.Handle(), "only a top-level member is the handle")
	}
	e, err := sse.NewReader(strings.NewReader("data: {\"usage\":{\"remote_engine_id\":\"d\"}}\n\n")).Next()
	require.NoError(t, err)
	_, err = capture.NewChunks().Forward(e)
	assert.ErrorIs(t, err, sse.ErrMalformedData)
	for _, in := range []string{
		": {\"remote_block_ids\":[[1,2]],\"remote_engine_id\":\"d\"}\ndata: {\"text\":\"x\"}\n\n",
		"id: remote_engine_id\ndata: {\"text\":\"x\"}\n\n",
	} {
		e, err := sse.NewReader(strings.NewReader(in)).Next()
		require.NoError(t, err)
		out, err := capture.NewChunks().Forward(e)
		require.NoError(t, err)
		assert.NotContains(t, string(out), "remote_")
		assert.Contains(t, string(out), `data: {"text":"x"}`)
	}
}

func TestCaptureMalformed(t *testing.T) {
	c := capture.NewChunks()
	for _, in := range []string{
		`data: {"kv_transfer_params":{"remote_block_ids":[1]}` + "\n\n",
		`data: {"kv\u005ftransfer_params":1,}` + "\n\n",
	} {
		e, err := sse.NewReader(strings.NewReader(in)).Next()
		require.NoError(t, err)
		out, err := c.Forward(e)
		assert.ErrorIs(t, err, sse.ErrMalformedData)
		assert.Nil(t, out)
	}
}

func TestCaptureLastNonNullHandle(t *testing.T) {
	c := capture.NewChunks()
	out := forwardAll(t, c, "data: {\"kv_transfer_params\":{\"n\":1}}\n\n"+
		"data: {\"kv_transfer_params\":{\"n\":2}}\n\n"+
		"data: {\"kv_transfer_params\":null}\n\n")
	assert.Equal(t, "data: {}\n\ndata: {}\n\ndata: {}\n\n", out)
	assert.Equal(t, `{"n":2}`, string(c.Handle()))
}

func TestCaptureMetadata(t *testing.T) {
	stream := `data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}` + "\n\n" +
		`data: {"choices":[{"index":1,"delta":{},"finish_reason":"length"},{"index":0,"delta":{"content":"x"},"finish_reason":"stop"}]}` + "\n\n" +
		`data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}` + "\n\n" +
		"data: [DONE]\n\n"
	c := capture.NewChunks()
	assert.Equal(t, stream, forwardAll(t, c, stream))
	assert.Equal(t, "stop", c.Reply().FinishReason, "choice with index 0, not the first element")
	assert.Equal(t, `{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}`, string(c.Usage()))
	assert.True(t, c.Done())
	assert.Equal(t, &capture.Reply{FinishReason: "stop"}, c.Reply(), "no reassembly without WithReply")
}

func TestCaptureReplyChat(t *testing.T) {
	chunks := []string{
		`{"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}`,
		`{"choices":[{"index":0,"delta":{"reasoning":"think \u00e9","reasoning_content":"think \u00e9"},"finish_reason":null}]}`,
		`{"choices":[{"index":0,"delta":{"reasoning_content":" more"},"finish_reason":null}]}`,
		`{"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}`,
		`{"choices":[{"index":0,"delta":{"content":"lo\n\"w\""},"finish_reason":null}]}`,
		`{"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"call_b","type":"function","function":{"name":"b","arguments":""}}]},"finish_reason":null}]}`,
		`{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_a","type":"function","function":{"name":"get_weather","arguments":"{\"ci"}}]},"finish_reason":null}]}`,
		`{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"ty\": \"Paris\"}"}},{"index":1,"function":{"arguments":"{}"}}]},"finish_reason":null}]}`,
		`{"choices":[{"index":1,"delta":{"content":"other choice"},"finish_reason":null}]}`,
		`{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}],"kv_transfer_params":{"h":1}}`,
	}
	var stream strings.Builder
	for _, ch := range chunks {
		stream.WriteString("data: " + ch + "\n\n")
	}
	stream.WriteString("data: [DONE]\n\n")

	c := capture.NewChunks(capture.WithReply())
	forwardAll(t, c, stream.String())
	r := c.Reply()
	assert.Equal(t, "Hello\n\"w\"", r.Content)
	assert.Equal(t, "think é more", r.Reasoning)
	assert.Equal(t, "tool_calls", r.FinishReason)
	assert.False(t, r.Incomplete)
	assert.JSONEq(t, `[
		{"id":"call_a","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}},
		{"id":"call_b","type":"function","function":{"name":"b","arguments":"{}"}}
	]`, string(r.ToolCalls))
	var calls []map[string]any
	require.NoError(t, json.Unmarshal(r.ToolCalls, &calls))
	assert.Len(t, calls, 2)
	assert.Equal(t, `{"h":1}`, string(c.Handle()))
}

func TestCaptureReplyIncompleteToolCalls(t *testing.T) {
	tests := []struct {
		name  string
		chunk string
	}{
		{"no index", `{"choices":[{"index":0,"delta":{"tool_calls":[{"id":"x","function":{"name":"f","arguments":"{}"}}]}}]}`},
		{"no id", `{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"name":"f","arguments":"{}"}}]}}]}`},
		{"no name", `{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"x","function":{"arguments":"{}"}}]}}]}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := capture.NewChunks(capture.WithReply())
			forwardAll(t, c, "data: "+tt.chunk+"\n\n")
			r := c.Reply()
			assert.True(t, r.Incomplete)
			assert.True(t, json.Valid(r.ToolCalls))
		})
	}
}

func TestCaptureReplyCompletions(t *testing.T) {
	stream := `data: {"object":"text_completion","choices":[{"index":0,"text":"Once","logprobs":null,"finish_reason":null}]}` + "\n\n" +
		`data: {"object":"text_completion","choices":[{"index":0,"text":" upon","logprobs":null,"finish_reason":"length"}]}` + "\n\n" +
		"data: [DONE]\n\n"
	c := capture.NewChunks(capture.WithReply())
	forwardAll(t, c, stream)
	assert.Equal(t, &capture.Reply{Content: "Once upon", FinishReason: "length"}, c.Reply())
}

// TestCaptureUseHandleBuffer copies handles into the given buffer, grows
// past a small one, and after ReleaseHandleBuffer copies into new slices.
func TestCaptureUseHandleBuffer(t *testing.T) {
	ev := func(h string) sse.Event {
		d := `{"choices":[{"index":0,"delta":{}}],"kv_transfer_params":` + h + `}`
		return sse.Event{Raw: []byte("data: " + d + "\n\n"), Data: []byte(d), HasData: true}
	}
	c := capture.NewChunks()
	assert.Nil(t, c.ReleaseHandleBuffer(), "no buffer given")
	buf := make([]byte, 0, 64)
	c.UseHandleBuffer(buf)
	out, err := c.Forward(ev(`{"remote_engine_id":"d","remote_block_ids":[1,2]}`))
	require.NoError(t, err)
	assert.NotContains(t, string(out), "kv_transfer_params")
	assert.Equal(t, `{"remote_engine_id":"d","remote_block_ids":[1,2]}`, string(c.Handle()))
	assert.Same(t, &buf[:1][0], &c.Handle()[0], "copied into the buffer")
	_, err = c.Forward(ev(`null`))
	require.NoError(t, err)
	assert.Equal(t, `{"remote_engine_id":"d","remote_block_ids":[1,2]}`, string(c.Handle()), "a null handle keeps the last")
	long := `{"remote_engine_id":"` + strings.Repeat("e", 100) + `"}`
	_, err = c.Forward(ev(long))
	require.NoError(t, err)
	assert.Equal(t, long, string(c.Handle()), "grown past the buffer")
	got := c.ReleaseHandleBuffer()
	assert.Equal(t, long, string(got), "the buffer it moved to")
	assert.Nil(t, c.Handle(), "released with the buffer")
	_, err = c.Forward(ev(`{"a":1}`))
	require.NoError(t, err)
	assert.Equal(t, `{"a":1}`, string(c.Handle()))
	assert.Equal(t, long, string(got), "a released buffer is not written again")
}

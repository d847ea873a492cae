package capture_test

import (
	"errors"

	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/internal/capture"
	"github.com/bidikv/bidikv/sse"
)

// A stream of nothing but a byte order mark is no event: it comes out as
// one Incomplete block (so Raw still reproduces the input), then io.EOF.
// A handle never reaches a client through a line other than data, nor
// nested in a choice.
func TestCaptureFailsClosed(t *testing.T) {
	const h = `{"remote_block_ids":[[1]],"remote_host":"10.0.0.9"}`
	for _, tc := range []struct {
		name, in, want string
		handle         string // the handle taken, "" for none
	}{
		{"comment line", ": kv_transfer_params=" + h + "\ndata: {\"a\":1}\n\n", "data: {\"a\":1}\n\n", ""},
		{"comment-only event", ": " + h + " kv_transfer_params\n\n", "\n", ""},
		{"id line", "id: kv_transfer_params\ndata: {\"a\":1}\n\n", "data: {\"a\":1}\n\n", ""},
		{"event line keeps the rest", "event: x\nid: 7 kv_transfer_params\r\ndata: {\"a\":1}\n\n", "event: x\ndata: {\"a\":1}\n\n", ""},
		{"nested in choice", `data: {"choices":[{"index":0,"kv_transfer_params":` + h + `,"delta":{}}]}` + "\n\n",
			`data: {"choices":[{"index":0,"delta":{}}]}` + "\n\n", ""},
		{"nested escaped", `data: {"choices":[{"kv\u005ftransfer_params":1},{"index":1}]}` + "\n\n",
			`data: {"choices":[{},{"index":1}]}` + "\n\n", ""},
		{"top level and nested", `data: {"choices":[{"index":0,"kv_transfer_params":1}],"kv_transfer_params":` + h + `}` + "\n\n",
			`data: {"choices":[{"index":0}]}` + "\n\n", h},
		{"data and comment", ": kv_transfer_params\ndata: {\"kv_transfer_params\":" + h + ",\"b\":2}\n\n", "data: {\"b\":2}\n\n", h},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, err := sse.NewReader(strings.NewReader(tc.in)).Next()
			require.NoError(t, err)
			c := capture.NewChunks()
			out, err := c.Forward(e)
			require.NoError(t, err)
			assert.Equal(t, tc.want, string(out))
			assert.NotContains(t, string(out), sse.HandleKey)
			assert.Equal(t, tc.handle, string(c.Handle()))
		})
	}
}

func TestCaptureFailsClosedWithTokenIDs(t *testing.T) {
	in := `data: {"choices":[{"index":0,"token_ids":[5],"kv_transfer_params":{"x":1}}],"prompt_token_ids":[1,2]}` + "\n\n"
	e, err := sse.NewReader(strings.NewReader(in)).Next()
	require.NoError(t, err)
	c := capture.NewChunks(capture.WithTokenIDs(true))
	out, err := c.Forward(e)
	require.NoError(t, err)
	assert.Equal(t, `data: {"choices":[{"index":0}]}`+"\n\n", string(out))
	assert.Equal(t, []uint32{1, 2}, promptIDs(c))
	assert.Equal(t, []uint32{5}, genIDs(c))
}

// A final event far over the old 1 MiB bound (a 1M-token handle with two KV
// groups) is read whole by default.
func TestReaderDefaultFitsLargeHandles(t *testing.T) {
	var b strings.Builder
	b.WriteString(`data: {"kv_transfer_params":{"remote_block_ids":[`)
	for g := range 2 {
		if g > 0 {
			b.WriteByte(',')
		}
		b.WriteByte('[')
		for i := range 62_500 {
			if i > 0 {
				b.WriteByte(',')
			}
			b.WriteString("12345678")
		}
		b.WriteByte(']')
	}
	b.WriteString("]}}\n\n")
	require.Greater(t, b.Len(), 1<<20)
	e, err := sse.NewReader(strings.NewReader(b.String())).Next()
	require.NoError(t, err)
	c := capture.NewChunks()
	out, err := c.Forward(e)
	require.NoError(t, err)
	assert.Equal(t, "data: {}\n\n", string(out))
	assert.Greater(t, len(c.Handle()), 1<<20)
	_, err = sse.NewReader(strings.NewReader(b.String()), sse.WithMaxEventSize(1<<20)).Next()
	assert.True(t, errors.Is(err, sse.ErrEventTooLarge))
}

// Arrays are scrubbed like objects, at every depth.
func TestCaptureArrayData(t *testing.T) {
	for in, want := range map[string]string{
		"data: [{\"kv_transfer_params\":1}]\n\n":         "data: [{}]\n\n",
		"data: [{\"kv\\u005ftransfer_params\":1},2]\n\n": "data: [{},2]\n\n",
		"data: [1,2]\n\n": "data: [1,2]\n\n",
	} {
		e, err := sse.NewReader(strings.NewReader(in)).Next()
		require.NoError(t, err)
		out, err := capture.NewChunks().Forward(e)
		require.NoError(t, err, in)
		assert.Equal(t, want, string(out))
	}
}

// TestCaptureStripsEventAfterEvent forwards events of different sizes
// through one stripping Capture, which reuses its buffers from one event to
// the next: each output must be that event with its token ids removed, as
// StripTokenIDs gives it alone, and a later event must not change what an
// earlier Forward returned once it was copied.
func TestCaptureStripsEventAfterEvent(t *testing.T) {
	datas := []string{
		`{"prompt_token_ids":[1,2,3,4,5,6,7,8],"choices":[{"index":0,"delta":{"content":"a long first piece of text"},"token_ids":[9,10]}]}`,
		`{"choices":[{"index":0,"delta":{"content":"b"},"token_ids":[11]}]}`,
		`{"choices":[{"index":0,"delta":{"content":"c"},"token_ids":[12]},{"index":1,"delta":{"content":"second choice, longer"},"token_ids":[13,14,15]}]}`,
		`{"choices":[{"index":0,"delta":{"content":"d"}}]}`,
		`{"choices":[{"index":0,"delta":{},"finish_reason":"length","token_ids":[16]}]}`,
	}
	c := capture.NewChunks(capture.WithTokenIDs(true))
	var got []string
	for _, d := range datas {
		e, err := sse.NewReader(strings.NewReader("data: " + d + "\n\n")).Next()
		require.NoError(t, err)
		out, err := c.Forward(e)
		require.NoError(t, err)
		got = append(got, string(out))
	}
	for i, d := range datas {
		want, err := capture.StripTokenIDs([]byte(d))
		require.NoError(t, err)
		assert.Equal(t, "data: "+string(want)+"\n\n", got[i], "event %d", i)
		assert.NotContains(t, got[i], "token_ids", "event %d", i)
	}
	assert.Equal(t, []uint32{9, 10, 11, 12, 16}, genIDs(c))
}

package capture_test

import (
	"bytes"
	"net/http"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/internal/toytok"
	"github.com/bidikv/bidikv/kvroute/internal/capture"
	"github.com/bidikv/bidikv/sse"
)

const plainChunk = `data: {"id":"chatcmpl-8b1c","object":"chat.completion.chunk","created":1733000000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":{"content":" world"},"logprobs":null,"finish_reason":null}]}` + "\n\n"

// handleChunk is a final chunk with a D handle of 25,000 tokens: 1,563
// block ids, as vLLM's handles carry one per 16-token block.
var handleChunk = `data: {"id":"chatcmpl-8b1c","object":"chat.completion.chunk","created":1733000000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":"stop"}],"kv_transfer_params":` +
	string(toytok.Handle(1, 25000, 16)) + "}\n\n"

// cycle repeats its data forever.
type cycle struct {
	data []byte
	off  int
}

func (c *cycle) Read(p []byte) (int, error) {
	n := 0
	for n < len(p) {
		m := copy(p[n:], c.data[c.off:])
		n += m
		c.off = (c.off + m) % len(c.data)
	}
	return n, nil
}

// discard is a flushable ResponseWriter that drops what it gets.
type discard struct{ h http.Header }

func (d *discard) Header() http.Header       { return d.h }
func (*discard) Write(p []byte) (int, error) { return len(p), nil }
func (*discard) WriteHeader(int)             {}
func (*discard) Flush()                      {}

func benchmarkForward(b *testing.B, chunk string, opts ...capture.Option) {
	e, err := sse.NewReader(&cycle{data: []byte(chunk)}).Next()
	require.NoError(b, err)
	c := capture.NewChunks(opts...)
	b.SetBytes(int64(len(chunk)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := c.Forward(e); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkCaptureForward(b *testing.B) {
	b.Run("plain", func(b *testing.B) { benchmarkForward(b, plainChunk) })
	b.Run("handle", func(b *testing.B) { benchmarkForward(b, handleChunk) })
	b.Run("plain reply", func(b *testing.B) { benchmarkForward(b, plainChunk, capture.WithReply()) })
}

func TestSteadyStateAllocs(t *testing.T) {
	r := sse.NewReader(&cycle{data: []byte(plainChunk + ": ping\n\n" + "event: e\nid: 1\ndata: {\"a\":\ndata: 1}\n\n")})
	w := sse.NewWriter(&discard{h: http.Header{}})
	c := capture.NewChunks()
	step := func() {
		e, err := r.Next()
		if err != nil {
			t.Fatal(err)
		}
		out, err := c.Forward(e)
		if err != nil {
			t.Fatal(err)
		}
		if err := w.WriteRaw(out); err != nil {
			t.Fatal(err)
		}
	}
	for range 10 { // warm up buffers
		step()
	}
	assert.Zero(t, testing.AllocsPerRun(300, step), "Reader, Capture and Writer allocate nothing per plain event")
}

// benchIDs returns n token ids of realistic magnitude (5 and 6 digits, a
// vocabulary of about 150k) as a JSON array, and the ids.
func benchIDs(n int, seed uint32) (string, []uint32) {
	ids := make([]uint32, n)
	b := make([]byte, 0, 7*n+2)
	b = append(b, '[')
	x := seed | 1
	for i := range ids {
		x ^= x << 13 // xorshift32: deterministic, no math/rand state
		x ^= x >> 17
		x ^= x << 5
		ids[i] = 10000 + x%140000
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendUint(b, uint64(ids[i]), 10)
	}
	return string(append(b, ']')), ids
}

// promptIDsLen is the prompt length of the token-id benchmarks: about a
// 100 KB history.
const promptIDsLen = 24000

// BenchmarkAppendTokenIDs parses the JSON array of a 24,000-token prompt
// (prompt_token_ids of D's first chunk, or a render answer's token_ids)
// into a reused slice, as the router does for each verified turn.
func BenchmarkAppendTokenIDs(b *testing.B) {
	arr, want := benchIDs(promptIDsLen, 7)
	raw := []byte(arr)
	b.Run("reuse", func(b *testing.B) {
		// Into a slice with room: the parse alone.
		dst := make([]uint32, 0, promptIDsLen)
		b.SetBytes(int64(len(raw)))
		b.ReportAllocs()
		for b.Loop() {
			if ids, ok := capture.AppendTokenIDs(dst[:0], raw); !ok || len(ids) != len(want) {
				b.Fatalf("ok %v, %d ids", ok, len(ids))
			}
		}
		b.ReportMetric(float64(len(raw))/promptIDsLen, "json-B/id")
	})
	b.Run("fresh", func(b *testing.B) {
		// As the router calls it for a render answer or a non-streaming
		// body: AppendTokenIDs(nil, v), growing the slice.
		b.SetBytes(int64(len(raw)))
		b.ReportAllocs()
		for b.Loop() {
			if ids, ok := capture.AppendTokenIDs(nil, raw); !ok || len(ids) != len(want) {
				b.Fatalf("ok %v, %d ids", ok, len(ids))
			}
		}
	})
}

// tokenBody is a non-streaming chat answer with return_token_ids: 24k
// prompt ids at the top level and 200 generated ids in choice 0.
func tokenBody() []byte {
	prompt, _ := benchIDs(promptIDsLen, 11)
	gen, _ := benchIDs(200, 13)
	return []byte(`{"id":"chatcmpl-8b1c","object":"chat.completion","created":1733000000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"message":{"role":"assistant","content":"Done, the tests pass.","tool_calls":[]},"logprobs":null,"finish_reason":"stop","stop_reason":null,"token_ids":` +
		gen + `}],"usage":{"prompt_tokens":24000,"total_tokens":24200,"completion_tokens":200},"prompt_logprobs":null,"prompt_token_ids":` + prompt + `}`)
}

// BenchmarkStripTokenIDs removes the token ids from a non-streaming chat
// answer with a 24k-token prompt (what a client that did not ask for them
// receives).
func BenchmarkStripTokenIDs(b *testing.B) {
	body := tokenBody()
	out, err := capture.StripTokenIDs(body)
	require.NoError(b, err)
	require.NotContains(b, string(out), "token_ids")
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := capture.StripTokenIDs(body); err != nil {
			b.Fatal(err)
		}
	}
}

// Stream chunks of an engine asked for return_token_ids: a content chunk
// with choice 0's token_ids, and the first chunk with the prompt's.
var (
	tokenChunk = `data: {"id":"chatcmpl-8b1c","object":"chat.completion.chunk","created":1733000000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":{"content":" world"},"logprobs":null,"finish_reason":null,"token_ids":[129045]}]}` + "\n\n"
	firstChunk = func() string {
		prompt, _ := benchIDs(promptIDsLen, 17)
		return `data: {"id":"chatcmpl-8b1c","object":"chat.completion.chunk","created":1733000000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":` + prompt + "}\n\n"
	}()
)

// streamLen is how many events one Capture forwards in the token-id
// benchmarks before a new one is made (one answer): the generated ids then
// grow as in a real stream instead of without bound.
const streamLen = 2048

// benchmarkForwardStream is benchmarkForward over streams of streamLen
// events, a new Capture per stream; the amortized cost of the new Capture
// and of the growing id slice is included.
func benchmarkForwardStream(b *testing.B, chunk string, stripped bool, opts ...capture.Option) {
	e, err := sse.NewReader(&cycle{data: []byte(chunk)}).Next()
	require.NoError(b, err)
	c := capture.NewChunks(opts...)
	out, err := c.Forward(e)
	require.NoError(b, err)
	if stripped {
		require.NotContains(b, string(out), "token_ids")
	} else {
		require.Equal(b, string(e.Raw), string(out))
	}
	n := 0
	b.SetBytes(int64(len(chunk)))
	b.ReportAllocs()
	for b.Loop() {
		if n++; n == streamLen {
			n, c = 0, capture.NewChunks(opts...)
		}
		if _, err := c.Forward(e); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkCaptureTokenIDs is the per-event cost of a Capture made
// WithTokenIDs: "strip" (the router added return_token_ids: ids collected
// and removed from what the client gets), "keep" (the client asked: ids
// collected, event forwarded as is), and "none" (the same chunk without
// WithTokenIDs, the content-mode baseline). "prompt chunk strip" is the
// first chunk of a stream, with 24k prompt ids, in a new Capture (once per
// turn).
func BenchmarkCaptureTokenIDs(b *testing.B) {
	b.Run("strip", func(b *testing.B) { benchmarkForwardStream(b, tokenChunk, true, capture.WithTokenIDs(true)) })
	b.Run("keep", func(b *testing.B) { benchmarkForwardStream(b, tokenChunk, false, capture.WithTokenIDs(false)) })
	b.Run("none", func(b *testing.B) { benchmarkForwardStream(b, tokenChunk, false) })
	b.Run("prompt chunk strip", func(b *testing.B) {
		// A new Capture per op, as per turn: the prompt's ids grow a
		// fresh slice.
		e, err := sse.NewReader(&cycle{data: []byte(firstChunk)}).Next()
		require.NoError(b, err)
		b.SetBytes(int64(len(firstChunk)))
		b.ReportAllocs()
		for b.Loop() {
			c := capture.NewChunks(capture.WithTokenIDs(true))
			out, err := c.Forward(e)
			if err != nil || len(promptIDs(c)) != promptIDsLen || len(out) > 512 {
				b.Fatalf("%v: %d ids, %d bytes out", err, len(promptIDs(c)), len(out))
			}
		}
	})
	b.Run("prompt chunk strip expected", func(b *testing.B) {
		// The same, with the render answer's ids and their text given
		// (ExpectPromptIDs), as the router does on a verified hit: the
		// chunk's array is compared, not parsed.
		e, err := sse.NewReader(&cycle{data: []byte(firstChunk)}).Next()
		require.NoError(b, err)
		o, err := jsonraw.Parse(e.Data)
		require.NoError(b, err)
		raw, _ := o.Get(capture.PromptTokenIDsKey)
		ids, ok := capture.AppendTokenIDs(nil, raw)
		require.True(b, ok)
		raw = bytes.Clone(raw) // the render answer's own bytes
		b.SetBytes(int64(len(firstChunk)))
		b.ReportAllocs()
		for b.Loop() {
			c := capture.NewChunks(capture.WithTokenIDs(true))
			c.ExpectPromptIDs(raw, ids)
			out, err := c.Forward(e)
			if err != nil || !c.PromptIDsExpected() || len(promptIDs(c)) != promptIDsLen || len(out) > 512 {
				b.Fatalf("%v: %d ids, %d bytes out", err, len(promptIDs(c)), len(out))
			}
		}
	})
}

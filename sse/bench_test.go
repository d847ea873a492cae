package sse_test

import (
	"net/http"

	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/bidikv/bidikv/sse"
)

const (
	plainChunk  = `data: {"id":"chatcmpl-8b1c","object":"chat.completion.chunk","created":1733000000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":{"content":" world"},"logprobs":null,"finish_reason":null}]}` + "\n\n"
	handleChunk = `data: {"id":"chatcmpl-8b1c","object":"chat.completion.chunk","created":1733000000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":"stop"}],"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[[12,13,14,15]],"remote_engine_id":"a1b2","remote_request_id":"cmpl-1","remote_host":"10.0.0.7","remote_port":5600,"tp_size":1,"remote_num_tokens":321,"remote_blocks_expiry_time":91234.5}}` + "\n\n"
)

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

func BenchmarkReaderNext(b *testing.B) {
	r := sse.NewReader(&cycle{data: []byte(plainChunk)})
	b.SetBytes(int64(len(plainChunk)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := r.Next(); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkPassThrough(b *testing.B) {
	r := sse.NewReader(&cycle{data: []byte(plainChunk)})
	w := sse.NewWriter(&discard{h: http.Header{}})
	b.SetBytes(int64(len(plainChunk)))
	b.ReportAllocs()
	for b.Loop() {
		e, err := r.Next()
		if err != nil {
			b.Fatal(err)
		}
		if err := w.WriteRaw(e.Raw); err != nil {
			b.Fatal(err)
		}
	}
}

// TestSteadyStateAllocs: reading, scrubbing and writing a plain event (a
// chunk, a comment, a multi-line event) allocates nothing.
func TestSteadyStateAllocs(t *testing.T) {
	r := sse.NewReader(&cycle{data: []byte(plainChunk + ": ping\n\n" + "event: e\nid: 1\ndata: {\"a\":\ndata: 1}\n\n")})
	w := sse.NewWriter(&discard{h: http.Header{}})
	var buf []byte
	step := func() {
		e, err := r.Next()
		if err != nil {
			t.Fatal(err)
		}
		out, rewritten, err := sse.ScrubEvent(buf[:0], e, e.Data, false)
		if err != nil {
			t.Fatal(err)
		}
		if rewritten {
			buf = out
		}
		if err := w.WriteRaw(out); err != nil {
			t.Fatal(err)
		}
	}
	for range 10 {
		step()
	}
	assert.Zero(t, testing.AllocsPerRun(300, step), "Reader, ScrubEvent and Writer allocate nothing per plain event")
}

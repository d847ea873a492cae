package kvroute_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/transport"
)

// benchRouter builds a router over canned engines (see cannedEngines).
func benchRouter(b *testing.B, prefill, decode string) *kvroute.Router {
	b.Helper()
	rt, err := transport.NewTransport()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(rt.CloseIdleConnections)
	r, err := kvroute.New(kvroute.WithPrefill(prefill), kvroute.WithDecode(decode), kvroute.WithTransport(rt))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = r.Close() })
	return r
}

// BenchmarkTurn runs one whole streaming turn (lookup, prefill, decode,
// capture, store) through Do against canned zero-latency engines on
// 127.0.0.1, with a 10 KB history; 7 of every 8 turns are hits. Allocations
// include the HTTP client side of both legs and the canned engines' servers.
func BenchmarkTurn(b *testing.B) {
	p, d := cannedEngines(b)
	r := benchRouter(b, p, d)
	var conv *benchConv
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		if i%turnsPerConv == 0 {
			conv = newBenchConv(fmt.Sprintf("c%d ", i), 10<<10)
		}
		resp, err := r.Do(context.Background(), &kvroute.Request{Path: kvroute.PathChatCompletions, Header: http.Header{}, Body: conv.body()})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := resp.WriteTo(io.Discard); err != nil {
			b.Fatal(err)
		}
		_ = resp.Close()
		conv.messages = append(conv.messages,
			map[string]string{"role": "assistant", "content": "Done, the tests pass."},
			map[string]string{"role": "user", "content": fmt.Sprintf("Now run step %d.", i)})
	}
}

// streamEvents is the number of content events of the pass-through stream.
const streamEvents = 512

// BenchmarkStreamPassThrough measures the router's cost per decode event:
// a turn whose decode stream has streamEvents content events is read with
// Response.Next; ns/event and allocs/event are per event, turn setup
// included.
func BenchmarkStreamPassThrough(b *testing.B) {
	p, _ := cannedEngines(b)
	var stream strings.Builder
	for i := range streamEvents {
		fmt.Fprintf(&stream, "data: {\"id\":\"cmpl-d\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"sim-model\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" tok%d\"},\"finish_reason\":null}]}\n\n", i)
	}
	stream.WriteString("data: {\"id\":\"cmpl-d\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"sim-model\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}],\"kv_transfer_params\":" + cannedDHandle + "}\n\ndata: [DONE]\n\n")
	body := stream.String()
	ds := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, body)
	}))
	b.Cleanup(ds.Close)
	r := benchRouter(b, p, ds.URL)
	req := newBenchConv("stream ", 1<<10).body()

	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	b.ResetTimer()
	events := 0
	for b.Loop() {
		resp, err := r.Do(context.Background(), &kvroute.Request{Path: kvroute.PathChatCompletions, Header: http.Header{}, Body: req})
		if err != nil {
			b.Fatal(err)
		}
		for {
			_, err := resp.Next()
			if err == io.EOF {
				break
			}
			if err != nil {
				b.Fatal(err)
			}
			events++
		}
		_ = resp.Close()
	}
	b.StopTimer()
	runtime.ReadMemStats(&after)
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(events), "ns/event")
	b.ReportMetric(float64(after.Mallocs-before.Mallocs)/float64(events), "allocs/event")
}

// BenchmarkContinuationKey measures the default Identifier on a chat
// request with a 100 KB history: Lookup (every assistant-ended prefix) and
// Key (the whole conversation plus the reply), as one turn needs.
func BenchmarkContinuationKey(b *testing.B) {
	conv := newBenchConv("keys ", 100<<10)
	for i := range 4 {
		conv.messages = append(conv.messages,
			map[string]string{"role": "assistant", "content": "Done, the tests pass."},
			map[string]string{"role": "user", "content": fmt.Sprintf("Now run step %d.", i)})
	}
	body := conv.body()
	reply := &kvroute.Reply{Content: "Done, the tests pass.", FinishReason: "stop"}
	var ck kvroute.ContinuationKeys
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		req := &kvroute.Request{Path: kvroute.PathChatCompletions, Header: http.Header{}, Body: body}
		keys, err := ck.Lookup(req)
		if err != nil || len(keys) == 0 {
			b.Fatalf("lookup: %v, %d keys", err, len(keys))
		}
		ret, err := ck.Key(req, reply)
		if err != nil || ret.Key == "" {
			b.Fatalf("key: %v %q", err, ret.Refusal)
		}
	}
}

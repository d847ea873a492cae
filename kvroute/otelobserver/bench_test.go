package otelobserver_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/bidikv/bidikv/internal/toytok"
	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/otelobserver"
	"github.com/bidikv/bidikv/transport"
)

// cannedReply is the canned decode engine's answer.
const cannedReply = "Done, the tests pass."

// blockSize is the canned engines' block size, the router's default.
var blockSize = kvroute.Defaults().Verification.BlockSize

// promptTokens reads a chat request and returns its prompt's length in
// internal/toytok's toy tokens (0 for a body it cannot read).
func promptTokens(w http.ResponseWriter, r *http.Request) int {
	body, _ := io.ReadAll(r.Body)
	n, _ := toytok.PromptTokens(body)
	return n
}

// cannedEngines starts zero-latency prefill and decode engines on
// 127.0.0.1: P answers one token and a handle, D streams the reply and a
// handle on its final chunk; handles hold one block id per block of what
// the engine computed, as vLLM's do.
func cannedEngines(b *testing.B) (prefill, decode string) {
	var seq atomic.Int64
	p := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		prompt := promptTokens(w, r)
		n := seq.Add(1)
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"p%d","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"x"},"finish_reason":"length"}],"kv_transfer_params":%s}`, n, toytok.PrefillHandle(n, prompt, blockSize))
	})
	d := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		prompt := promptTokens(w, r)
		n := seq.Add(1)
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprintf(w, "data: {\"id\":\"d%d\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"%s\"},\"finish_reason\":null}]}\n\n", n, cannedReply)
		fmt.Fprintf(w, "data: {\"id\":\"d%d\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"kv_transfer_params\":%s}\n\ndata: [DONE]\n\n", n, toytok.Handle(n, prompt+len(toytok.Reply(cannedReply))-1, blockSize))
	})
	ps, ds := httptest.NewServer(p), httptest.NewServer(d)
	b.Cleanup(ps.Close)
	b.Cleanup(ds.Close)
	return ps.URL, ds.URL
}

// BenchmarkTurn measures what tracing adds to one streaming turn (lookup,
// prefill, decode, capture, store) through Do against canned zero-latency
// engines on 127.0.0.1; conversations restart every 8 turns, so 7 of 8 are
// hits (content verification: no render call).
//
//   - off: no Tracer, no Observer.
//
//   - metrics: the Observer's metrics only (WithObserver), into a manual
//     reader.
//
//   - traced: o.Options(), every turn sampled, spans to a batch processor
//     with a no-op exporter, metrics as above: five spans a turn and the
//     traceparent on both legs.
//
//   - unsampled: as traced with a never-sampling provider: no span is
//     recorded, the trace context still reaches the engines.
//
//     go test -run '^$' -bench BenchmarkTurn -benchmem -count 5 ./kvroute/otelobserver
func BenchmarkTurn(b *testing.B) {
	for _, mode := range []string{"off", "metrics", "traced", "unsampled"} {
		b.Run(mode, func(b *testing.B) { benchmarkTurn(b, mode) })
	}
}

func benchmarkTurn(b *testing.B, mode string) {
	p, d := cannedEngines(b)
	rt, err := transport.NewTransport()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(rt.CloseIdleConnections)
	opts := []kvroute.Option{kvroute.WithPrefill(p), kvroute.WithDecode(d), kvroute.WithTransport(rt),
		kvroute.WithVerification(kvroute.Verification{Mode: kvroute.VerifyContent})}
	if mode != "off" {
		mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
		b.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
		oo := []otelobserver.Option{otelobserver.WithMeterProvider(mp)}
		if mode != "metrics" {
			sampler := sdktrace.AlwaysSample()
			if mode == "unsampled" {
				sampler = sdktrace.NeverSample()
			}
			tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sampler),
				sdktrace.WithBatcher(tracetest.NewNoopExporter()))
			b.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
			oo = append(oo, otelobserver.WithTracerProvider(tp))
		}
		o, err := otelobserver.New(oo...)
		if err != nil {
			b.Fatal(err)
		}
		if mode == "metrics" {
			opts = append(opts, kvroute.WithObserver(o))
		} else {
			opts = append(opts, o.Options()...)
		}
	}
	r, err := kvroute.New(opts...)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = r.Close() })

	var messages []map[string]string
	ctx := context.Background()
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		if i%8 == 0 {
			messages = []map[string]string{{"role": "system", "content": systemPrompt + fmt.Sprint(i)}}
		}
		messages = append(messages, map[string]string{"role": "user", "content": "Run step " + fmt.Sprint(i)})
		body, _ := json.Marshal(map[string]any{"model": "m", "stream": true, "messages": messages})
		resp, err := r.Do(ctx, &kvroute.Request{Path: kvroute.PathChatCompletions, Body: body})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := resp.WriteTo(io.Discard); err != nil {
			b.Fatal(err)
		}
		reuse := kvroute.ReuseOutcome(resp.Header.Get("X-Bidikv-Reuse"))
		if want := i%8 != 0; (reuse == kvroute.ReuseHit) != want {
			b.Fatalf("turn %d: reuse %s", i, reuse)
		}
		_ = resp.Close()
		messages = append(messages, map[string]string{"role": "assistant", "content": cannedReply})
	}
}

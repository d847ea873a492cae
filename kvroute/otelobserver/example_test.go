package otelobserver_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/kvroute/otelobserver"
)

// Two turns of one conversation over simulated engines, traced into an
// in-memory exporter: the first a miss, the second a hit verified by a
// render call. The client sent a traceparent, so both turns join its trace,
// and so does every engine request, under its phase's span.
func Example() {
	reg := kvroutetest.NewRegistry()
	P, _ := kvroutetest.StartEngine(kvroutetest.WithRegistry(reg))
	defer P.Close()
	D, _ := kvroutetest.StartEngine(kvroutetest.WithRegistry(reg))
	defer D.Close()

	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	o, _ := otelobserver.New(otelobserver.WithTracerProvider(tp))
	r, _ := kvroute.New(append([]kvroute.Option{kvroute.WithPrefill(P.URL()), kvroute.WithDecode(D.URL())}, o.Options()...)...)
	defer r.Close()

	header := http.Header{"Traceparent": {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}}
	messages := []map[string]string{{"role": "system", "content": systemPrompt}}
	for _, user := range []string{"List the files.", "Run the tests."} {
		messages = append(messages, map[string]string{"role": "user", "content": user})
		body, _ := json.Marshal(map[string]any{"model": kvroutetest.DefaultModel, "max_tokens": 8, "messages": messages})
		resp, err := r.Do(context.Background(), &kvroute.Request{Path: kvroute.PathChatCompletions, Header: header, Body: body})
		if err != nil {
			fmt.Println(err)
			return
		}
		var reply struct {
			Choices []struct{ Message map[string]string }
		}
		_ = json.Unmarshal(resp.Body, &reply)
		_ = resp.Close()
		messages = append(messages, map[string]string{"role": "assistant", "content": reply.Choices[0].Message["content"]})
		printTree(exp.GetSpans())
		exp.Reset()
	}

	// Each engine request's traceparent names a span of the trace.
	joined := true
	for _, e := range []*kvroutetest.Engine{P, D} {
		for _, rr := range e.Requests() {
			joined = joined && engineTrace(rr).TraceID().String() == "4bf92f3577b34da6a3ce929d0e0e4736"
		}
	}
	fmt.Println("engines joined the trace:", joined)
	// Output:
	// bidikv.turn reuse=miss miss_reason=not_found
	//   bidikv.lookup
	//   bidikv.prefill
	//   bidikv.decode
	// bidikv.turn reuse=hit verification=tokens
	//   bidikv.lookup
	//     bidikv.verify
	//   bidikv.prefill
	//   bidikv.decode
	// engines joined the trace: true
}

// printTree prints one turn's spans as a tree, children in start order.
func printTree(spans tracetest.SpanStubs) {
	slices.SortStableFunc(spans, func(a, b tracetest.SpanStub) int { return a.StartTime.Compare(b.StartTime) })
	var walk func(parent string, depth int)
	walk = func(parent string, depth int) {
		for _, s := range spans {
			if s.Parent.SpanID().String() != parent {
				continue
			}
			line := strings.Repeat("  ", depth) + s.Name
			if s.Name == otelobserver.SpanTurn {
				a := attrs(s)
				line += " reuse=" + a[otelobserver.AttrReuse].AsString()
				if v, ok := a[otelobserver.AttrMissReason]; ok {
					line += " miss_reason=" + v.AsString()
				}
				if a[otelobserver.AttrReuse].AsString() == string(kvroute.ReuseHit) {
					line += " verification=" + a[otelobserver.AttrVerification].AsString()
				}
			}
			fmt.Println(line)
			walk(s.SpanContext.SpanID().String(), depth+1)
		}
	}
	walk("00f067aa0ba902b7", 0) // the client's span
}

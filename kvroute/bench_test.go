package kvroute_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"

	"github.com/bidikv/bidikv/internal/toytok"
	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/transport"
)

// benchRouter builds a router over canned engines (see cannedEngines and
// newTokenEngines).
func benchRouter(b *testing.B, prefill, decode string, opts ...kvroute.Option) *kvroute.Router {
	b.Helper()
	rt, err := transport.NewTransport()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(rt.CloseIdleConnections)
	r, err := kvroute.New(append([]kvroute.Option{kvroute.WithPrefill(prefill), kvroute.WithDecode(decode), kvroute.WithTransport(rt)}, opts...)...)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = r.Close() })
	return r
}

// BenchmarkTurn runs one whole streaming turn (lookup, verification,
// prefill, decode, capture, store) through Do against canned zero-latency
// engines on 127.0.0.1, with a 10 KB or 100 KB history; conversations
// restart every turnsPerConv turns, so 7 of every 8 turns are hits.
// Allocations include the HTTP client side of both legs and the canned
// engines' servers.
//
//   - content: WithVerification(VerifyContent) over the canned engines
//     (cannedEngines: D sends no token ids).
//   - tokens: WithVerification(VerifyTokens) over the token-aware canned
//     engines (newTokenEngines): D's stream carries the prompt's and the
//     generated token ids, which the router fingerprints and strips, and
//     each hit first renders the new prompt on P
//     (/v1/chat/completions/render) and compares it with the fingerprint.
//     The in-process render server's work (decoding the 10 or 100 KB body,
//     tokenizing, encoding the ids) and the larger decode stream are
//     counted too; BenchmarkTokenEngines measures the engines' share.
//
// Every turn after a conversation's first must be a hit verified in the
// benchmark's mode (in token mode: fully, from a render), else the
// benchmark fails.
//
//	go test -run '^$' -bench 'BenchmarkTurn' -benchmem -count 3 ./kvroute
func BenchmarkTurn(b *testing.B) {
	for _, mode := range []kvroute.VerificationMode{kvroute.VerifyContent, kvroute.VerifyTokens} {
		for _, hist := range []int{10 << 10, 100 << 10} {
			b.Run(fmt.Sprintf("%s/hist=%dKB", mode, hist>>10), func(b *testing.B) { benchmarkTurn(b, mode, hist) })
		}
	}
}

func benchmarkTurn(b *testing.B, mode kvroute.VerificationMode, hist int, opts ...kvroute.Option) {
	var p, d string
	if mode == kvroute.VerifyTokens {
		te := newTokenEngines(b)
		p, d = te.prefill, te.decode
		// The first turn's prompt, for its size in tokens (ReportMetric
		// after the loop: b.Loop's first call drops earlier metrics).
		conv := newBenchConv("c0 ", hist)
		toks := len(toytok.Chat(toyMessages(conv.messages)))
		defer func() {
			b.ReportMetric(float64(toks), "prompt-tokens")
			b.ReportMetric(float64(toyContentBytes(conv.messages))/float64(toks), "B/token")
		}()
	} else {
		p, d = cannedEngines(b)
	}
	obs := &kvroutetest.Records{}
	r := benchRouter(b, p, d, append([]kvroute.Option{kvroute.WithVerification(kvroute.Verification{Mode: mode}),
		kvroute.WithObserver(obs)}, opts...)...)
	var conv *benchConv
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		if i%turnsPerConv == 0 {
			conv = newBenchConv(fmt.Sprintf("c%d ", i), hist)
		}
		resp, err := r.Do(context.Background(), &kvroute.Request{Path: kvroute.PathChatCompletions, Header: http.Header{}, Body: conv.body()})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := resp.WriteTo(io.Discard); err != nil {
			b.Fatal(err)
		}
		_ = resp.Close()
		// Taken, so that the records do not pile up over the loop.
		last, _ := obs.Take(obs.Last().RequestID)
		if err := checkTurn(&last, mode, i%turnsPerConv == 0); err != nil {
			b.Fatalf("turn %d: %v", i, err)
		}
		conv.messages = append(conv.messages,
			map[string]string{"role": "assistant", "content": toyReply},
			map[string]string{"role": "user", "content": fmt.Sprintf("Now run step %d.", i)})
	}
}

// checkTurn checks a BenchmarkTurn record: every turn is retained, and
// every turn but a conversation's first is a hit verified in mode (in
// token mode: from a render, over the handle's whole sequence).
func checkTurn(rec *kvroute.TurnRecord, mode kvroute.VerificationMode, first bool) error {
	switch {
	case rec.Err != nil:
		return rec.Err
	case !rec.Stored:
		return fmt.Errorf("not retained: %s", rec.StoreRefusal)
	case first:
		return nil
	case rec.Reuse != kvroute.ReuseHit:
		return fmt.Errorf("%s (%s), want a hit", rec.Reuse, rec.MissReason)
	case rec.Verification != mode:
		return fmt.Errorf("verified by %q, want %q", rec.Verification, mode)
	case mode == kvroute.VerifyTokens && (rec.TokenSource != kvroute.TokensFromRender || rec.Partial ||
		rec.VerifiedTokens != rec.HandleTokens || rec.HandleTokens == 0):
		return fmt.Errorf("token verification: source %q, partial %v, %d of %d tokens verified",
			rec.TokenSource, rec.Partial, rec.VerifiedTokens, rec.HandleTokens)
	}
	return nil
}

// BenchmarkTokenEngines measures the token-aware canned engines' own work
// per BenchmarkTurn/tokens hit, without HTTP: P's render answer and D's
// stream for the same request (the router's decode body, with
// return_token_ids), the handlers called directly with a recorder. It is
// the part of BenchmarkTurn's token-minus-content difference that is the
// engines', not the router's (the canned content engines do almost no
// work).
func BenchmarkTokenEngines(b *testing.B) {
	for _, hist := range []int{10 << 10, 100 << 10} {
		b.Run(fmt.Sprintf("hist=%dKB", hist>>10), func(b *testing.B) {
			p, d := (&tokenEngines{}).handlers()
			conv := newBenchConv("c0 ", hist)
			conv.messages = append(conv.messages,
				map[string]string{"role": "assistant", "content": toyReply},
				map[string]string{"role": "user", "content": "Now run step 1."})
			var body map[string]any
			if err := json.Unmarshal(conv.body(), &body); err != nil {
				b.Fatal(err)
			}
			body["return_token_ids"] = true
			raw, _ := json.Marshal(body)
			serve := func(h http.Handler, path string) {
				w := httptest.NewRecorder()
				h.ServeHTTP(w, httptest.NewRequest(http.MethodPost, path, bytes.NewReader(raw)))
				if w.Code != http.StatusOK {
					b.Fatalf("%s: status %d", path, w.Code)
				}
			}
			b.ReportAllocs()
			for b.Loop() {
				serve(p, kvroute.PathChatCompletions+"/render")
				serve(d, kvroute.PathChatCompletions)
			}
		})
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
	req := newBenchConv("stream ", 1<<10).body()
	prompt, err := toytok.PromptTokens(req)
	if err != nil {
		b.Fatal(err)
	}
	// D holds the prompt and the events' tokens (a real-size handle).
	stream.WriteString("data: {\"id\":\"cmpl-d\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"sim-model\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}],\"kv_transfer_params\":" +
		string(toytok.Handle(1, prompt+streamEvents, cannedBlockSize)) + "}\n\ndata: [DONE]\n\n")
	body := stream.String()
	ds := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, body)
	}))
	b.Cleanup(ds.Close)
	r := benchRouter(b, p, ds.URL)

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
		c, err := ck.Lookup(req)
		if err != nil || len(c.Keys) == 0 {
			b.Fatalf("lookup: %v, %d keys", err, len(c.Keys))
		}
		ret, err := ck.Key(req, c, reply)
		if err != nil || ret.Key == "" {
			b.Fatalf("key: %v %q", err, ret.Refusal)
		}
	}
}

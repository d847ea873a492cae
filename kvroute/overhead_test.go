package kvroute_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bidikv/bidikv/internal/toytok"
	"github.com/bidikv/bidikv/internal/upstreamclock"
	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/retention"
	"github.com/bidikv/bidikv/transport"
)

// The overhead benchmarks measure what the router adds to time to first
// token: the client's TTFT through the router minus the time the router's
// upstream requests waited on the engines (prefill: until P's body was read
// to its end; decode: until D's first bytes), per turn, on the same requests.
//
//	go test -run '^$' -bench Overhead -benchtime 2000x ./kvroute
//
// Two kinds of zero-latency engines: "canned" answers every request at once
// with fixed bytes (a P handle, or a short stream whose final chunk carries
// a D handle), so nearly all CPU is the router's; "sim" is kvroutetest with
// a zero-cost profile, which tokenizes and checks every prompt on the same
// two cores and so competes with the router for CPU.

// cannedEngines starts a prefill and a decode server on 127.0.0.1 that
// answer at once with fixed bytes: P a one-token completion with a P
// handle, D a three-event stream whose final chunk carries a D handle
// (as engines with vLLM PR #40186 send). The handles are the size vLLM's
// are (cannedBlocks): the prompt's length is counted with the toy
// tokenizer (toytok.PromptTokens, without decoding the body into values).
func cannedEngines(tb testing.TB) (prefill, decode string) {
	tb.Helper()
	var seq atomic.Int64
	p := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		cannedPrefill(w, r, seq.Add(1))
	})
	d := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		prompt, ok := cannedPrompt(w, r)
		if !ok {
			return
		}
		n := seq.Add(1)
		handle := toytok.Handle(n, prompt+len(toyReplyIDs)-1, cannedBlockSize)
		w.Header().Set("Content-Type", "text/event-stream")
		fl := http.NewResponseController(w)
		fmt.Fprintf(w, "data: {\"id\":\"cmpl-d%d\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"sim-model\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n", n)
		_ = fl.Flush()
		fmt.Fprintf(w, "data: {\"id\":\"cmpl-d%d\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"sim-model\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Done, the tests pass.\"},\"finish_reason\":null}]}\n\n", n)
		fmt.Fprintf(w, "data: {\"id\":\"cmpl-d%d\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"sim-model\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\",\"stop_reason\":null}],\"kv_transfer_params\":%s}\n\ndata: [DONE]\n\n", n, handle)
	})
	ps, ds := httptest.NewServer(p), httptest.NewServer(d)
	tb.Cleanup(ps.Close)
	tb.Cleanup(ds.Close)
	return ps.URL, ds.URL
}

// cannedBlockSize is the canned engines' block size (vLLM's default on CUDA).
var cannedBlockSize = kvroutetest.DefaultBlockSize

// cannedPrompt reads a chat request and returns its prompt's length in
// toy tokens; on a body it cannot read it answers 400.
func cannedPrompt(w http.ResponseWriter, r *http.Request) (int, bool) {
	buf := bytes.NewBuffer(make([]byte, 0, max(r.ContentLength+1, 512)))
	_, err := buf.ReadFrom(r.Body)
	body := buf.Bytes()
	if err == nil {
		var n int
		if n, err = toytok.PromptTokens(body); err == nil {
			return n, true
		}
	}
	http.Error(w, err.Error(), http.StatusBadRequest)
	return 0, false
}

// cannedPrefill answers a prefill request as the canned prefill engine
// does: one token and a P handle holding the prompt's blocks.
func cannedPrefill(w http.ResponseWriter, r *http.Request, n int64) {
	prompt, ok := cannedPrompt(w, r)
	if !ok {
		return
	}
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprintf(w, `{"id":"cmpl-p%d","object":"chat.completion","created":1,"model":"sim-model","choices":[{"index":0,"message":{"role":"assistant","content":"x"},"finish_reason":"length"}],"usage":{"prompt_tokens":%d,"completion_tokens":1,"total_tokens":%d},"kv_transfer_params":%s}`,
		n, prompt, prompt+1, toytok.PrefillHandle(n, prompt, cannedBlockSize))
}

// The token-aware canned engines (tokenEngines) share internal/toytok's
// deterministic toy tokenizer and chat template with vllmsim's canned
// mode. On the benchmark histories this gives about 4 bytes of content per
// token (a 100 KB history is about 26k tokens); BenchmarkTurn/tokens
// reports the figure.

// toyReply is D's canned reply and toyReplyIDs its generated ids (the
// end-of-turn token last, as an engine samples it).
const toyReply = "Done, the tests pass."

var toyReplyIDs = toytok.Reply(toyReply)

// toyContentBytes is the content bytes of messages, for the bytes/token
// ratio.
func toyContentBytes(msgs []map[string]string) int {
	n := 0
	for _, m := range msgs {
		n += len(m["content"])
	}
	return n
}

func toyMessages(msgs []map[string]string) []toytok.Message {
	out := make([]toytok.Message, len(msgs))
	for i, m := range msgs {
		out[i] = toytok.Message{Role: m["role"], Content: m["content"]}
	}
	return out
}

// tokenEngines are canned engines that know tokens (see internal/toytok), started
// by newTokenEngines.
type tokenEngines struct {
	prefill, decode string
	// Sums over D's answers: handles sent, their JSON bytes, and their
	// remote_num_tokens.
	handles, handleBytes, handleTokens atomic.Int64
	// spacedPromptIDs makes D spell the prompt's ids with a space after
	// each comma: the same ids as P's render answer, in other text.
	spacedPromptIDs atomic.Bool
}

// newTokenEngines starts a prefill and a decode server on 127.0.0.1 that
// answer at once, as engines serving return_token_ids and the render
// endpoint do:
//
//   - P answers POST /v1/chat/completions/render with {"token_ids": [...]},
//     the toy chat rendering of the request's messages, and every other
//     request with the canned prefill answer (one token and a P handle).
//   - D answers with a three-event stream: the first chunk carries the
//     prompt's ids at the top level (prompt_token_ids, when the request
//     sets return_token_ids), the content chunk and the final chunk carry
//     choice 0's generated ids (token_ids: the reply's pieces, then the
//     end-of-turn token), and the final chunk carries a D handle with
//     remote_num_tokens = len(prompt)+len(generated)-1 and ceil(R/16)
//     5-digit block ids in one group.
//
// An honest next turn (the messages plus the canned reply and a new user
// message) renders to a prompt that begins with D's first R tokens, so it
// verifies fully.
func newTokenEngines(tb testing.TB) *tokenEngines {
	tb.Helper()
	te := &tokenEngines{}
	p, d := te.handlers()
	ps, ds := httptest.NewServer(p), httptest.NewServer(d)
	tb.Cleanup(ps.Close)
	tb.Cleanup(ds.Close)
	te.prefill, te.decode = ps.URL, ds.URL
	return te
}

// handlers returns the token-aware prefill and decode handlers.
func (te *tokenEngines) handlers() (prefill, decode http.Handler) {
	var seq atomic.Int64
	p := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != kvroute.PathChatCompletions+"/render" {
			cannedPrefill(w, r, seq.Add(1))
			return
		}
		req, ok := toytok.ReadRequest(w, r)
		if !ok {
			return
		}
		ids := toytok.Chat(req.Messages)
		out := make([]byte, 0, 7*len(ids)+32)
		out = append(out, `{"token_ids":`...)
		out = append(toytok.AppendJSON(out, ids), '}')
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(out)
	})
	d := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		req, ok := toytok.ReadRequest(w, r)
		if !ok {
			return
		}
		n := seq.Add(1)
		prompt := toytok.Chat(req.Messages)
		gen := toyReplyIDs
		tokens := len(prompt) + len(gen) - 1
		handle := toytok.Handle(n, tokens, cannedBlockSize)
		te.handles.Add(1)
		te.handleBytes.Add(int64(len(handle)))
		te.handleTokens.Add(int64(tokens))

		w.Header().Set("Content-Type", "text/event-stream")
		fl := http.NewResponseController(w)
		out := make([]byte, 0, 7*len(prompt)+len(handle)+1024)
		out = fmt.Appendf(out, `data: {"id":"cmpl-d%d","object":"chat.completion.chunk","created":1,"model":"sim-model","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]`, n)
		if req.ReturnTokenIDs {
			out = append(out, `,"prompt_token_ids":`...)
			if te.spacedPromptIDs.Load() {
				out = append(out, '[')
				for i, id := range prompt {
					if i > 0 {
						out = append(out, ", "...)
					}
					out = strconv.AppendUint(out, uint64(id), 10)
				}
				out = append(out, ']')
			} else {
				out = toytok.AppendJSON(out, prompt)
			}
		}
		out = append(out, "}\n\n"...)
		_, _ = w.Write(out)
		_ = fl.Flush()
		out = fmt.Appendf(out[:0], `data: {"id":"cmpl-d%d","object":"chat.completion.chunk","created":1,"model":"sim-model","choices":[{"index":0,"delta":{"content":%q},"logprobs":null,"finish_reason":null`, n, toyReply)
		if req.ReturnTokenIDs {
			out = toytok.AppendJSON(append(out, `,"token_ids":`...), gen[:len(gen)-1])
		}
		out = append(out, "}]}\n\n"...)
		out = fmt.Appendf(out, `data: {"id":"cmpl-d%d","object":"chat.completion.chunk","created":1,"model":"sim-model","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop","stop_reason":null`, n)
		if req.ReturnTokenIDs {
			out = toytok.AppendJSON(append(out, `,"token_ids":`...), gen[len(gen)-1:])
		}
		out = append(out, `}],"kv_transfer_params":`...)
		out = append(out, handle...)
		out = append(out, "}\n\ndata: [DONE]\n\n"...)
		_, _ = w.Write(out)
	})
	return p, d
}

// meanHandle returns the mean JSON size and remote_num_tokens of the D
// handles sent since the counters were last read, and resets them.
func (te *tokenEngines) meanHandle() (bytes, tokens float64) {
	n := float64(te.handles.Swap(0))
	if n == 0 {
		return 0, 0
	}
	return float64(te.handleBytes.Swap(0)) / n, float64(te.handleTokens.Swap(0)) / n
}

// simEngines starts a zero-cost simulated 1P1D pair.
func simEngines(tb testing.TB, blocks int) (prefill, decode string) {
	c := kvroutetest.NewCluster(tb, 1, 1, kvroutetest.WithStreamHandles(true), kvroutetest.WithNumBlocks(blocks))
	return c.Prefill[0].URL(), c.Decode[0].URL()
}

// benchConv is a chat conversation with a large first message.
type benchConv struct {
	id       string
	messages []map[string]string
}

// benchHistory returns about n bytes of tool output.
func benchHistory(n int, salt string) string {
	var b strings.Builder
	b.WriteString(salt)
	words := []string{" func", " return", " err", " nil", " struct", " handle", " decode", " prefill", " stream", " token"}
	for i := 0; b.Len() < n; i++ {
		if i%16 == 15 {
			b.WriteString("\n")
		}
		b.WriteString(words[i%len(words)])
	}
	return b.String()
}

func newBenchConv(id string, hist int) *benchConv {
	return &benchConv{id: id, messages: []map[string]string{
		{"role": "system", "content": "You are a coding agent."},
		{"role": "user", "content": benchHistory(hist, id)},
	}}
}

func (c *benchConv) body() []byte {
	b, _ := json.Marshal(map[string]any{"model": kvroutetest.DefaultModel, "messages": c.messages, "max_tokens": 8, "stream": true})
	return b
}

// turnsPerConv bounds how long a benchmark conversation grows: after it,
// a new conversation starts (a miss).
const turnsPerConv = 8

// ovhResult is what one overhead run measured.
type ovhResult struct {
	added   []time.Duration
	hits    int
	turns   int
	elapsed time.Duration
}

// runOverhead runs n turns through a router at the given concurrency.
func runOverhead(b *testing.B, prefill, decode string, conc, hist, n int) ovhResult {
	b.Helper()
	rt, err := transport.NewTransport()
	if err != nil {
		b.Fatal(err)
	}
	clock := upstreamclock.New(rt)
	r, err := kvroute.New(kvroute.WithPrefill(prefill), kvroute.WithDecode(decode), kvroute.WithTransport(clock))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = r.Close(); rt.CloseIdleConnections() })
	srv := httptest.NewServer(r)
	b.Cleanup(srv.Close)
	crt, err := transport.NewTransport()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(crt.CloseIdleConnections)
	client := &http.Client{Transport: crt}

	var next atomic.Int64
	var mu sync.Mutex
	res := ovhResult{}
	var wg sync.WaitGroup
	b.ResetTimer()
	start := time.Now()
	for w := range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var conv *benchConv
			for k := 0; ; k++ {
				i := next.Add(1)
				if i > int64(n) {
					return
				}
				if k%turnsPerConv == 0 {
					conv = newBenchConv(fmt.Sprintf("w%d-c%d ", w, k), hist)
				}
				id := fmt.Sprintf("ovh-%d", i)
				added, hit, reply, err := benchTurn(client, srv.URL, conv.body(), id, clock)
				if err != nil {
					b.Error(err)
					return
				}
				conv.messages = append(conv.messages,
					map[string]string{"role": "assistant", "content": reply},
					map[string]string{"role": "user", "content": fmt.Sprintf("Now run step %d.", k)})
				mu.Lock()
				res.added = append(res.added, added)
				res.turns++
				if hit {
					res.hits++
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	res.elapsed = time.Since(start)
	b.StopTimer()
	return res
}

// benchTurn posts one streaming turn and returns the TTFT the router added,
// whether it was a hit, and the reply text.
func benchTurn(c *http.Client, url string, body []byte, id string, clock *upstreamclock.Clock) (time.Duration, bool, string, error) {
	req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, url+kvroute.PathChatCompletions, bytes.NewReader(body))
	if err != nil {
		return 0, false, "", err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", id)
	start := time.Now()
	resp, err := c.Do(req)
	if err != nil {
		return 0, false, "", err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		raw, _ := io.ReadAll(resp.Body)
		return 0, false, "", fmt.Errorf("status %d: %s", resp.StatusCode, raw)
	}
	br := bufio.NewReader(resp.Body)
	if _, err := br.Peek(1); err != nil {
		return 0, false, "", err
	}
	ttft := time.Since(start)
	var text strings.Builder
	for {
		line, err := br.ReadBytes('\n')
		if data, ok := bytes.CutPrefix(bytes.TrimRight(line, "\r\n"), []byte("data: ")); ok && !bytes.Equal(data, []byte("[DONE]")) {
			var ch struct {
				Choices []struct {
					Delta struct{ Content string } `json:"delta"`
				} `json:"choices"`
			}
			if json.Unmarshal(data, &ch) == nil && len(ch.Choices) > 0 {
				text.WriteString(ch.Choices[0].Delta.Content)
			}
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			return 0, false, "", err
		}
	}
	return max(0, ttft-clock.Take(id)), resp.Header.Get("X-Bidikv-Reuse") == string(kvroute.ReuseHit), text.String(), nil
}

func benchPercentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	k := int(p/100*float64(len(s))+0.999999) - 1
	return s[min(max(k, 0), len(s)-1)]
}

// BenchmarkOverhead reports the TTFT the router adds (p50, p99, in µs),
// turns per second and the hit rate, per engine kind, history size and
// concurrency. One op is one turn.
func BenchmarkOverhead(b *testing.B) {
	for _, engines := range []string{"canned", "sim"} {
		for _, hist := range []int{10 << 10, 100 << 10} {
			for _, conc := range []int{1, 64, 256} {
				b.Run(fmt.Sprintf("engines=%s/hist=%dKB/conc=%d", engines, hist>>10, conc), func(b *testing.B) {
					var p, d string
					if engines == "canned" {
						p, d = cannedEngines(b)
					} else {
						p, d = simEngines(b, 1<<20)
					}
					b.ReportAllocs()
					res := runOverhead(b, p, d, conc, hist, b.N)
					if res.turns == 0 {
						return
					}
					b.ReportMetric(float64(benchPercentile(res.added, 50))/1e3, "added-p50-µs")
					b.ReportMetric(float64(benchPercentile(res.added, 99))/1e3, "added-p99-µs")
					b.ReportMetric(float64(res.turns)/res.elapsed.Seconds(), "turns/s")
					b.ReportMetric(float64(res.hits)/float64(res.turns), "hit-rate")
				})
			}
		}
	}
}

// BenchmarkRetainedBytes reports the heap a Router keeps per retained
// conversation (after two GCs, with b.N one-turn conversations retained in
// the default store, retention.Memory) next to the size of the handle JSON
// it retains (handle-json-B, the mean of what D sent) and of the encoded
// store entry (entry-B: the router's header, the fingerprint in token mode,
// and the handle); ratio is retained-B/conv over handle-json-B.
//
//	go test -run '^$' -bench RetainedBytes -benchtime 2000x ./kvroute
//
// The sub-benchmarks run the token-aware canned engines in both modes (in
// content mode the router asks for no token ids and D sends none), so that
// both retain D's real-size handle, one block id per 16 tokens:
//
//   - {content,tokens}/hist=1KB: about 280 tokens, 18 block ids (and in
//     token mode a fingerprint of 18 hashes).
//   - {content,tokens}/hist=100KB: about 26k tokens, ~1,600 block ids (and
//     in token mode the ~13 KB fingerprint).
func BenchmarkRetainedBytes(b *testing.B) {
	for _, mode := range []kvroute.VerificationMode{kvroute.VerifyContent, kvroute.VerifyTokens} {
		for _, hist := range []int{1 << 10, 100 << 10} {
			b.Run(fmt.Sprintf("%s/hist=%dKB", mode, hist>>10), func(b *testing.B) {
				te := newTokenEngines(b)
				benchmarkRetained(b, te.prefill, te.decode, mode, hist, te.meanHandle)
			})
		}
	}
}

// sizeStore counts the bytes of the values put in its Store.
type sizeStore struct {
	kvroute.Store
	puts, bytes atomic.Int64
}

func (s *sizeStore) Put(ctx context.Context, key string, value []byte, ttl time.Duration) error {
	s.puts.Add(1)
	s.bytes.Add(int64(len(value)))
	return s.Store.Put(ctx, key, value, ttl)
}

// benchmarkRetained retains b.N one-turn conversations of a hist-byte
// history and reports the heap kept per conversation; handle returns the
// mean handle JSON size and remote_num_tokens of what D sent meanwhile.
func benchmarkRetained(b *testing.B, p, d string, mode kvroute.VerificationMode, hist int, handle func() (bytes, tokens float64)) {
	rt, err := transport.NewTransport()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(rt.CloseIdleConnections)
	mem, err := retention.NewMemory()
	if err != nil {
		b.Fatal(err)
	}
	store := &sizeStore{Store: mem}
	r, err := kvroute.New(kvroute.WithPrefill(p), kvroute.WithDecode(d), kvroute.WithTransport(rt),
		kvroute.WithVerification(kvroute.Verification{Mode: mode}), kvroute.WithStore(store))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = r.Close() })
	// Warm up connections and pools with turns of the same size, then
	// measure from a clean heap.
	for i := range 4 {
		benchDo(b, r, newBenchConv(fmt.Sprintf("warm%d ", i), hist).body())
	}
	st := r.Stats()
	stored0, fallbacks0 := st.Stored, st.TokenFallbacks
	_, _ = handle()
	store.puts.Store(0)
	store.bytes.Store(0)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.GC() // the second GC empties the pools' victim caches
	runtime.ReadMemStats(&before)
	b.ResetTimer()
	for i := range b.N {
		benchDo(b, r, newBenchConv(fmt.Sprintf("c%d ", i), hist).body())
	}
	b.StopTimer()
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&after)
	st = r.Stats()
	if stored := st.Stored - stored0; stored < int64(b.N) {
		b.Fatalf("stored %d of %d handles", stored, b.N)
	}
	if fb := st.TokenFallbacks - fallbacks0; mode == kvroute.VerifyTokens && fb != 0 {
		b.Fatalf("token mode: %d turns retained without a fingerprint", fb)
	}
	hb, ht := handle()
	per := float64(int64(after.HeapAlloc)-int64(before.HeapAlloc)) / float64(b.N)
	b.ReportMetric(per, "retained-B/conv")
	b.ReportMetric(hb, "handle-json-B")
	b.ReportMetric(float64(store.bytes.Load())/float64(store.puts.Load()), "entry-B")
	b.ReportMetric(ht, "tokens/conv")
	b.ReportMetric(per/hb, "ratio")
	runtime.KeepAlive(r)
}

// cannedDHandle is a D handle as the canned decode engine sends it, for a
// turn of 128 tokens.
var cannedDHandle = string(toytok.Handle(12345, 128, cannedBlockSize))

// benchDo runs one streaming turn through Do and drains it.
func benchDo(b *testing.B, r *kvroute.Router, body []byte) {
	resp, err := r.Do(context.Background(), &kvroute.Request{Path: kvroute.PathChatCompletions, Header: http.Header{}, Body: body})
	if err != nil {
		b.Fatal(err)
	}
	if _, err := resp.WriteTo(io.Discard); err != nil {
		b.Fatal(err)
	}
	_ = resp.Close()
}

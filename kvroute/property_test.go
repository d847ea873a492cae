package kvroute_test

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// propClass is one family of engines and clients in the property test.
type propClass struct {
	name        string
	engine      []kvroutetest.Option
	completions bool
	reasoning   bool // replies carry reasoning the template strips
	kwargs      map[string]any
	parts       bool // user content as several text parts
	mutations   []string
}

var propClasses = []propClass{
	{name: "plain", mutations: []string{"edit", "strip", "compact", "tenant", "toolargs", "nogen", "lenient", "reorder"}},
	{name: "reasoning", engine: []kvroutetest.Option{kvroutetest.WithReasoning(true)}, reasoning: true, mutations: []string{"edit", "compact", "tenant"}},
	{name: "inline reasoning", engine: []kvroutetest.Option{kvroutetest.WithReasoning(true), kvroutetest.WithReasoningParser(false)}, reasoning: true, mutations: []string{"edit", "strip"}},
	{name: "thinking off", engine: []kvroutetest.Option{kvroutetest.WithReasoning(true)}, kwargs: map[string]any{"enable_thinking": false}, mutations: []string{"edit", "tenant"}},
	{name: "llama3 trim", engine: []kvroutetest.Option{kvroutetest.WithTemplate("llama3")}, mutations: []string{"edit", "compact"}},
	{name: "openai parts", engine: []kvroutetest.Option{kvroutetest.WithContentFormat("openai")}, parts: true, mutations: []string{"edit", "strip"}},
	{name: "bpe drift", engine: []kvroutetest.Option{kvroutetest.WithDriftRate(0.5)}, mutations: []string{"edit", "toolargs"}},
	{name: "completions", completions: true, mutations: []string{"edit", "strip", "tenant", "lenient"}},
}

// propStats is what a class's conversations add up to.
type propStats struct {
	conversations, turns, hits, partial, wrong, mutated int
	honestSafe, honestReused                            int            // tokens, honest continuations (token mode)
	honestShort                                         map[string]int // honest continuations reusing less than the safe prefix, by outcome
	reasonPrev, reasonReused                            int            // tokens, turns after a reasoning reply (token mode)
	tenantHits                                          int
}

func (s *propStats) add(o propStats) {
	s.conversations += o.conversations
	s.turns += o.turns
	s.hits += o.hits
	s.partial += o.partial
	s.wrong += o.wrong
	s.mutated += o.mutated
	s.honestSafe += o.honestSafe
	s.honestReused += o.honestReused
	for k, n := range o.honestShort {
		if s.honestShort == nil {
			s.honestShort = map[string]int{}
		}
		s.honestShort[k] += n
	}
	s.reasonPrev += o.reasonPrev
	s.reasonReused += o.reasonReused
	s.tenantHits += o.tenantHits
}

// TestRandomConversations runs 3,072 random conversations, 128 for each of
// eight engine and client classes in three runs (token mode against two
// engine setups, content mode), with random
// client-side mutations: edits, stripped or reordered history,
// compaction, a tenant swap, object tool-call arguments edited,
// add_generation_prompt false, lenient flags, reasoning with and without a
// parser, enable_thinking false, a trimming template, text parts under the
// openai content format, BPE drift, and completions prompts ending at any
// boundary. No answer may differ from the single-engine reference, no read
// may hit freed or expired blocks and no prefix-cache hit may be poisoned.
// Token mode runs against the hardest engines (no prefix caching and
// kv_recompute_threshold 0, so every attached token is pulled) and against
// engines with prefix caching (where a bad read would poison P's cache);
// content mode against vLLM's defaults (prefix caching on, threshold 64),
// under which its blind spots (BPE drift, trimming templates: see
// TestContentModeBlindSpots) stay below the engines' recompute threshold.
// In token mode, honest continuations reuse at least 99% of the
// verified-safe maximum (computed here from the reference token ids) and
// turns after a reasoning reply at least 90% of the previous prompt.
func TestRandomConversations(t *testing.T) {
	if testing.Short() {
		t.Skip("long property test")
	}
	const perClass = 128
	runs := []struct {
		name    string
		mode    kvroute.VerificationMode
		engines []kvroutetest.Option
	}{
		// The hardest engines: every verified token is pulled (no local
		// prefix hit, no recompute threshold), so any wrong block shows.
		{"tokens", kvroute.VerifyTokens, []kvroutetest.Option{kvroutetest.WithPrefixCaching(false), kvroutetest.WithRecomputeThreshold(0)}},
		// Prefix caching on and no threshold: what P pulls lands in its
		// prefix cache, so a bad read would poison later hits.
		{"tokens-cached", kvroute.VerifyTokens, []kvroutetest.Option{kvroutetest.WithRecomputeThreshold(0)}},
		// vLLM's defaults.
		{"content", kvroute.VerifyContent, nil},
	}
	for _, run := range runs {
		mode := run.mode
		var (
			mu    sync.Mutex
			total propStats
		)
		for _, cl := range propClasses {
			t.Run(run.name+"/"+cl.name, func(t *testing.T) {
				engine := append(append([]kvroutetest.Option{kvroutetest.WithStreamHandles(true)}, cl.engine...), run.engines...)
				c := kvroutetest.NewCluster(t, 1, 1, engine...)
				rec := &kvroutetest.Records{}
				// Threshold 0: attach every verified prefix, however short.
				r := newRouter(t, c, kvroute.WithThreshold(0), kvroute.WithVerification(kvroute.Verification{Mode: mode}), kvroute.WithObserver(rec))
				url := serve(t, r)
				st := propRun(t, url, rec, cl, engine, mode, 0, perClass)
				t.Logf("%d conversations, %d turns, %d hits (%d partial), %d mutated turns, %d wrong; honest reuse %d of %d safe tokens; after reasoning %d of %d previous-prompt tokens",
					st.conversations, st.turns, st.hits, st.partial, st.mutated, st.wrong, st.honestReused, st.honestSafe, st.reasonReused, st.reasonPrev)
				assert.Zero(t, st.wrong, "answers that differ from the single engine's")
				assert.Zero(t, st.tenantHits, "a swapped tenant reused another tenant's KV")
				for _, e := range append(c.Prefill, c.Decode...) {
					s := e.Stats()
					assert.Zero(t, s.WrongOutputs)
					assert.Zero(t, s.FreedReads)
					assert.Zero(t, s.ExpiredReads)
					assert.Zero(t, s.PoisonedHits)
				}
				if mode == kvroute.VerifyTokens {
					require.Positive(t, st.honestSafe)
					assert.GreaterOrEqual(t, float64(st.honestReused), 0.99*float64(st.honestSafe), "honest continuations; tokens short by outcome: %v", st.honestShort)
					if cl.reasoning {
						assert.GreaterOrEqual(t, float64(st.reasonReused), 0.90*float64(st.reasonPrev), "after reasoning replies")
					}
				} else {
					require.Positive(t, st.hits+st.mutated)
				}
				mu.Lock()
				total.add(st)
				mu.Unlock()
			})
		}
		t.Logf("%s: %d conversations, %d turns, %d hits (%d partial), %d wrong", run.name, total.conversations, total.turns, total.hits, total.partial, total.wrong)
	}
}

func propText(rng *rand.Rand, turn, seed int) string {
	words := []string{"list", "the", "files", "open", "main.go", "run", "tests", "fix", "bug", "in", "parser", "retry", "step"}
	var b strings.Builder
	fmt.Fprintf(&b, "Step %d of task %d:", turn, seed)
	for range 3 + rng.IntN(8) {
		b.WriteString(" " + words[rng.IntN(len(words))])
	}
	return b.String()
}

// propRun runs the conversations of seeds first to first+n-1, four at a
// time, and returns their figures summed.
func propRun(t *testing.T, url string, rec *kvroutetest.Records, cl propClass, engine []kvroutetest.Option, mode kvroute.VerificationMode, first, n int) propStats {
	var (
		mu sync.Mutex
		st propStats
		wg sync.WaitGroup
	)
	work := make(chan int)
	for range 4 {
		wg.Go(func() {
			for seed := range work {
				s := propConversation(t, url, rec, cl, engine, mode, seed, true)
				mu.Lock()
				st.add(s)
				mu.Unlock()
			}
		})
	}
	for i := range n {
		work <- first + i
	}
	close(work)
	wg.Wait()
	return st
}

// propConversation runs one conversation and returns its figures.
func propConversation(t *testing.T, url string, rec *kvroutetest.Records, cl propClass, engine []kvroutetest.Option, mode kvroute.VerificationMode, seed int, strict bool) propStats {
	rng := rand.New(rand.NewPCG(uint64(seed), uint64(len(cl.name))))
	st := propStats{conversations: 1}
	tenant := fmt.Sprintf("Bearer tenant-%d", rng.IntN(3))
	stream := rng.IntN(2) == 0
	var msgs []map[string]any
	prompt := ""
	if cl.completions {
		prompt = fmt.Sprintf("%s Agent %d.\nUser:", systemPrompt, rng.IntN(5))
	} else {
		msgs = append(msgs, map[string]any{"role": "system", "content": fmt.Sprintf("%s You are agent %d.", systemPrompt, rng.IntN(5))})
	}
	var (
		prevSeq    []uint32 // what D's blocks held after the last stored turn
		prevPrompt int
		prevReason bool
		stored     bool
		sharedSlot bool // the conversation's opening may be another's
	)
	turns := 2 + rng.IntN(4)
	for turn := 0; turn < turns; turn++ {
		mutation := ""
		extra := map[string]any{}
		if turn > 0 && rng.IntN(3) == 0 {
			mutation = cl.mutations[rng.IntN(len(cl.mutations))]
			switch mutation {
			case "edit":
				if cl.completions {
					prompt = strings.Replace(prompt, "Agent", "Agent (edited)", 1)
				} else {
					m := msgs[rng.IntN(len(msgs))]
					if s, ok := m["content"].(string); ok {
						m["content"] = s + " (edited)"
					}
				}
			case "strip":
				if cl.completions {
					prompt = prompt[:len(prompt)-3]
				} else {
					for i := len(msgs) - 1; i >= 0; i-- {
						if s, ok := msgs[i]["content"].(string); ok && msgs[i]["role"] == "assistant" && len(s) > 3 {
							msgs[i]["content"] = s[:len(s)/2]
							break
						}
					}
				}
			case "compact":
				if len(msgs) > 3 {
					// Half the summaries are the same text in every
					// conversation: those that open alike then share one
					// retention slot (content-keyed by the opening), and
					// take or replace one another's handles, which must
					// never give a wrong answer; their later turns are left
					// out of the honest-reuse figures.
					summary := fmt.Sprintf("Summary of task %d so far: files listed, tests run.", seed)
					if rng.IntN(2) == 0 {
						summary, sharedSlot = "Summary of the work so far: files listed, tests run.", true
					}
					msgs = append([]map[string]any{msgs[0], {"role": "user", "content": summary}}, msgs[len(msgs)-1])
				}
			case "reorder":
				if len(msgs) > 3 {
					msgs[1], msgs[2] = msgs[2], msgs[1]
				}
			case "tenant":
				tenant += "-other"
			case "toolargs":
				for _, m := range msgs {
					if calls, ok := m["tool_calls"].([]any); ok {
						fn := calls[0].(map[string]any)["function"].(map[string]any)
						fn["arguments"] = map[string]any{"dir": "/edited", "depth": rng.IntN(9)}
					}
				}
			case "nogen":
				extra["add_generation_prompt"] = 0 // pydantic reads 0 as false
			case "lenient":
				if cl.completions {
					extra["echo"] = 0 // false
				} else {
					extra["add_generation_prompt"] = "yes" // true
				}
			}
		}
		if cl.completions {
			// Prompts end anywhere: after a space, inside a word, on a colon.
			prompt += " " + propText(rng, turn, seed) + []string{"\nAssistant:", "\nAssistant: ", " Assis", "\n"}[rng.IntN(4)]
		} else {
			text := propText(rng, turn, seed)
			var content any = text
			if cl.parts && rng.IntN(2) == 0 {
				content = []map[string]any{{"type": "text", "text": text}, {"type": "text", "text": "Context follows."}}
			}
			msgs = append(msgs, map[string]any{"role": "user", "content": content})
		}
		body := map[string]any{"model": kvroutetest.DefaultModel, "max_tokens": 8 + rng.IntN(40), "stream": stream}
		if rng.IntN(5) == 0 && stream {
			body["stream"] = 1 // lenient
		}
		path := kvroute.PathChatCompletions
		if cl.completions {
			path = kvroute.PathCompletions
			body["prompt"] = prompt
		} else {
			body["messages"] = msgs
		}
		if cl.kwargs != nil {
			body["chat_template_kwargs"] = cl.kwargs
		}
		for k, v := range extra {
			body[k] = v
		}
		raw, err := json.Marshal(body)
		require.NoError(t, err)
		id := fmt.Sprintf("prop-%s-%s-%d-%d", mode, strings.ReplaceAll(cl.name, " ", "_"), seed, turn)
		res := post(t, url, path, raw, http.Header{"Authorization": {tenant}, "X-Request-Id": {id}})
		require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
		assert.NotContains(t, string(res.raw), `token_ids":[`, "token ids the client did not ask for")
		ref, err := kvroutetest.Reference(path, raw, engine...)
		require.NoError(t, err)
		tr, _ := rec.Take(id)
		st.turns++
		if res.text != ref.Text {
			st.wrong++
		}
		if res.text != ref.Text && strict {
			t.Errorf("%s: answer differs from the single engine's (reuse %s, verified %d, partial %v)", id, tr.Reuse, tr.VerifiedTokens, tr.Partial)
		}
		hit := tr.Reuse == kvroute.ReuseHit
		if hit {
			st.hits++
			if tr.Partial {
				st.partial++
			}
		}
		switch {
		case mutation == "tenant":
			st.mutated++
			if hit {
				st.tenantHits++
			}
		case mutation != "" && mutation != "lenient":
			st.mutated++
		case stored && mode == kvroute.VerifyTokens && !sharedSlot:
			safe := safePrefix(prevSeq, ref.PromptTokenIDs, kvroutetest.DefaultBlockSize)
			st.honestSafe += safe
			if hit {
				st.honestReused += tr.ReusableTokens
			}
			if got := tr.ReusableTokens; safe > 0 && (!hit || got < safe) {
				if st.honestShort == nil {
					st.honestShort = map[string]int{}
				}
				st.honestShort[fmt.Sprintf("%s/%s (render %v, verified %d)", tr.Reuse, tr.MissReason, tr.Render.Round(time.Millisecond), tr.VerifiedTokens)] += safe - min(got, safe)
			}
			if prevReason {
				st.reasonPrev += prevPrompt
				if hit {
					st.reasonReused += tr.ReusableTokens
				}
			}
		}
		// What D's blocks hold after this turn: prompt and reply tokens but
		// the last one.
		seq := append(append([]uint32(nil), ref.PromptTokenIDs...), ref.TokenIDs...)
		prevSeq, prevPrompt, prevReason, stored = seq[:len(seq)-1], len(ref.PromptTokenIDs), cl.reasoning && ref.Reasoning+ref.Text != "", tr.Stored
		if cl.completions {
			prompt += res.text
		} else {
			msgs = append(msgs, map[string]any{"role": "assistant", "content": res.text})
			if cl.name == "plain" && turn == 0 && rng.IntN(2) == 0 || cl.name == "bpe drift" && turn == 0 {
				// A tool exchange with object arguments, as agents send it.
				msgs = append(msgs,
					map[string]any{"role": "assistant", "content": nil, "tool_calls": []any{map[string]any{
						"id": "call_1", "type": "function", "function": map[string]any{"name": "ls", "arguments": map[string]any{"dir": "."}}}}},
					map[string]any{"role": "tool", "tool_call_id": "call_1", "content": "a.go b.go"})
			}
		}
	}
	return st
}

// safePrefix is the most a router may let P read: the common prefix of what
// D's blocks hold and the new prompt, cut to whole blocks unless it covers
// everything D holds.
func safePrefix(held, prompt []uint32, bs int) int {
	n := 0
	for n < len(held) && n < len(prompt) && held[n] == prompt[n] {
		n++
	}
	if n == len(held) {
		return n
	}
	return n - n%bs
}

// TestContentModeBlindSpots shows what content verification cannot see and
// token verification can: with engines that pull every attached token, BPE
// drift (a reply whose tokens re-tokenize differently) and a template that
// trims message content make content-verified hits read wrong blocks, while
// token verification over the same conversations gives no wrong answer.
func TestContentModeBlindSpots(t *testing.T) {
	if testing.Short() {
		t.Skip("long property test")
	}
	for _, name := range []string{"bpe drift", "llama3 trim"} {
		var cl propClass
		for _, c := range propClasses {
			if c.name == name {
				cl = c
			}
		}
		cl.mutations = []string{"lenient"} // honest clients only
		wrong := map[kvroute.VerificationMode]int{}
		for _, mode := range []kvroute.VerificationMode{kvroute.VerifyContent, kvroute.VerifyTokens} {
			engine := append([]kvroutetest.Option{kvroutetest.WithStreamHandles(true), kvroutetest.WithPrefixCaching(false), kvroutetest.WithRecomputeThreshold(0)}, cl.engine...)
			c := kvroutetest.NewCluster(t, 1, 1, engine...)
			rec := &kvroutetest.Records{}
			r := newRouter(t, c, kvroute.WithThreshold(0), kvroute.WithVerification(kvroute.Verification{Mode: mode}), kvroute.WithObserver(rec))
			url := serve(t, r)
			for seed := range 32 {
				wrong[mode] += propConversation(t, url, rec, cl, engine, mode, seed, false).wrong
			}
		}
		t.Logf("%s: wrong answers: content %d, tokens %d", name, wrong[kvroute.VerifyContent], wrong[kvroute.VerifyTokens])
		assert.Positive(t, wrong[kvroute.VerifyContent], "%s: content mode is expected to be fooled", name)
		assert.Zero(t, wrong[kvroute.VerifyTokens], name)
	}
}

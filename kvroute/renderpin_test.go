package kvroute_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// skewedRenderer fronts a prefill engine whose render and tokenize
// requests are answered by a renderer that disagrees with the engine's own
// generation (a stale or mixed-version renderer behind the engine's URL):
// skew rewrites their bodies before the engine renders them. Completion
// requests pass unchanged.
func skewedRenderer(t *testing.T, target string, skew func([]byte) []byte) string {
	u, err := url.Parse(target)
	require.NoError(t, err)
	rp := httputil.NewSingleHostReverseProxy(u)
	return newServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/render") || r.URL.Path == kvroutetest.PathTokenize {
			b, _ := io.ReadAll(r.Body)
			b = skew(b)
			r.Body, r.ContentLength = io.NopCloser(bytes.NewReader(b)), int64(len(b))
			r.Header.Del("Content-Length")
		}
		rp.ServeHTTP(w, r)
	}))
}

// Issue 21.7: a render answer that disagrees with what the prefill engine
// computes must not give a verified wrong answer. Turn 2 edits the first
// user message; a stale renderer renders it unedited, so the handle of
// turn 1 verifies whole and is attached. The prefill engine's prompt ids
// (return_token_ids on its leg) differ within the attached prefix: the
// turn is redone as a plain miss on another prefill engine (or on the
// decode engine when none is left), the renderer is distrusted, and the
// conversation's later turns avoid the engine whose prefix cache now holds
// the pulled blocks. Every answer is a single engine's.
func TestRenderMismatchRedone(t *testing.T) {
	const edited, original = "Turn one:", "Turn 1:"
	skew := func(b []byte) []byte { return bytes.ReplaceAll(b, []byte(edited), []byte(original)) }
	for _, prefills := range []int{1, 2} {
		for _, path := range []string{kvroute.PathChatCompletions, kvroute.PathCompletions} {
			for _, stream := range []bool{false, true} {
				t.Run(fmt.Sprintf("%dP %s stream=%v", prefills, path, stream), func(t *testing.T) {
					// Every positional read happens, however short (the
					// engines' kv_recompute_threshold at 0).
					c := kvroutetest.NewCluster(t, prefills, 1, kvroutetest.WithStreamHandles(true), kvroutetest.WithRecomputeThreshold(0))
					obs := &kvroutetest.Records{}
					opts := []kvroute.Option{kvroute.WithDecode(c.Decode[0].URL()), kvroute.WithObserver(obs), kvroute.WithThreshold(0)}
					// The first prefill engine has the stale renderer: the
					// selector picks it first for every render.
					opts = append(opts, kvroute.WithPrefill(skewedRenderer(t, c.Prefill[0].URL(), skew)))
					for _, e := range c.Prefill[1:] {
						opts = append(opts, kvroute.WithPrefill(e.URL()))
					}
					opts = append(opts, kvroute.WithSelector(firstHealthy{}))
					r, err := kvroute.New(opts...)
					require.NoError(t, err)
					t.Cleanup(func() { _ = r.Close() })
					url := serve(t, r)
					// A conversation id keeps the conversation's key through
					// the edit of its first message.
					conv := &conversation{path: path, stream: stream, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}},
						extra: map[string]any{"conversation_id": "c1"}}
					if path == kvroute.PathCompletions {
						conv.prompt = systemPrompt
					}
					ask := func(i int) {
						t.Helper()
						conv.say(userText(i))
						body := conv.body()
						res := post(t, url, path, body, nil)
						require.Equal(t, http.StatusOK, res.status, "turn %d: %s", i, res.raw)
						assert.Equal(t, reference(t, path, body), res.text, "turn %d differs from a single engine's", i)
						conv.hear(res.text)
					}
					ask(1)
					// The client edits its first message: "Turn 1:" becomes
					// "Turn one:", which the stale renderer does not see.
					if path == kvroute.PathChatCompletions {
						conv.messages[1].Content = strings.Replace(conv.messages[1].Content, original, edited, 1)
					} else {
						conv.prompt = strings.Replace(conv.prompt, original, edited, 1)
					}
					ask(2)
					rec := obs.Last()
					assert.Equal(t, kvroute.MissRenderMismatch, rec.MissReason)
					assert.Equal(t, int64(1), r.Stats().RenderMismatches)
					defer func() { assert.Equal(t, int64(3), r.Stats().AvoidedEngineTurns, "turns 3 to 5 kept off the engine") }()
					for i := 3; i <= 5; i++ {
						ask(i)
					}
					for _, e := range append(c.Prefill, c.Decode...) {
						st := e.Stats()
						assert.Zero(t, st.WrongOutputs, "wrong outputs")
						if e != c.Prefill[0] {
							assert.Zero(t, st.PoisonedHits, "poisoned prefix-cache hits")
						}
					}
					assert.Zero(t, c.Prefill[0].Stats().PoisonedHits, "the conversation's later turns avoid the engine that pulled for the wrong prompt")
				})
			}
		}
	}
}

// firstHealthy picks the first candidate: the stale renderer's engine
// whenever it is allowed.
type firstHealthy struct{}

func (firstHealthy) Select(context.Context, *kvroute.Selection) (int, error) { return 0, nil }

// Issue 21.7: the render call and the prefill leg that carries the handle
// go to the same prefill engine, whatever the Selector would pick for the
// leg, so that the tokens verified are those that engine computes (the
// only line of defence on Responses and Messages, which return no token
// ids); on chat and completions the leg asks for its prompt ids.
func TestRenderAndPrefillOnOneEngine(t *testing.T) {
	apis := []struct {
		path string
		body func(turn int) []byte
		hear func(raw []byte, turn int)
	}{}
	for _, path := range []string{kvroute.PathChatCompletions, kvroute.PathCompletions} {
		conv := &conversation{path: path, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}, prompt: systemPrompt}
		apis = append(apis, struct {
			path string
			body func(turn int) []byte
			hear func(raw []byte, turn int)
		}{path, func(i int) []byte { conv.say(userText(i)); return conv.body() },
			func(raw []byte, _ int) { text, _ := parseBody(t, raw); conv.hear(text) }})
	}
	for _, path := range []string{kvroute.PathResponses, kvroute.PathMessages} {
		base := codexBase()
		if path == kvroute.PathMessages {
			base = claudeBase()
		}
		conv := &agentConv{path: path, base: base}
		apis = append(apis, struct {
			path string
			body func(turn int) []byte
			hear func(raw []byte, turn int)
		}{path, func(i int) []byte { conv.say(userText(i)); return conv.body() },
			func(raw []byte, i int) { text, _ := agentText(t, path, raw, false); conv.hear(text, i) }})
	}
	for _, api := range apis {
		t.Run(api.path, func(t *testing.T) {
			c := kvroutetest.NewCluster(t, 3, 2)
			r := newRouter(t, c)
			url := serve(t, r)
			for i := 1; i <= 10; i++ {
				body := api.body(i)
				res := send(t, url, api.path, body, nil)
				require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
				api.hear(res.raw, i)
			}
			renders := map[string]string{} // request id -> prefill engine URL
			for _, e := range c.Prefill {
				for _, rec := range e.Requests() {
					if rec.Role == "render" {
						renders[strings.TrimSuffix(rec.RequestID, "-render")] = e.URL()
					}
				}
			}
			hits := 0
			for _, e := range c.Prefill {
				for _, rec := range e.Requests() {
					if rec.Role != "prefill" {
						continue
					}
					var b struct {
						KV  map[string]json.RawMessage `json:"kv_transfer_params"`
						IDs bool                       `json:"return_token_ids"`
					}
					require.NoError(t, json.Unmarshal(rec.Body, &b))
					if string(b.KV["remote_engine_id"]) == "null" {
						continue
					}
					hits++
					assert.Equal(t, renders[rec.RequestID], e.URL(), "turn %s: rendered on one engine, prefilled on another", rec.RequestID)
					tokenAPI := api.path == kvroute.PathChatCompletions || api.path == kvroute.PathCompletions
					assert.Equal(t, tokenAPI, b.IDs, "the leg asks for the prompt ids it computes where the API returns them")
				}
			}
			assert.GreaterOrEqual(t, hits, 8)
			for _, e := range append(c.Prefill, c.Decode...) {
				assert.Zero(t, e.Stats().WrongOutputs)
			}
		})
	}
}

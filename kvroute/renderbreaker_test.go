package kvroute_test

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// badRenderer fronts a prefill engine whose render routes hang (until the
// caller gives up, or release is called) or fail with 500; every other
// request passes. calls counts the render requests that reached it.
type badRenderer struct {
	url     string
	hang    bool
	calls   atomic.Int32
	mu      sync.Mutex
	release chan struct{}
}

func newBadRenderer(t *testing.T, target string, hang bool) *badRenderer {
	u, err := url.Parse(target)
	require.NoError(t, err)
	rp := httputil.NewSingleHostReverseProxy(u)
	b := &badRenderer{hang: hang, release: make(chan struct{})}
	b.url = newServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasSuffix(r.URL.Path, "/render") && r.URL.Path != kvroutetest.PathTokenize {
			rp.ServeHTTP(w, r)
			return
		}
		b.calls.Add(1)
		// Read the body, so that the server notices a client that gives
		// up (it reads the connection once the body is in).
		body, _ := io.ReadAll(r.Body)
		r.Body = io.NopCloser(bytes.NewReader(body))
		b.mu.Lock()
		hang := b.hang
		b.mu.Unlock()
		if !hang {
			http.Error(w, `{"error":{"message":"renderer down","type":"InternalServerError","code":500}}`, http.StatusInternalServerError)
			return
		}
		b.mu.Lock()
		release := b.release
		b.mu.Unlock()
		select {
		case <-r.Context().Done():
		case <-release:
			rp.ServeHTTP(w, r)
		}
	}))
	// Cleanups run last first: the waiting handlers end before the server
	// closes.
	t.Cleanup(b.heal)
	return b
}

// heal makes the renderer answer again, those waiting included.
func (b *badRenderer) heal() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.hang || b.release != nil {
		select {
		case <-b.release:
		default:
			close(b.release)
		}
	}
	b.hang = false
}

// Issue 21.16: a render endpoint that hangs or fails costs at most the
// turns that meet it before its circuit breaker opens, not every turn:
// after one call that ran out of WithRenderTimeout (or three failures),
// the engine is not asked to render until its breaker's trial, and turns
// go on without a render (verified by content rules, or, on Responses and
// Messages, not retained), each with a single engine's answer.
func TestBrokenRendererBreaker(t *testing.T) {
	type api struct {
		path  string
		first func(conv int) []byte // the first turn of conversation conv
	}
	apis := []api{
		{kvroute.PathChatCompletions, nil},
		{kvroute.PathResponses, func(conv int) []byte {
			c := &agentConv{path: kvroute.PathResponses, base: codexBase()}
			c.say(fmt.Sprintf("Conversation %d: %s", conv, userText(conv)))
			return c.body()
		}},
		{kvroute.PathMessages, func(conv int) []byte {
			c := &agentConv{path: kvroute.PathMessages, base: claudeBase()}
			c.say(fmt.Sprintf("Conversation %d: %s", conv, userText(conv)))
			return c.body()
		}},
	}
	for _, a := range apis {
		for _, hang := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s hang=%v", a.path, hang), func(t *testing.T) {
				c := kvroutetest.NewCluster(t, 1, 1)
				bad := newBadRenderer(t, c.Prefill[0].URL(), hang)
				r, err := kvroute.New(kvroute.WithPrefill(bad.url), kvroute.WithDecode(c.Decode[0].URL()),
					kvroute.WithTimeouts(kvroute.Timeouts{Render: 300 * time.Millisecond}))
				require.NoError(t, err)
				t.Cleanup(func() { _ = r.Close() })
				url := serve(t, r)
				const turns = 8
				if a.first == nil {
					// One chat conversation: every later turn is a hit
					// candidate, verified by a render.
					conv := &conversation{path: a.path, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
					for i := 1; i <= turns; i++ {
						conv.say(userText(i))
						body := conv.body()
						res := post(t, url, a.path, body, nil)
						require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
						assert.Equal(t, reference(t, a.path, body), res.text)
						conv.hear(res.text)
					}
				} else {
					// First turns of many conversations: each renders its
					// prompt for the next turn's fingerprint.
					for i := 1; i <= turns; i++ {
						body := a.first(i)
						res := send(t, url, a.path, body, nil)
						require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
						text, _ := agentText(t, a.path, res.raw, false)
						ref, err := kvroutetest.Reference(a.path, body)
						require.NoError(t, err)
						assert.Equal(t, ref.Text, text)
					}
				}
				want := int32(3) // failures before the breaker opens
				if hang {
					want = 1 // one call that ran out of the render budget
				}
				assert.Equal(t, want, bad.calls.Load(), "render calls that reached the broken renderer")
				st := r.Stats()
				assert.Equal(t, int64(1), st.RenderBreaks)
				assert.Positive(t, st.RenderSkipped)
				assert.Zero(t, c.Decode[0].Stats().WrongOutputs)
			})
		}
	}
}

// Issue 21.16: once the breaker's time is up, one turn's render is its
// trial call, and a Responses turn never waits for a trial: its answer goes
// out, and its handle is retained when the renderer answers.
func TestRenderBreakerTrialNotWaited(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1)
	bad := newBadRenderer(t, c.Prefill[0].URL(), true)
	clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
	obs := &kvroutetest.Records{}
	r, err := kvroute.New(kvroute.WithPrefill(bad.url), kvroute.WithDecode(c.Decode[0].URL()),
		kvroute.WithTimeouts(kvroute.Timeouts{Render: time.Minute}), kvroute.WithClock(clk.Now), kvroute.WithObserver(obs))
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	url := serve(t, r)
	turn := func(i int) kvroute.TurnRecord {
		t.Helper()
		conv := &agentConv{path: kvroute.PathResponses, base: codexBase()}
		conv.say(fmt.Sprintf("Conversation %d: %s", i, userText(i)))
		res := send(t, url, kvroute.PathResponses, conv.body(), nil)
		require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
		return obs.Last()
	}
	// Three failing renders open the breaker.
	bad.mu.Lock()
	bad.hang = false // fail fast with 500 to open the breaker
	bad.mu.Unlock()
	for i := 1; i <= 3; i++ {
		assert.Equal(t, kvroute.RefuseUnrendered, turn(i).StoreRefusal)
	}
	require.Equal(t, int64(1), r.Stats().RenderBreaks)
	assert.NotEqual(t, kvroute.RefuseRenderPending, turn(4).StoreRefusal)
	assert.Equal(t, int32(3), bad.calls.Load(), "breaker open: no render")
	// Past the breaker's time the next render is the trial: it hangs, and
	// the turn does not wait for it.
	bad.mu.Lock()
	bad.hang = true
	bad.mu.Unlock()
	clk.Advance(time.Hour)
	rec := turn(5)
	assert.Equal(t, kvroute.RefuseRenderPending, rec.StoreRefusal)
	stored := r.Stats().Stored
	bad.heal()
	for range 4000 { // at most 20 s: the trial's answer is retained in the background
		if r.Stats().Stored > stored {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	assert.Equal(t, stored+1, r.Stats().Stored, "retained once the trial answered")
}

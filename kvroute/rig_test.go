package kvroute_test

import (
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// tally counts what a fault run did, for the totals in the report.
type tally struct {
	mu                                    sync.Mutex
	faults, turns, correct, errors, wrong int
	freedReads, expiredReads              int
}

func (t *tally) add(o *tally) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.faults += o.faults
	t.turns += o.turns
	t.correct += o.correct
	t.errors += o.errors
	t.wrong += o.wrong
	t.freedReads += o.freedReads
	t.expiredReads += o.expiredReads
}

// endpointKinds returns the endpoint events obs saw, each as its kind and
// endpoint.
func endpointKinds(obs *kvroutetest.Records) []string {
	var out []string
	for _, ev := range obs.Endpoints() {
		out = append(out, string(ev.Kind)+" "+ev.Endpoint)
	}
	return out
}

// rig is a router over a cluster with one conversation through it.
type rig struct {
	t    *testing.T
	c    *kvroutetest.Cluster
	r    *kvroute.Router
	url  string
	obs  *kvroutetest.Records
	conv *conversation
	n    tally
}

func newRig(t *testing.T, c *kvroutetest.Cluster, stream bool, opts ...kvroute.Option) *rig {
	obs := &kvroutetest.Records{}
	r := newRouter(t, c, append([]kvroute.Option{kvroute.WithObserver(obs)}, opts...)...)
	g := &rig{t: t, c: c, r: r, url: serve(t, r), obs: obs}
	g.conv = &conversation{path: kvroute.PathChatCompletions, stream: stream, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
	return g
}

// engine returns the cluster engine at url.
func (g *rig) engine(url string) *kvroutetest.Engine {
	for _, e := range append(append([]*kvroutetest.Engine(nil), g.c.Prefill...), g.c.Decode...) {
		if e.URL() == url {
			return e
		}
	}
	g.t.Fatalf("no engine at %q", url)
	return nil
}

// lastDecode and lastPrefill are the engines of the last successful turn.
func (g *rig) lastDecode() *kvroutetest.Engine  { return g.engine(g.obs.Last().DecodeEndpoint) }
func (g *rig) lastPrefill() *kvroutetest.Engine { return g.engine(g.obs.Last().PrefillEndpoint) }

// turn sends the conversation's next turn and checks the answer against
// the single-engine reference; mayFail allows a clear error instead.
func (g *rig) turn(i int, mayFail bool) turnResult {
	t := g.t
	t.Helper()
	g.conv.say(userText(i))
	body := g.conv.body()
	res, streamErr := postLenient(t, g.url, g.conv.path, body)
	g.n.turns++
	if res.status != http.StatusOK || streamErr {
		g.n.errors++
		require.True(t, mayFail, "turn %d failed: %d %s", i, res.status, res.raw)
		// A clear error: OpenAI-shaped JSON, or an SSE error event.
		require.Contains(t, string(res.raw), `"error"`, "turn %d", i)
		g.conv.messages = g.conv.messages[:len(g.conv.messages)-1]
		return res
	}
	if res.text == reference(t, g.conv.path, body) {
		g.n.correct++
	} else {
		g.n.wrong++
		t.Errorf("turn %d: answer differs from the single-engine reference", i)
	}
	g.conv.hear(res.text)
	return res
}

// finish adds the engines' read counters and checks them.
func (g *rig) finish() {
	for _, e := range append(append([]*kvroutetest.Engine(nil), g.c.Prefill...), g.c.Decode...) {
		st := e.Stats()
		g.n.freedReads += st.FreedReads
		g.n.expiredReads += st.ExpiredReads
	}
	g.t.Logf("faults %d turns %d correct %d errors %d wrong %d freed reads %d expired reads %d",
		g.n.faults, g.n.turns, g.n.correct, g.n.errors, g.n.wrong, g.n.freedReads, g.n.expiredReads)
	require.Zero(g.t, g.n.freedReads, "reads of freed blocks")
	require.Zero(g.t, g.n.expiredReads, "reads of expired blocks")
	require.Zero(g.t, g.n.wrong, "wrong answers")
}

// postLenient is post for turns that may end in an SSE error event.
func postLenient(t testing.TB, url, path string, body []byte) (turnResult, bool) {
	t.Helper()
	res := send(t, url, path, body, nil)
	if res.status != http.StatusOK {
		return res, false
	}
	if !res.streamed() {
		res.text, res.finish = parseBody(t, res.raw)
		return res, false
	}
	s := scanStream(t, res.raw)
	res.text = s.text
	return res, s.errData != "" || !s.done
}

// instantTimer is a backoff.Timer that fires at once and records waits.
type instantTimer struct {
	mu    *sync.Mutex
	waits *[]time.Duration
	c     chan time.Time
}

func (t *instantTimer) Start(d time.Duration) {
	t.mu.Lock()
	*t.waits = append(*t.waits, d)
	t.mu.Unlock()
	t.c = make(chan time.Time, 1)
	t.c <- time.Time{}
}
func (t *instantTimer) Stop()               {}
func (t *instantTimer) C() <-chan time.Time { return t.c }

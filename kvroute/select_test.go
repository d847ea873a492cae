package kvroute_test

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/transport"
)

func cands(inflight ...int) []kvroute.Candidate {
	out := make([]kvroute.Candidate, len(inflight))
	for i, n := range inflight {
		out[i] = kvroute.Candidate{URL: fmt.Sprintf("http://10.0.0.%d:8000", i+1), InFlight: n, Weight: 1, Rank: transport.NoRank, Healthy: true}
	}
	return out
}

func TestLeastLoaded(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name string
		sel  *kvroute.LeastLoaded
		s    kvroute.Selection
		want []int // acceptable answers
	}{
		{"decode least in-flight", &kvroute.LeastLoaded{}, kvroute.Selection{Phase: kvroute.PhaseDecode, Candidates: cands(3, 1, 2)}, []int{1}},
		{"affinity wins over load", &kvroute.LeastLoaded{MaxInFlight: 8}, kvroute.Selection{Phase: kvroute.PhaseDecode, Candidates: cands(5, 0, 0), Affinity: "http://10.0.0.1:8000"}, []int{0}},
		{"affinity over the limit", &kvroute.LeastLoaded{MaxInFlight: 5}, kvroute.Selection{Phase: kvroute.PhaseDecode, Candidates: cands(5, 2, 1), Affinity: "http://10.0.0.1:8000"}, []int{2}},
		{"prefill two choices never takes the busiest", &kvroute.LeastLoaded{}, kvroute.Selection{Phase: kvroute.PhasePrefill, Candidates: cands(9, 1, 2, 3)}, []int{1, 2, 3}},
		{"weight scales load", &kvroute.LeastLoaded{}, kvroute.Selection{Phase: kvroute.PhaseDecode, Candidates: func() []kvroute.Candidate {
			c := cands(4, 3)
			c[0].Weight = 4
			return c
		}()}, []int{0}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for range 50 {
				i, err := tt.sel.Select(ctx, &tt.s)
				require.NoError(t, err)
				assert.Contains(t, tt.want, i)
			}
		})
	}
}

func TestLeastLoadedHints(t *testing.T) {
	ctx := context.Background()
	sel := &kvroute.LeastLoaded{HashHints: true, MaxInFlight: 4}
	four := cands(0, 0, 0, 0)
	spread := map[int]int{}
	for k := range 200 {
		hint := fmt.Sprintf("session-%d", k)
		i, err := sel.Select(ctx, &kvroute.Selection{Phase: kvroute.PhaseDecode, Candidates: four, Hint: hint})
		require.NoError(t, err)
		j, _ := sel.Select(ctx, &kvroute.Selection{Phase: kvroute.PhasePrefill, Candidates: four, Hint: hint})
		assert.Equal(t, i, j, "a hint pins both legs to the same place")
		spread[i]++
		// Removing another engine does not move the hint.
		var rest []kvroute.Candidate
		other := (i + 1) % 4
		for n, c := range four {
			if n != other {
				rest = append(rest, c)
			}
		}
		m, _ := sel.Select(ctx, &kvroute.Selection{Phase: kvroute.PhaseDecode, Candidates: rest, Hint: hint})
		assert.Equal(t, four[i].URL, rest[m].URL)
	}
	assert.Len(t, spread, 4, "hints spread over every engine")
	busy := cands(4, 0, 0, 0)
	for k := range 50 {
		i, _ := sel.Select(ctx, &kvroute.Selection{Phase: kvroute.PhaseDecode, Candidates: busy, Hint: fmt.Sprintf("s%d", k)})
		assert.NotEqual(t, 0, i, "an engine over the limit is passed over")
	}
}

// Agents name their session in headers (Claude Code's
// x-claude-code-session-id, Codex's session_id, ...): with HashHints, a
// request without a conversation hint is pinned by its session, both legs
// to one place, for placement only; a conversation hint goes first, and
// SessionHeaders chooses which headers are read (empty: none).
func TestLeastLoadedSessionHeaders(t *testing.T) {
	ctx := context.Background()
	four := cands(0, 0, 0, 0)
	req := func(name, value string) *kvroute.Request {
		h := http.Header{}
		h.Set(name, value) // as a server canonicalises it
		return &kvroute.Request{Path: kvroute.PathMessages, Header: h}
	}
	sel := &kvroute.LeastLoaded{HashHints: true}
	for _, name := range []string{"x-claude-code-session-id", "session_id", "Session-Id", "X-Session-Affinity", "X-Dynamo-Session-ID"} {
		spread := map[int]int{}
		for k := range 100 {
			r := req(name, fmt.Sprintf("sess-%d", k))
			i, err := sel.Select(ctx, &kvroute.Selection{Phase: kvroute.PhaseDecode, Candidates: four, Request: r})
			require.NoError(t, err)
			for range 3 {
				j, _ := sel.Select(ctx, &kvroute.Selection{Phase: kvroute.PhasePrefill, Candidates: four, Request: req(name, fmt.Sprintf("sess-%d", k))})
				assert.Equal(t, i, j, "%s: one session, one place for both legs", name)
			}
			spread[i]++
		}
		assert.Len(t, spread, 4, "%s: sessions spread over every engine", name)
	}
	// Without any session header, or with the headers turned off, turns
	// rotate over idle engines as before.
	for _, s := range []*kvroute.LeastLoaded{{HashHints: true}, {HashHints: true, SessionHeaders: []string{}}, {SessionHeaders: []string{"X-Claude-Code-Session-Id"}}} {
		seen := map[int]bool{}
		for range 8 {
			r := req("X-Other", "x")
			if s.SessionHeaders != nil {
				r = req("X-Claude-Code-Session-Id", "one-session")
			}
			i, _ := s.Select(ctx, &kvroute.Selection{Phase: kvroute.PhaseDecode, Candidates: four, Request: r})
			seen[i] = true
		}
		assert.Greater(t, len(seen), 1, "%+v: not pinned", s)
	}
	// Codex's x-codex-turn-metadata is a JSON object: its session_id,
	// else thread_id, pins the turn; its turn_id, which changes every
	// turn, does not, nor does a value that is not JSON of that shape.
	meta := func(v string) int {
		i, err := sel.Select(ctx, &kvroute.Selection{Phase: kvroute.PhaseDecode, Candidates: four, Request: req("X-Codex-Turn-Metadata", v)})
		require.NoError(t, err)
		return i
	}
	plain := func(v string) int {
		i, err := sel.Select(ctx, &kvroute.Selection{Phase: kvroute.PhaseDecode, Candidates: four, Request: req("Session-Id", v)})
		require.NoError(t, err)
		return i
	}
	moved := 0
	for k := range 40 {
		id := fmt.Sprintf("codex-%d", k)
		assert.Equal(t, plain(id), meta(fmt.Sprintf(`{"turn_id":"t%d","session_id":%q,"sandbox":"none"}`, k, id)), "session_id read")
		assert.Equal(t, plain(id), meta(fmt.Sprintf(`{"thread_id":%q,"turn_id":"t%d"}`, id, 2*k)), "thread_id read without session_id")
		// Turn ids alone: not pinned, so one session's turns rotate.
		seen := map[int]bool{}
		for j := range 8 {
			seen[meta(fmt.Sprintf(`{"turn_id":"%s-%d"}`, id, j))] = true
			seen[meta(`{"session_id":`+id)] = true // not JSON: not read
		}
		if len(seen) > 1 {
			moved++
		}
	}
	assert.Equal(t, 40, moved, "a metadata header without a session pins nothing")
	// A conversation hint goes before the session.
	r := req("X-Claude-Code-Session-Id", "one-session")
	byHint, _ := sel.Select(ctx, &kvroute.Selection{Phase: kvroute.PhaseDecode, Candidates: four, Hint: "conv-7"})
	both, _ := sel.Select(ctx, &kvroute.Selection{Phase: kvroute.PhaseDecode, Candidates: four, Hint: "conv-7", Request: r})
	assert.Equal(t, byHint, both)
}

func TestRoundRobin(t *testing.T) {
	var rr kvroutetest.RoundRobin
	var got []int
	for range 3 {
		p, _ := rr.Select(context.Background(), &kvroute.Selection{Phase: kvroute.PhasePrefill, Candidates: cands(0, 0, 0)})
		d, _ := rr.Select(context.Background(), &kvroute.Selection{Phase: kvroute.PhaseDecode, Candidates: cands(0, 0, 0)})
		got = append(got, p, d)
	}
	assert.Equal(t, []int{0, 0, 1, 1, 2, 2}, got, "each phase rotates on its own")
}

// TestEjection checks passive ejection, the fallback to ejected engines,
// and re-admission after the backoff, on a virtual clock.
func TestEjection(t *testing.T) {
	clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
	c := kvroutetest.NewCluster(t, 1, 2, kvroutetest.WithClock(clk))
	bad := c.Decode[0]
	g := newRig(t, c, false, kvroute.WithHealth(kvroute.Health{EjectAfter: 2, EjectBackoff: time.Minute, MaxEjectBackoff: time.Minute}), kvroute.WithReuse(false),
		kvroute.WithSelector(&kvroutetest.RoundRobin{}))
	bad.Refuse(true)
	for i := 1; i <= 4; i++ {
		g.turn(i, false)
	}
	assert.Contains(t, endpointKinds(g.obs), string(kvroute.EndpointEjected)+" "+bad.URL())
	var st kvroute.EndpointStatus
	for _, s := range g.r.Endpoints(kvroute.PhaseDecode) {
		if s.URL == bad.URL() {
			st = s
		}
	}
	assert.False(t, st.Healthy)
	assert.GreaterOrEqual(t, st.Failures, 2)
	bad.Refuse(false)
	before := len(bad.Requests())
	for i := 5; i <= 6; i++ {
		g.turn(i, false)
	}
	assert.Equal(t, before, len(bad.Requests()), "an ejected engine gets no turns")
	clk.Advance(2 * time.Minute)
	for i := 7; i <= 9; i++ {
		g.turn(i, false)
	}
	assert.Greater(t, len(bad.Requests()), before, "re-admitted after the backoff")
	assert.Contains(t, endpointKinds(g.obs), string(kvroute.EndpointReadmitted)+" "+bad.URL())
	g.finish()
}

// obsChan sends endpoint events to a channel.
type obsChan chan kvroute.EndpointEvent

func (o obsChan) ObserveTurn(*kvroute.TurnRecord)          {}
func (o obsChan) ObserveEndpoint(ev kvroute.EndpointEvent) { o <- ev }

// TestHealthProbe checks that the active probe ejects a closed engine and
// that Close stops it (goleak in TestMain).
func TestHealthProbe(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 2)
	events := make(obsChan, 64)
	r := newRouter(t, c, kvroute.WithObserver(events), kvroute.WithHealth(kvroute.Health{ProbeInterval: 5 * time.Millisecond, ProbeTimeout: time.Second, EjectAfter: 1, EjectBackoff: time.Hour, MaxEjectBackoff: time.Hour}))
	c.Decode[1].Close()
	for ev := range events {
		if ev.Kind == kvroute.EndpointEjected {
			assert.Equal(t, c.Decode[1].URL(), ev.Endpoint)
			assert.Equal(t, kvroute.PhaseDecode, ev.Phase)
			assert.Error(t, ev.Err)
			break
		}
	}
	require.NoError(t, r.Close())
}

func TestSetEndpoints(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 2)
	events := make(obsChan, 64)
	r, err := kvroute.New(kvroute.WithPrefill(c.Prefill[0].URL()), kvroute.WithDecode(c.Decode[0].URL()), kvroute.WithObserver(events))
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	ep1, err := transport.ParseEndpoint(c.Decode[1].URL())
	require.NoError(t, err)
	ep1.Rank = 2
	require.NoError(t, r.SetEndpoints(kvroute.PhaseDecode, ep1))
	got := []kvroute.EndpointEventKind{(<-events).Kind, (<-events).Kind}
	assert.ElementsMatch(t, []kvroute.EndpointEventKind{kvroute.EndpointAdded, kvroute.EndpointRemoved}, got)
	st := r.Endpoints(kvroute.PhaseDecode)
	require.Len(t, st, 1)
	assert.Equal(t, c.Decode[1].URL()+" (rank 2)", st[0].URL)

	url := serve(t, r)
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 8, messages: []message{{Role: "user", Content: "hi"}}}
	res := post(t, url, conv.path, conv.body(), nil)
	require.Equal(t, 200, res.status, "%s", res.raw)
	recs := roleRecords(c.Decode[1], "decode")
	require.Len(t, recs, 1)
	assert.Equal(t, "2", recs[0].Header.Get(transport.RankHeader), "the rank header reaches the engine")
	assert.Empty(t, roleRecords(c.Decode[0], "decode"))

	for _, bad := range [][]transport.Endpoint{{ep1, ep1}, {{}}} {
		assert.ErrorIs(t, r.SetEndpoints(kvroute.PhaseDecode, bad...), kvroute.ErrInvalidConfig)
	}
	assert.ErrorIs(t, r.SetEndpoints(kvroute.PhaseLookup, ep1), kvroute.ErrInvalidConfig)
	assert.Len(t, r.Endpoints(kvroute.PhaseDecode), 1, "a rejected change changes nothing")
}

// TestSetEndpointsEmpty checks that no endpoints at all empties a phase:
// turns fail with a 503 naming no endpoint, and work again once endpoints
// are back.
func TestSetEndpointsEmpty(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1)
	r := newRouter(t, c)
	url := serve(t, r)
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 8, messages: []message{{Role: "user", Content: "hi"}}}
	require.NoError(t, r.SetEndpoints(kvroute.PhaseDecode))
	assert.Empty(t, r.Endpoints(kvroute.PhaseDecode))
	res := post(t, url, conv.path, conv.body(), nil)
	assert.Equal(t, http.StatusServiceUnavailable, res.status, "%s", res.raw)
	assert.Contains(t, string(res.raw), "no endpoint")
	assert.Empty(t, roleRecords(c.Decode[0], "decode"))

	ep, err := transport.ParseEndpoint(c.Decode[0].URL())
	require.NoError(t, err)
	require.NoError(t, r.SetEndpoints(kvroute.PhaseDecode, ep))
	res = post(t, url, conv.path, conv.body(), nil)
	require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
	assert.Equal(t, reference(t, conv.path, conv.body()), res.text)
}

// TestGoneDecodeHandle checks that a retained handle of a decode engine
// that SetEndpoints removed is never attached (so no prefill engine tries
// to pull from it): the turn is a counted endpoint_gone miss with the
// reference answer, and the handle is put back for another router sharing
// the store.
func TestGoneDecodeHandle(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 2)
	obs := &kvroutetest.Records{}
	r, err := kvroute.New(kvroute.WithPrefill(c.Prefill[0].URL()), kvroute.WithDecode(c.Decode[0].URL()), kvroute.WithObserver(obs))
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	g := &rig{t: t, c: c, r: r, url: serve(t, r), obs: obs}
	g.conv = &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
	g.turn(0, false)
	require.Equal(t, c.Decode[0].URL(), obs.Last().DecodeEndpoint)
	require.True(t, obs.Last().Stored)

	d1, err := transport.ParseEndpoint(c.Decode[1].URL())
	require.NoError(t, err)
	require.NoError(t, r.SetEndpoints(kvroute.PhaseDecode, d1))
	pulled := c.Prefill[0].Stats().TokensPulledIn
	failed := c.Prefill[0].Stats().LoadFailures
	g.turn(1, false)
	rec := obs.Last()
	assert.Equal(t, kvroute.ReuseMiss, rec.Reuse)
	assert.Equal(t, kvroute.MissEndpointGone, rec.MissReason)
	assert.Equal(t, c.Decode[1].URL(), rec.DecodeEndpoint)
	assert.Equal(t, 1, rec.PrefillAttempts, "one prefill attempt: no failed pull from the removed engine")
	assert.Equal(t, pulled, c.Prefill[0].Stats().TokensPulledIn, "P pulled nothing: the handle was not attached")
	assert.Equal(t, failed, c.Prefill[0].Stats().LoadFailures, "P tried no read from the removed engine")
	st := r.Stats()
	assert.EqualValues(t, 1, st.GoneHandles)
	assert.EqualValues(t, 1, st.PutBacks, "the unused handle went back to the store")
	assert.Zero(t, st.HitRetries)

}

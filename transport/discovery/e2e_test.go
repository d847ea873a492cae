package discovery_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/transport"
	"github.com/bidikv/bidikv/transport/discovery"
)

// pools is a P and a D pool published as SRV records by a DNS server on
// 127.0.0.1 (all engines listen on 127.0.0.1, so ports tell them apart).
type pools struct {
	t   *testing.T
	dns *zone
	reg *kvroutetest.Registry
	n   int
	// by phase: the engines listed now, and every engine ever started
	listed  map[kvroute.Phase][]*kvroutetest.Engine
	started []*kvroutetest.Engine
}

func srvName(phase kvroute.Phase) string { return "_http._tcp." + string(phase) + ".test" }

// srvQuery is srvName as a fully qualified name, so that no search domain
// of the host's resolv.conf is tried.
func srvQuery(phase kvroute.Phase) string { return srvName(phase) + "." }

func (p *pools) start(phase kvroute.Phase) *kvroutetest.Engine {
	e := kvroutetest.NewEngine(p.t, kvroutetest.WithRegistry(p.reg))
	p.started = append(p.started, e)
	p.listed[phase] = append(p.listed[phase], e)
	p.publish(phase)
	return e
}

func (p *pools) unlist(phase kvroute.Phase, e *kvroutetest.Engine) {
	p.listed[phase] = slices.DeleteFunc(p.listed[phase], func(x *kvroutetest.Engine) bool { return x == e })
	p.publish(phase)
}

// publish writes the SRV records of phase: one target per engine.
func (p *pools) publish(phase kvroute.Phase) {
	var recs []*net.SRV
	for _, e := range p.listed[phase] {
		u, err := url.Parse(e.URL())
		require.NoError(p.t, err)
		port, err := strconv.Atoi(u.Port())
		require.NoError(p.t, err)
		p.n++
		target := fmt.Sprintf("e%d.%s.test", p.n, phase)
		p.dns.set(target, &rrset{addrs: []netip.Addr{netip.MustParseAddr(u.Hostname())}})
		recs = append(recs, &net.SRV{Target: target + ".", Port: uint16(port), Weight: 100})
	}
	p.dns.set(srvName(phase), &rrset{srv: recs})
}

// guard is a Selector that fails the test when a removed endpoint is
// offered after the refresh that removed it: while the router still lists
// it. A turn whose candidates were listed before the refresh may still
// offer it (turns in flight finish on what they picked; the test checks
// that no request reaches it after its drain).
type guard struct {
	next    kvroute.Selector
	listed  func(url string) bool // the router lists url now
	mu      sync.Mutex
	removed map[string]bool
	bad     atomic.Int64
}

func (g *guard) Select(ctx context.Context, s *kvroute.Selection) (int, error) {
	g.mu.Lock()
	for _, c := range s.Candidates {
		if g.removed[c.URL] && g.listed(c.URL) {
			g.bad.Add(1)
		}
	}
	g.mu.Unlock()
	return g.next.Select(ctx, s)
}

func (g *guard) remove(url string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.removed[url] = true
}

// chat is one conversation through the router.
type chat struct {
	id       int
	messages []map[string]string
}

func (c *chat) turn(t *testing.T, client *http.Client, base string, i int) (ok bool) {
	c.messages = append(c.messages, map[string]string{"role": "user",
		"content": fmt.Sprintf("Turn %d of task %d: the test log shows %d failures in package p%d; read it and continue the plan.", i, c.id, i%4, i)})
	body, err := json.Marshal(map[string]any{"model": kvroutetest.DefaultModel, "max_tokens": 12, "messages": c.messages})
	require.NoError(t, err)
	want, err := kvroutetest.Reference(kvroute.PathChatCompletions, body)
	require.NoError(t, err)
	resp, err := client.Post(base+kvroute.PathChatCompletions, "application/json", bytes.NewReader(body))
	if !assert.NoError(t, err) {
		return false
	}
	raw, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	require.NoError(t, err)
	if !assert.Equal(t, http.StatusOK, resp.StatusCode, "%s", raw) {
		return false
	}
	var out struct {
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
	}
	require.NoError(t, json.Unmarshal(raw, &out))
	require.Len(t, out.Choices, 1)
	got := out.Choices[0].Message.Content
	c.messages = append(c.messages, map[string]string{"role": "assistant", "content": got})
	return assert.Equal(t, want.Text, got, "turn %d differs from the single-engine reference", i)
}

// TestScaleThroughDNS resolves the P and D pools through a DNS server on
// 127.0.0.1 (SRV records, asked by the standard library's resolver),
// scales both up and down while conversations run, and checks that every
// turn gets the single-engine reference answer, that no endpoint is offered
// to selection after the refresh that removed it, that a removed engine
// receives no request after its in-flight turns ended, and that a retained
// handle of a removed decode engine is never attached (no prefill engine
// fails to pull it).
func TestScaleThroughDNS(t *testing.T) {
	p := &pools{t: t, dns: &zone{names: map[string]*rrset{}}, reg: kvroutetest.NewRegistry(), listed: map[kvroute.Phase][]*kvroutetest.Engine{}}
	res := serveDNS(t, p.dns)
	p.start(kvroute.PhasePrefill)
	p.start(kvroute.PhasePrefill)
	d0 := p.start(kvroute.PhaseDecode)
	p.start(kvroute.PhaseDecode)

	ctx := context.Background()
	src := map[kvroute.Phase]*discovery.DNS{}
	initial := map[kvroute.Phase][]transport.Endpoint{}
	for _, ph := range []kvroute.Phase{kvroute.PhasePrefill, kvroute.PhaseDecode} {
		d, err := discovery.NewDNS(srvQuery(ph), discovery.WithResolver(res))
		require.NoError(t, err)
		src[ph] = d
		initial[ph], err = d.Resolve(ctx)
		require.NoError(t, err)
		require.Len(t, initial[ph], 2)
	}
	g := &guard{next: &kvroute.LeastLoaded{MaxInFlight: 64}, removed: map[string]bool{}}
	obs := &kvroutetest.Records{}
	r, err := kvroute.New(kvroute.WithEndpoints(kvroute.PhasePrefill, initial[kvroute.PhasePrefill]...),
		kvroute.WithEndpoints(kvroute.PhaseDecode, initial[kvroute.PhaseDecode]...), kvroute.WithSelector(g), kvroute.WithObserver(obs))
	require.NoError(t, err)
	defer r.Close()
	g.listed = func(url string) bool {
		for _, ph := range []kvroute.Phase{kvroute.PhasePrefill, kvroute.PhaseDecode} {
			for _, e := range r.Endpoints(ph) {
				if e.URL == url {
					return true
				}
			}
		}
		return false
	}
	watch := map[kvroute.Phase]*discovery.Watcher{}
	for ph, s := range src {
		watch[ph], err = discovery.NewWatcher(s, func(eps []transport.Endpoint) error { return r.SetEndpoints(ph, eps...) })
		require.NoError(t, err)
	}
	refresh := func() {
		for _, w := range watch {
			assert.NoError(t, w.Refresh(ctx))
		}
	}
	srv := httptest.NewServer(r)
	defer srv.Close()
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}

	const convs = 6
	chats := make([]*chat, convs)
	for i := range chats {
		chats[i] = &chat{id: i, messages: []map[string]string{{"role": "system", "content": "You are a coding agent in a large Go repository. " +
			"List files before you read them, run the tests before you edit, keep every change small and explain each step in one sentence. " +
			"When the tests pass, summarise what you changed and why, naming the files."}}}
	}
	turns, okTurns := 0, 0
	// batch runs one turn of every conversation at once; during runs
	// concurrently with them (a refresh mid-batch).
	batch := func(i int, during func()) {
		var wg sync.WaitGroup
		var ok atomic.Int64
		for _, c := range chats {
			wg.Go(func() {
				if c.turn(t, client, srv.URL, i) {
					ok.Add(1)
				}
			})
		}
		if during != nil {
			during()
		}
		wg.Wait()
		turns += convs
		okTurns += int(ok.Load())
	}
	// gone is a removed engine, its request count once its last in-flight
	// turn ended.
	type gone struct {
		e     *kvroutetest.Engine
		count int
	}
	var removed []gone
	scaleDown := func(ph kvroute.Phase, e *kvroutetest.Engine) func() {
		p.unlist(ph, e)
		return func() {
			refresh()
			g.remove(e.URL())
		}
	}

	batch(0, nil)
	batch(1, nil)
	// Scale up both pools mid-batch.
	p.start(kvroute.PhasePrefill)
	p.start(kvroute.PhaseDecode)
	batch(2, refresh)
	// Scale down: the first P and the D that holds some conversations' KV.
	p0 := p.listed[kvroute.PhasePrefill][0]
	batch(3, func() { scaleDown(kvroute.PhasePrefill, p0)(); scaleDown(kvroute.PhaseDecode, d0)() })
	// Their in-flight turns ended with the batch: stop them, as the
	// engines of a scaled-down Deployment stop after their drain.
	for _, e := range []*kvroutetest.Engine{p0, d0} {
		removed = append(removed, gone{e, len(e.Requests())})
		e.Close()
	}
	batch(4, nil)
	batch(5, nil)
	// Replace the whole decode pool but one new engine, and grow P again.
	p.start(kvroute.PhasePrefill)
	d3 := p.start(kvroute.PhaseDecode)
	olds := slices.DeleteFunc(slices.Clone(p.listed[kvroute.PhaseDecode]), func(e *kvroutetest.Engine) bool { return e == d3 })
	batch(6, func() {
		for _, e := range olds {
			p.unlist(kvroute.PhaseDecode, e)
		}
		refresh()
		for _, e := range olds {
			g.remove(e.URL())
		}
	})
	for _, e := range olds {
		removed = append(removed, gone{e, len(e.Requests())})
		e.Close()
	}
	batch(7, nil)
	batch(8, nil)

	assert.Equal(t, turns, okTurns, "every turn completed with the reference answer")
	assert.Zero(t, g.bad.Load(), "an endpoint was offered to selection after the refresh that removed it")
	for _, rm := range removed {
		assert.Equal(t, rm.count, len(rm.e.Requests()), "%s got requests after its removal and drain", rm.e.URL())
	}
	assert.Len(t, r.Endpoints(kvroute.PhaseDecode), 1)
	assert.Len(t, r.Endpoints(kvroute.PhasePrefill), 3)
	st := r.Stats()
	assert.Zero(t, st.Failures)
	assert.Zero(t, st.HitRetries, "no prefill leg failed on a handle of a removed engine")
	assert.Positive(t, st.GoneHandles, "conversations whose KV was on a removed D continued as counted misses")
	for _, e := range p.started {
		assert.Zero(t, e.Stats().LoadFailures, "%s failed a KV read", e.URL())
		assert.Zero(t, e.Stats().WrongOutputs)
	}
	hits, miss := 0, map[kvroute.MissReason]int{}
	for _, rec := range obs.All() {
		if rec.Reuse == kvroute.ReuseHit {
			hits++
		} else {
			miss[rec.MissReason]++
		}
	}
	assert.Positive(t, hits, "reuse kept working across the changes")
	assert.Equal(t, int(st.GoneHandles), miss[kvroute.MissEndpointGone])
	t.Logf("turns %d, hits %d, misses %v, gone handles %d", turns, hits, miss, st.GoneHandles)
}

// TestInFlightTurnFinishes checks that a stream open on a decode engine
// when DNS drops it completes with the reference answer, while the next
// turn goes to the engine that stays.
func TestInFlightTurnFinishes(t *testing.T) {
	p := &pools{t: t, dns: &zone{names: map[string]*rrset{}}, reg: kvroutetest.NewRegistry(), listed: map[kvroute.Phase][]*kvroutetest.Engine{}}
	res := serveDNS(t, p.dns)
	p.start(kvroute.PhasePrefill)
	p.start(kvroute.PhaseDecode)
	p.start(kvroute.PhaseDecode)
	ctx := context.Background()
	initial := map[kvroute.Phase][]transport.Endpoint{}
	watch := map[kvroute.Phase]*discovery.Watcher{}
	var r *kvroute.Router
	for _, ph := range []kvroute.Phase{kvroute.PhasePrefill, kvroute.PhaseDecode} {
		d, err := discovery.NewDNS(srvQuery(ph), discovery.WithResolver(res))
		require.NoError(t, err)
		initial[ph], err = d.Resolve(ctx)
		require.NoError(t, err)
		watch[ph], err = discovery.NewWatcher(d, func(eps []transport.Endpoint) error { return r.SetEndpoints(ph, eps...) })
		require.NoError(t, err)
	}
	r, err := kvroute.New(kvroute.WithEndpoints(kvroute.PhasePrefill, initial[kvroute.PhasePrefill]...), kvroute.WithEndpoints(kvroute.PhaseDecode, initial[kvroute.PhaseDecode]...))
	require.NoError(t, err)
	defer r.Close()

	body := []byte(`{"model":"` + kvroutetest.DefaultModel + `","max_tokens":24,"stream":true,"messages":[{"role":"user","content":"Explain the build in three steps."}]}`)
	want, err := kvroutetest.Reference(kvroute.PathChatCompletions, body)
	require.NoError(t, err)
	resp, err := r.Do(ctx, &kvroute.Request{Path: kvroute.PathChatCompletions, Body: body})
	require.NoError(t, err)
	// Do has read the stream's first event: the decode leg is open.
	var busy *kvroutetest.Engine
	for _, st := range r.Endpoints(kvroute.PhaseDecode) {
		if st.InFlight > 0 {
			for _, e := range p.listed[kvroute.PhaseDecode] {
				if e.URL() == st.URL {
					busy = e
				}
			}
		}
	}
	require.NotNil(t, busy, "a decode endpoint has the stream in flight")
	p.unlist(kvroute.PhaseDecode, busy)
	require.NoError(t, watch[kvroute.PhaseDecode].Refresh(ctx))
	for _, st := range r.Endpoints(kvroute.PhaseDecode) {
		assert.NotEqual(t, busy.URL(), st.URL, "removed after the refresh")
	}

	var buf bytes.Buffer
	_, err = resp.WriteTo(&buf)
	require.NoError(t, err)
	require.NoError(t, resp.Close())
	raw := buf.Bytes()
	var text strings.Builder
	for _, line := range strings.Split(string(raw), "\n") {
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var ev struct {
			Choices []struct {
				Delta struct{ Content string } `json:"delta"`
			} `json:"choices"`
		}
		require.NoError(t, json.Unmarshal([]byte(data), &ev), data)
		for _, c := range ev.Choices {
			text.WriteString(c.Delta.Content)
		}
	}
	assert.Equal(t, want.Text, text.String(), "the in-flight turn finished on the removed engine")
	assert.Contains(t, string(raw), "data: [DONE]")

	n := len(busy.Requests())
	busy.Close()
	resp, err = r.Do(ctx, &kvroute.Request{Path: kvroute.PathChatCompletions, Body: body})
	require.NoError(t, err)
	_, err = resp.WriteTo(io.Discard)
	require.NoError(t, err)
	require.NoError(t, resp.Close())
	assert.Equal(t, n, len(busy.Requests()), "no new turn reached the removed engine")
	assert.Zero(t, r.Stats().Failures)
}

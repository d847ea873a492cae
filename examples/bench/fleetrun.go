package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/retention"
	"github.com/bidikv/bidikv/retention/budget"
	"github.com/bidikv/bidikv/transport"
)

// fleetEpoch is where every arm's event clock starts.
var fleetEpoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// armSpec is one arm of a fleet run: the router's decode memory options,
// the decode engines' capacity and the router replicas.
type armSpec struct {
	name    string
	managed bool
	// The CPU tier head-to-head (--cpu-tier, fleettier.go): tier gives
	// every engine a CPU tier (twice its KV capacity, generated blocks
	// written through, the peer tier on); peer has the router pull from
	// the decode engines' tiers (kvroute.DecodeMemory.CPUTierTokens);
	// plain turns reuse off (plain P/D); holdFraction, when above 0, is
	// the managed arm's budget as a share of the capacity.
	tier, peer, plain bool
	holdFraction      float64
	local             bool          // decode-local turns (kvroute.DecodeMemory.Local): the cost model's other ways
	tierFirst         bool          // a hold the tier holds whole is pulled from there (kvroute.DecodeMemory.CPUTierFirst)
	capacity          int           // tokens per decode engine
	replicas          int           // kvroute routers sharing one Store
	done              *atomic.Int64 // sessions ended, for progress lines (nil: not counted)
}

// fleetTurn is what one turn measured.
type fleetTurn struct {
	session, turn int
	prompt        int           // prompt tokens
	ttft          time.Duration // modelled: render + prefill leg + D's first token
	reused        int           // tokens P pulled from D's hold
	computed      int           // prompt tokens P computed (D, for a turn it answered alone)
	cached        int           // prompt tokens P found in its prefix cache
	tier, peer    int           // prompt tokens P loaded from a CPU tier, and of them from D's (--cpu-tier)
	dTier         int           // prompt tokens a decode-local turn's D reloaded from its own CPU tier
	hit           bool
	peerAsked     bool          // the router had P pull from D's CPU tier (--cpu-tier)
	local         bool          // a decode-local turn
	tool          bool          // the reply called the tool
	pause         time.Duration // the pause after the answer (0 after the last turn)
	last          bool          // the session's last turn
	replica       int           // the router replica that served it
	prefill       int           // the prefill engine that served it (index; -1 none)
	// the decode leg: its engine (index into the rig's decode engines, -1
	// when none), its modelled decode time (to its last token) and its
	// prompt and completion tokens (the hold it leaves on D)
	decode               int
	decodeTime           time.Duration
	dPrompt, dCompletion int
	dReq                 string        // the decode engine's request id (its handle's remote_request_id)
	sent                 time.Duration // from the run's start, when the client sent it
	// dWaited: the decode leg waited for blocks on D, in modelled time (a
	// leg D queues at the very moment a release frees the blocks waits
	// none; counting it would depend on which the goroutines ran first)
	dWaited bool
	// the TTFT's parts (--diagnose): the router's render, its prefill leg
	// (P's queue, load and prefill), P's queue in it, D's first token and
	// the prompt tokens D read from P
	render, pLeg, pQueued, dFirst time.Duration
	dPulled, est                  int
	wrong                         bool
	err                           string
	answered                      time.Duration // from the run's start
}

// kvSample is the decode engines' KV at one moment.
type kvSample struct {
	at      time.Duration
	held    []int // tokens pinned for holds, per decode engine
	used    []int // tokens allocated (holds and running requests), per engine
	waiting []int
}

// engineCounters are an engine's counters at the end of a run.
type engineCounters struct {
	url                                     string
	queued, preemptions, recomputed, notify int
	ttlBlocks, holds, wrong                 int
}

// armResult is everything one arm measured.
type armResult struct {
	spec      armSpec
	turns     []fleetTurn
	samples   []kvSample
	prefill   []engineCounters
	decode    []engineCounters
	router    []kvroute.Stats   // a replica's each
	elapsed   time.Duration     // first arrival to the last answer, virtual
	unsettled int               // turns whose releases did not settle (settle)
	gaps      []budget.Snapshot // a managed replica's ledger's each
	releases  []diagRelease     // --diagnose: the routers' release requests
	real      time.Duration
}

// fleetRig is one arm's engines, router and clock.
type fleetRig struct {
	clk   *kvroutetest.EventClock
	p, d  []*kvroutetest.Engine
	byURL map[string]*kvroutetest.Engine
	dIdx  map[string]int // decode engine URL → index in d
	pIdx  map[string]int // prefill engine URL → index in p
	// routers are the replicas, sharing one Store (store)
	routers []*kvroute.Router
	store   kvroute.Store
	obs     *kvroutetest.Records
	// ledgers are the managed arm's: one for every replica, or one a
	// replica with --ledger per-replica (none for hold everything); takes
	// counts the releases' Takes (settle)
	ledgers   []*budget.Budget
	takes     atomic.Int64
	joined    atomic.Int64 // releases that joined the clock at their Take, not yet sent
	unsettled atomic.Int64 // turns whose releases did not settle in time
	spread    bool         // a session's turns go to replicas in turn; else pinned
	diagnose  bool         // record the release requests (--diagnose)
	relMu     sync.Mutex
	releases  []diagRelease
	closers   []func()
}

func (r *fleetRig) close() {
	for i := len(r.closers) - 1; i >= 0; i-- {
		r.closers[i]()
	}
}

func startRig(c fleetConfig, a armSpec) (*fleetRig, error) {
	r := &fleetRig{clk: kvroutetest.NewEventClock(fleetEpoch), byURL: map[string]*kvroutetest.Engine{},
		dIdx: map[string]int{}, pIdx: map[string]int{}, spread: c.spread, diagnose: c.diagnose}
	ok := false
	defer func() {
		if !ok {
			r.close()
		}
	}()
	if err := r.startEngines(c, a); err != nil {
		return nil, err
	}
	var pu, du []string
	for _, e := range r.p {
		pu = append(pu, e.URL())
	}
	for _, e := range r.d {
		du = append(du, e.URL())
	}
	r.obs = &kvroutetest.Records{}
	rt, err := transport.NewTransport()
	if err != nil {
		return nil, err
	}
	r.closers = append(r.closers, rt.CloseIdleConnections)
	// One Store for every replica: a handle one retains, another finds;
	// one ledger for every managed replica unless --ledger per-replica.
	store, err := retention.NewMemory()
	if err != nil {
		return nil, err
	}
	r.closers = append(r.closers, func() { _ = store.Close() })
	r.store = clockStore{Store: store, clk: r.clk, takes: &r.takes, joined: &r.joined}
	var mem kvroute.DecodeMemory
	for k := range max(a.replicas, 1) {
		if k == 0 || c.perReplica {
			m, ledger, err := decodeMemory(c, a)
			if err != nil {
				return nil, err
			}
			if ledger != nil {
				r.ledgers = append(r.ledgers, ledger)
			}
			mem = m
		}
		if a.peer {
			mem.CPUTierTokens, mem.CPUTierPeers, mem.CPUTierFirst = c.tierTokens(a.capacity), map[string]string{}, a.tierFirst
			for _, e := range r.d {
				host, port, _ := e.RankP2PChannel(0)
				mem.CPUTierPeers[e.URL()] = net.JoinHostPort(host, strconv.Itoa(port))
			}
		}
		router, err := kvroute.New(kvroute.WithPrefill(pu...), kvroute.WithDecode(du...),
			kvroute.WithClock(r.clk.Now), kvroute.WithObserver(r.obs), kvroute.WithTransport(clockTransport{base: rt, clk: r.clk, rig: r}),
			kvroute.WithStore(r.store), kvroute.WithDecodeMemory(mem), kvroute.WithReuse(!a.plain))
		if err != nil {
			return nil, err
		}
		r.routers = append(r.routers, router)
		r.closers = append(r.closers, func() { _ = router.Close() })
	}
	ok = true
	return r, nil
}

// startEngines starts the prefill and decode engines: vLLM's defaults
// (prefix caching on), P with the node's capacity and a read it declines
// near the handle's expiry (its request waited) recomputed rather than
// failed, D with the arm's capacity.
func (r *fleetRig) startEngines(c fleetConfig, a armSpec) error {
	reg := kvroutetest.NewRegistry()
	common := []kvroutetest.Option{kvroutetest.WithRegistry(reg), kvroutetest.WithClock(r.clk),
		kvroutetest.WithProfile(c.prof), kvroutetest.WithToolCallRate(c.toolShare),
		kvroutetest.WithBidirectional(!a.plain)} // plain P/D: stock engines, D keeps nothing
	pBlocks := c.prof.NumGPUBlocks(kvroutetest.DefaultBlockSize)
	for range c.prefill {
		e, err := kvroutetest.StartEngine(append(common, kvroutetest.WithPrefixCaching(!c.noPrefixCache),
			kvroutetest.WithNumBlocks(pBlocks), tierOption(c, a, pBlocks*kvroutetest.DefaultBlockSize),
			kvroutetest.WithKVLoadFailurePolicy("recompute"))...)
		if err != nil {
			return err
		}
		r.closers = append(r.closers, e.Close)
		r.pIdx[e.URL()] = len(r.p)
		r.p = append(r.p, e)
		r.byURL[e.URL()] = e
	}
	for range c.decode {
		e, err := kvroutetest.StartEngine(append(common,
			kvroutetest.WithNumBlocks(a.capacity/kvroutetest.DefaultBlockSize), tierOption(c, a, a.capacity))...)
		if err != nil {
			return err
		}
		r.closers = append(r.closers, e.Close)
		r.dIdx[e.URL()] = len(r.d)
		r.d = append(r.d, e)
		r.byURL[e.URL()] = e
	}
	return nil
}

// router is the replica that serves turn t of session id: pinned, the
// session's; spread, the next one at each turn.
func (r *fleetRig) router(id, t int) (int, *kvroute.Router) {
	k := id
	if r.spread {
		k += t
	}
	k %= len(r.routers)
	return k, r.routers[k]
}

// runArm runs every session of plan through one arm.
func runArm(ctx context.Context, c fleetConfig, plan []sessionPlan, a armSpec) (armResult, error) {
	start := time.Now()
	rig, err := startRig(c, a)
	if err != nil {
		return armResult{}, err
	}
	defer rig.close()
	res := armResult{spec: a}
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()

	var mu sync.Mutex
	var failed error
	var left atomic.Int64
	var wg sync.WaitGroup
	left.Store(int64(len(plan)))
	for _, sp := range plan {
		rig.clk.Join()
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer rig.clk.Leave()
			defer left.Add(-1)
			if a.done != nil {
				defer a.done.Add(1)
			}
			turns, err := runSession(ctx, c, rig, sp)
			mu.Lock()
			defer mu.Unlock()
			res.turns = append(res.turns, turns...)
			if err != nil && failed == nil {
				failed = err
			}
		}()
	}
	// the sampler: a participant that reads every decode engine's KV
	rig.clk.Join()
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer rig.clk.Leave()
		for left.Load() > 0 {
			res.samples = append(res.samples, sample(rig))
			if rig.clk.Sleep(ctx, c.sample) != nil {
				return
			}
		}
	}()
	err = rig.clk.Run(ctx)
	if err != nil {
		// the sessions end as their requests and sleeps see ctx done
		cancel()
	}
	wg.Wait()
	if err != nil {
		return armResult{}, fmt.Errorf("%s: %w", a.name, err)
	}
	if failed != nil {
		return armResult{}, fmt.Errorf("%s: %w", a.name, failed)
	}
	res.samples = append(res.samples, sample(rig))
	res.elapsed = rig.clk.Now().Sub(fleetEpoch)
	res.prefill, res.decode = counters(rig.p), counters(rig.d)
	// Close waits for the routers' background work: a release whose
	// request has answered counts its outcome after it left the clock.
	for _, rt := range rig.routers {
		_ = rt.Close()
		res.router = append(res.router, rt.Stats())
	}
	res.unsettled = int(rig.unsettled.Load())
	for _, l := range rig.ledgers {
		res.gaps = append(res.gaps, l.Snapshot(rig.clk.Now(), kvroutetest.DefaultDecoderBlocksTTL))
	}
	res.releases = rig.releases
	res.real = time.Since(start)
	sortTurns(res.turns)
	return res, nil
}

func sample(rig *fleetRig) kvSample {
	s := kvSample{at: rig.clk.Now().Sub(fleetEpoch)}
	for _, e := range rig.d {
		st := e.Stats()
		s.held = append(s.held, st.BlocksPinned*kvroutetest.DefaultBlockSize)
		s.used = append(s.used, st.UsedBlocks*kvroutetest.DefaultBlockSize)
		s.waiting = append(s.waiting, st.Waiting)
	}
	return s
}

func counters(es []*kvroutetest.Engine) []engineCounters {
	var out []engineCounters
	for _, e := range es {
		st := e.Stats()
		out = append(out, engineCounters{url: e.URL(), queued: st.Queued, preemptions: st.Preemptions,
			recomputed: st.TokensRecomputed, notify: st.NotifiedHolds, ttlBlocks: st.TTLBlocks, holds: st.Holds,
			wrong: st.WrongOutputs})
	}
	return out
}

// runSession runs one session's turns, each through the router, checking
// every answer against a single engine's.
func runSession(ctx context.Context, c fleetConfig, rig *fleetRig, sp sessionPlan) ([]fleetTurn, error) {
	if err := rig.clk.Sleep(ctx, sp.arrival); err != nil {
		return nil, err
	}
	s := newSession(c.seed, sp)
	var out []fleetTurn
	for t, tp := range sp.turns {
		ft, reply, err := sendFleetTurn(ctx, c, rig, s, t)
		if err != nil {
			out = append(out, ft)
			return out, fmt.Errorf("session %d turn %d: %w", sp.id, t, err)
		}
		s.hear(reply)
		ft.tool, ft.last = s.called, sp.ends(t, s.called)
		if !ft.last {
			ft.pause = tp.pause(s.called)
		}
		out = append(out, ft)
		if !rig.settle() {
			rig.unsettled.Add(1)
		}
		if ft.last {
			break
		}
		if err := rig.clk.Sleep(ctx, ft.pause); err != nil {
			return out, err
		}
	}
	return out, nil
}

// sendFleetTurn sends turn t of s and measures it from the router's
// record and the engines' records; it returns the reply message, as the
// client sends it back.
func sendFleetTurn(ctx context.Context, c fleetConfig, rig *fleetRig, s *session, t int) (fleetTurn, chatMessage, error) {
	ft := fleetTurn{session: s.plan.id, turn: t, decode: -1, prefill: -1}
	body, err := s.body(t)
	if err != nil {
		return ft, chatMessage{}, err
	}
	ref, err := kvroutetest.Reference(kvroutetest.PathChat, body, kvroutetest.WithToolCallRate(c.toolShare))
	if err != nil {
		return ft, chatMessage{}, err
	}
	id := fmt.Sprintf("s%04d-t%02d", s.plan.id, t)
	req := httptest.NewRequestWithContext(markSession(ctx), http.MethodPost, kvroute.PathChatCompletions, bytesReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", id)
	w := httptest.NewRecorder()
	var router *kvroute.Router
	ft.replica, router = rig.router(s.plan.id, t)
	ft.sent = rig.clk.Now().Sub(fleetEpoch)
	router.ServeHTTP(w, req)
	ft.answered = rig.clk.Now().Sub(fleetEpoch)
	ft.prompt = ref.PromptTokens
	if w.Code != http.StatusOK {
		ft.err = fmt.Sprintf("status %d: %.200s", w.Code, w.Body.String())
		return ft, chatMessage{}, errors.New(ft.err)
	}
	var ans struct {
		Choices []struct {
			Message      chatMessage `json:"message"`
			FinishReason string      `json:"finish_reason"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(w.Body.Bytes(), &ans); err != nil || len(ans.Choices) != 1 {
		return ft, chatMessage{}, fmt.Errorf("bad answer: %v", err)
	}
	got := ans.Choices[0]
	ft.wrong = got.Message.Content != ref.Text || got.FinishReason != ref.FinishReason || len(got.Message.ToolCalls) != len(ref.ToolCalls)
	for i, call := range got.Message.ToolCalls {
		if i < len(ref.ToolCalls) && (call.Function.Name != ref.ToolCalls[i].Name || call.Function.Arguments != ref.ToolCalls[i].Arguments) {
			ft.wrong = true
		}
	}
	rec, ok := rig.obs.Take(id)
	if !ok {
		return ft, chatMessage{}, errors.New("no turn record")
	}
	ft.hit = rec.Reuse == kvroute.ReuseHit
	ft.peerAsked = rec.PeerSource != ""
	ft.local = rec.Reuse == kvroute.ReuseLocal
	ft.ttft = rec.Render + rec.Prefill
	ft.render, ft.pLeg, ft.est = rec.Render, rec.Prefill, rec.PeerTokens
	if d := rig.byURL[rec.DecodeEndpoint]; d != nil {
		for _, r := range d.FinishedRequests(rec.EngineRequestID) {
			if r.Role == "plain" {
				// decode-local (or D prefilling by itself): D computed
				// the prompt, after its prefix cache and its own tier
				ft.computed += r.ComputedTokens
				ft.cached += r.CachedTokens
				ft.dTier += r.TierTokens
			}
			if r.Role == "decode" || r.Role == "plain" {
				ft.ttft += r.FirstToken
				ft.dFirst, ft.dPulled = r.FirstToken, r.PulledTokens
				ft.dWaited = ft.dWaited || r.Queued > 0
				ft.decode, ft.decodeTime = rig.dIdx[rec.DecodeEndpoint], r.Decode
				ft.dPrompt, ft.dCompletion = r.PromptTokens, r.CompletionTokens
				ft.dReq = r.EngineRequestID
			}
		}
	}
	if p := rig.byURL[rec.PrefillEndpoint]; p != nil {
		ft.prefill = rig.pIdx[rec.PrefillEndpoint]
		for _, r := range p.FinishedRequests(rec.EngineRequestID) {
			if r.Role == "prefill" {
				ft.reused += r.PulledTokens
				ft.computed += r.ComputedTokens
				ft.cached += r.CachedTokens
				ft.tier += r.TierTokens
				ft.peer += r.PeerTokens
				ft.pQueued += r.Queued
			}
		}
	}
	return ft, got.Message, nil
}

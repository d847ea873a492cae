package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/bidikv/bidikv/internal/upstreamclock"
	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/threshold"
	"github.com/bidikv/bidikv/transport"
)

// turn is one measured turn.
type turn struct {
	reuse        bool // the mode: reuse on or off
	conv, index  int
	engineID     string // the X-Request-Id the engines saw (kvroute.TurnRecord.EngineRequestID)
	outcome      string // X-Bidikv-Reuse
	promptTokens int
	computed     int           // prompt tokens P computed
	recompute    time.Duration // modelled: P's prefill
	transfer     time.Duration // modelled: P's pull from D
	decodeFirst  time.Duration // modelled: D's pull from P and first token
	render       time.Duration // modelled: the render call on the API server (token verification)
	overhead     time.Duration // measured: what the router added, real time
	renderSide   time.Duration // measured: the router's side of the render call (part of overhead)
	heldTokens   int           // tokens of KV D keeps for the next turn
	handleTokens int           // tokens the handle found holds (0: none found)
	verified     int           // tokens the render proved D's blocks share with the prompt
	partial      bool          // only the verified prefix of the handle was attached
	missReason   kvroute.MissReason
	path         threshold.Path
	estimate     time.Duration // the cost model's estimate of the engine TTFT of path
	refusal      string        // why a turn estimated cheapest decode-local was not
}

// ttft is the modelled time to first token plus the router's real overhead.
func (t turn) ttft() time.Duration { return t.engines() + t.render + t.overhead }

// engines is the modelled engine time of the turn: P's part and D's part.
func (t turn) engines() time.Duration { return t.prefillOn() + t.decodeFirst }

// prefillOn is P's part: its pull of D's blocks and its prefill.
func (t turn) prefillOn() time.Duration { return t.recompute + t.transfer }

// modeResult is one run of every conversation in one mode.
type modeResult struct {
	reuse        bool
	turns        []turn
	peakHeldToks int // the most KV tokens D held for a next turn at once
	wrong        int // decode outputs that differ from a single engine's
}

// bench is a fresh 1P1D pair and a router over it.
type bench struct {
	p, d           *kvroutetest.Engine
	router         *kvroute.Router
	clock, renders *upstreamclock.Clock
	obs            *kvroutetest.Records
	model          *threshold.CostModel // the router's cost model, decode-local runs only
	closers        []func()
}

func (b *bench) close() {
	for i := len(b.closers) - 1; i >= 0; i-- {
		b.closers[i]()
	}
}

// nowOnly is a virtual clock without its Sleep: engines on it read the
// virtual time but do not advance it by their modelled durations.
type nowOnly struct{ vc *kvroutetest.VirtualClock }

// Now implements kvroutetest.Clock.
func (n nowOnly) Now() time.Time { return n.vc.Now() }

// startBench starts the engines and the router of one run. With vc, the
// engines and the router tell time by it (TTLs and handle ages follow the
// virtual clock), which only the caller moves.
func startBench(c config, reuse bool, vc *kvroutetest.VirtualClock) (*bench, error) {
	b := &bench{}
	ok := false
	defer func() {
		if !ok {
			b.close()
		}
	}()
	reg := kvroutetest.NewRegistry()
	blocks := 4 * c.conversations * (c.endTokens + c.turns*c.replyTokens) / kvroutetest.DefaultBlockSize
	common := []kvroutetest.Option{
		kvroutetest.WithRegistry(reg),
		kvroutetest.WithProfile(c.profile),
		kvroutetest.WithNumBlocks(blocks),
		kvroutetest.WithReasoning(c.reasoning),
		// Reuse off is stock one-way disaggregation: D frees its blocks
		// when it finishes instead of keeping them for a next turn.
		kvroutetest.WithBidirectional(reuse),
	}
	if vc != nil {
		common = append(common, kvroutetest.WithClock(nowOnly{vc}))
	}
	var err error
	if b.p, err = kvroutetest.StartEngine(append(common, kvroutetest.WithPrefixCaching(false))...); err != nil {
		return nil, err
	}
	b.closers = append(b.closers, b.p.Close)
	if b.d, err = kvroutetest.StartEngine(append(common, kvroutetest.WithStreamHandles(true))...); err != nil {
		return nil, err
	}
	b.closers = append(b.closers, b.d.Close)

	rt, err := transport.NewTransport()
	if err != nil {
		return nil, err
	}
	b.closers = append(b.closers, rt.CloseIdleConnections)
	b.clock = upstreamclock.New(rt)
	b.renders = upstreamclock.New(b.clock) // render calls only, also counted by clock
	b.obs = &kvroutetest.Records{}
	opts := []kvroute.Option{
		kvroute.WithPrefill(b.p.URL()),
		kvroute.WithDecode(b.d.URL()),
		kvroute.WithReuse(reuse),
		kvroute.WithTransport(renderSplit{render: b.renders, other: b.clock}),
		kvroute.WithObserver(b.obs),
	}
	if vc != nil {
		opts = append(opts, kvroute.WithClock(vc.Now))
	}
	if c.kvBytes > 0 {
		opts = append(opts, kvroute.WithDecodeMemory(kvroute.DecodeMemory{KVBytesPerToken: int64(c.kvBytes)}))
	}
	if c.verification != "" {
		opts = append(opts, kvroute.WithVerification(kvroute.Verification{Mode: c.verification}))
	}
	if reuse && c.localMode() {
		// The router's clock is real (or virtual) time, in which the
		// engines answer at once: it must not learn from it. The demo
		// feeds the model the modelled times of each turn instead (learn).
		if b.model, err = threshold.NewCostModel(threshold.CostConfig{}); err != nil {
			return nil, err
		}
		opts = append(opts, kvroute.WithDecodeMemory(kvroute.DecodeMemory{Local: true}), kvroute.WithThresholdPolicy(chooser{b.model}))
	}
	if b.router, err = kvroute.New(opts...); err != nil {
		return nil, err
	}
	b.closers = append(b.closers, func() { _ = b.router.Close() })
	ok = true
	return b, nil
}

// runMode starts a fresh 1P1D pair and a router and runs every conversation.
func runMode(ctx context.Context, c config, reuse bool, tick func()) (modeResult, error) {
	b, err := startBench(c, reuse, nil)
	if err != nil {
		return modeResult{}, err
	}
	defer b.close()
	router, clock, renders, obs, model, p, d := b.router, b.clock, b.renders, b.obs, b.model, b.p, b.d

	res := modeResult{reuse: reuse}
	var mu sync.Mutex
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(c.concurrency)
	for i := range c.conversations {
		g.Go(func() error {
			cv := newConversation(i, c)
			for t := range c.turns {
				tr, err := runTurn(gctx, router, clock, renders, obs, cv, t, reuse)
				if err != nil {
					return fmt.Errorf("conversation %d turn %d (reuse %t): %w", i, t, reuse, err)
				}
				if model != nil {
					learn(model, tr, p, d, c.profile)
				}
				held := d.Stats().BlocksPinned * kvroutetest.DefaultBlockSize
				mu.Lock()
				res.turns = append(res.turns, tr)
				res.peakHeldToks = max(res.peakHeldToks, held)
				mu.Unlock()
				tick()
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return modeResult{}, err
	}
	return res, join(&res, p, d, c.profile)
}

// renderSplit sends the router's render and tokenize calls through render
// and everything else through other, so that the render calls' engine time
// can be told apart.
type renderSplit struct{ render, other http.RoundTripper }

// RoundTrip implements http.RoundTripper.
func (s renderSplit) RoundTrip(req *http.Request) (*http.Response, error) {
	if strings.HasSuffix(req.URL.Path, "/render") || strings.HasSuffix(req.URL.Path, "/tokenize") {
		return s.render.RoundTrip(req)
	}
	return s.other.RoundTrip(req)
}

// renderID is the X-Request-Id of the router's render call for the turn
// id: the router gives it its own (kvroute/render.go), as engines key
// requests by that header.
func renderID(id string) string { return id + "-render" }

func turnID(reuse bool, conv, index int) string {
	mode := "off"
	if reuse {
		mode = "on"
	}
	return fmt.Sprintf("demo-%s-%d-%d", mode, conv, index)
}

// runTurn sends one turn through the router and measures the time to the
// first event in real time.
func runTurn(ctx context.Context, r *kvroute.Router, clock, renders *upstreamclock.Clock, obs *kvroutetest.Records,
	cv *conversation, index int, reuse bool) (turn, error) {
	body, err := cv.next(index)
	if err != nil {
		return turn{}, err
	}
	id := turnID(reuse, cv.id, index)
	h := http.Header{"X-Request-Id": {id}, "Content-Type": {"application/json"}}
	start := time.Now()
	resp, err := r.Do(ctx, &kvroute.Request{Path: kvroute.PathChatCompletions, Header: h, Body: body})
	if err != nil {
		return turn{}, err
	}
	var text bytes.Buffer
	first := time.Duration(0)
	for {
		ev, err := resp.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			resp.Close()
			return turn{}, err
		}
		if first == 0 {
			first = time.Since(start)
		}
		appendContent(&text, ev)
	}
	resp.Close() // the turn ends (and is observed) here
	cv.hear(text.String())
	// The engines saw the router's id for the turn, not the client's:
	// the upstream clocks and the engines' records are keyed by it.
	rec, ok := obs.Take(id)
	eid := id
	if ok && rec.EngineRequestID != "" {
		eid = rec.EngineRequestID
	}
	rid := renderID(eid)
	t := turn{
		reuse:    reuse,
		conv:     cv.id,
		index:    index,
		engineID: eid,
		outcome:  resp.Header.Get("X-Bidikv-Reuse"),
		overhead: max(0, first-clock.Take(eid)-clock.Take(rid)),
	}
	renderWait := renders.Take(rid)
	if ok {
		t.renderSide = max(0, rec.Render-renderWait)
		t.handleTokens, t.verified, t.partial = rec.HandleTokens, rec.VerifiedTokens, rec.Partial
		t.path, t.estimate, t.refusal = rec.Choice, rec.EstimatedTTFT, rec.LocalRefusal
		t.missReason = rec.MissReason
		t.promptTokens = rec.PromptTokens
	}
	return t, nil
}

// appendContent appends choices[0].delta.content of an SSE event.
func appendContent(dst *bytes.Buffer, ev []byte) {
	for line := range bytes.SplitSeq(ev, []byte("\n")) {
		data, ok := bytes.CutPrefix(line, []byte("data: "))
		if !ok || bytes.Equal(data, []byte("[DONE]")) {
			continue
		}
		var chunk struct {
			Choices []struct {
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
		}
		if json.Unmarshal(data, &chunk) == nil && len(chunk.Choices) > 0 {
			dst.WriteString(chunk.Choices[0].Delta.Content)
		}
	}
}

// join fills the modelled figures of every turn from the engines' request
// records, matched by the X-Request-Id the engines saw (turn.engineID).
func join(res *modeResult, p, d *kvroutetest.Engine, prof kvroutetest.Profile) error {
	pre := map[string]kvroutetest.RequestRecord{}
	render := map[string]time.Duration{}
	for _, r := range p.Requests() {
		switch r.Role {
		case "prefill":
			pre[r.RequestID] = r
		case "render", "tokenize":
			render[strings.TrimSuffix(r.RequestID, renderID(""))] += prof.Render(r.PromptTokens)
		}
	}
	dec := map[string]kvroutetest.RequestRecord{}
	for _, r := range d.Requests() {
		if r.Role == "decode" || r.Role == "plain" {
			dec[r.RequestID] = r
			if r.Wrong {
				res.wrong++
			}
		}
	}
	for i := range res.turns {
		t := &res.turns[i]
		id := t.engineID
		pr, ok1 := pre[id]
		dr, ok2 := dec[id]
		if !ok2 || (!ok1 && dr.Role != "plain") {
			return fmt.Errorf("no engine records for turn %s", id)
		}
		t.render = render[id]
		t.heldTokens = 0
		if dr.Role == "plain" {
			// Decode-local: D computes what its prefix cache lacks, then
			// its first decode step; P is not involved. D keeps the
			// handle of the turn before, which is still retained.
			t.promptTokens, t.computed = dr.PromptTokens, dr.ComputedTokens
			t.recompute, t.transfer = 0, 0
			t.decodeFirst = dr.Prefill + prof.Decode(1)
			continue
		}
		t.promptTokens = pr.PromptTokens
		t.computed = pr.ComputedTokens
		t.recompute, t.transfer = pr.Prefill, pr.Transfer
		// D's time to first token: reading P's blocks, then the first
		// decode step (which also computes the last prompt position).
		t.decodeFirst = dr.Transfer + prof.Decode(1)
		if dr.Handle != nil {
			t.heldTokens = dr.PromptTokens + dr.CompletionTokens - 1
		}
	}
	return nil
}

// chooser hides the CostModel's Observe from the router, which would learn
// from its real clock (engines that answer at once); learn feeds the
// modelled times.
type chooser struct{ m *threshold.CostModel }

// Reuse implements threshold.Policy.
func (c chooser) Reuse(in threshold.Input) bool { return c.m.Reuse(in) }

// Choose implements threshold.Chooser.
func (c chooser) Choose(in threshold.Turn) threshold.Choice { return c.m.Choose(in) }

// learn reports a finished turn's modelled engine times to the cost model,
// as the router does with its own clock in a real deployment.
func learn(m *threshold.CostModel, t turn, p, d *kvroutetest.Engine, prof kvroutetest.Profile) {
	if t.path == "" || t.verified <= 0 {
		return
	}
	id := t.engineID
	var pr, dr *kvroutetest.RequestRecord
	for _, r := range p.FinishedRequests(id) {
		if r.Role == "prefill" {
			pr = &r
		}
	}
	for _, r := range d.FinishedRequests(id) {
		if r.Role == "decode" || r.Role == "plain" {
			dr = &r
		}
	}
	if dr == nil {
		return
	}
	o := threshold.Observation{Path: t.path, Decode: d.URL(), PromptTokens: dr.PromptTokens, ReusableTokens: t.verified}
	if dr.Role == "plain" {
		o.DecodeFirst = dr.Prefill + prof.Decode(1)
	} else if pr != nil {
		o.Prefill = pr.Prefill + pr.Transfer
		o.DecodeFirst = dr.Transfer + prof.Decode(1)
	}
	m.Observe(o)
}

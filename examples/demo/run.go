package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/bidikv/bidikv/internal/upstreamclock"
	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/transport"
)

// turn is one measured turn.
type turn struct {
	reuse        bool // the mode: reuse on or off
	conv, index  int
	outcome      string // X-Bidikv-Reuse
	promptTokens int
	computed     int           // prompt tokens P computed
	recompute    time.Duration // modelled: P's prefill
	transfer     time.Duration // modelled: P's pull from D
	decodeFirst  time.Duration // modelled: D's pull from P and first token
	overhead     time.Duration // measured: what the router added, real time
	heldTokens   int           // tokens of KV D keeps for the next turn
}

// ttft is the modelled time to first token plus the router's real overhead.
func (t turn) ttft() time.Duration { return t.recompute + t.transfer + t.decodeFirst + t.overhead }

// modeResult is one run of every conversation in one mode.
type modeResult struct {
	reuse        bool
	turns        []turn
	peakHeldToks int // the most KV tokens D held for a next turn at once
	wrong        int // decode outputs that differ from a single engine's
}

// runMode starts a fresh 1P1D pair and a router and runs every conversation.
func runMode(ctx context.Context, c config, reuse bool, tick func()) (modeResult, error) {
	reg := kvroutetest.NewRegistry()
	blocks := 4 * c.conversations * (c.endTokens + c.turns*c.replyTokens) / kvroutetest.DefaultBlockSize
	common := []kvroutetest.Option{
		kvroutetest.WithRegistry(reg),
		kvroutetest.WithProfile(c.profile),
		kvroutetest.WithNumBlocks(blocks),
		// Reuse off is stock one-way disaggregation: D frees its blocks
		// when it finishes instead of keeping them for a next turn.
		kvroutetest.WithBidirectional(reuse),
	}
	p, err := kvroutetest.StartEngine(append(common, kvroutetest.WithPrefixCaching(false))...)
	if err != nil {
		return modeResult{}, err
	}
	defer p.Close()
	d, err := kvroutetest.StartEngine(append(common, kvroutetest.WithStreamHandles(true))...)
	if err != nil {
		return modeResult{}, err
	}
	defer d.Close()

	rt, err := transport.NewTransport()
	if err != nil {
		return modeResult{}, err
	}
	defer rt.CloseIdleConnections()
	clock := upstreamclock.New(rt)
	router, err := kvroute.New(
		kvroute.WithPrefill(p.URL()),
		kvroute.WithDecode(d.URL()),
		kvroute.WithReuse(reuse),
		kvroute.WithTransport(clock),
	)
	if err != nil {
		return modeResult{}, err
	}
	defer router.Close()

	res := modeResult{reuse: reuse}
	var mu sync.Mutex
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(c.concurrency)
	for i := range c.conversations {
		g.Go(func() error {
			cv := newConversation(i, c)
			for t := range c.turns {
				tr, err := runTurn(gctx, router, clock, cv, t, reuse)
				if err != nil {
					return fmt.Errorf("conversation %d turn %d (reuse %t): %w", i, t, reuse, err)
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

// runTurn sends one turn through the router and measures the time to the
// first event in real time.
func runTurn(ctx context.Context, r *kvroute.Router, clock *upstreamclock.Clock, cv *conversation, index int, reuse bool) (turn, error) {
	body, err := cv.next(index)
	if err != nil {
		return turn{}, err
	}
	mode := "off"
	if reuse {
		mode = "on"
	}
	id := fmt.Sprintf("demo-%s-%d-%d", mode, cv.id, index)
	h := http.Header{"X-Request-Id": {id}, "Content-Type": {"application/json"}}
	start := time.Now()
	resp, err := r.Do(ctx, &kvroute.Request{Path: kvroute.PathChatCompletions, Header: h, Body: body})
	if err != nil {
		return turn{}, err
	}
	defer resp.Close()
	var text bytes.Buffer
	first := time.Duration(0)
	for {
		ev, err := resp.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return turn{}, err
		}
		if first == 0 {
			first = time.Since(start)
		}
		appendContent(&text, ev)
	}
	cv.hear(text.String())
	return turn{
		reuse:    reuse,
		conv:     cv.id,
		index:    index,
		outcome:  resp.Reuse(),
		overhead: max(0, first-clock.Take(id)),
	}, nil
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
// records, matched by X-Request-Id.
func join(res *modeResult, p, d *kvroutetest.Engine, prof kvroutetest.Profile) error {
	pre := map[string]kvroutetest.RequestRecord{}
	for _, r := range p.Requests() {
		if r.Role == "prefill" {
			pre[r.RequestID] = r
		}
	}
	dec := map[string]kvroutetest.RequestRecord{}
	for _, r := range d.Requests() {
		if r.Role == "decode" {
			dec[r.RequestID] = r
			if r.Wrong {
				res.wrong++
			}
		}
	}
	for i := range res.turns {
		t := &res.turns[i]
		mode := "off"
		if t.reuse {
			mode = "on"
		}
		id := fmt.Sprintf("demo-%s-%d-%d", mode, t.conv, t.index)
		pr, ok1 := pre[id]
		dr, ok2 := dec[id]
		if !ok1 || !ok2 {
			return fmt.Errorf("no engine records for turn %s", id)
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

package main

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// pauseRow is one reuse-on run with a think time between turns.
type pauseRow struct {
	pause     time.Duration
	later     int // turns after the first
	reused    int // of those, hits and decode-local turns
	expired   int // misses on a handle past its retention TTL (found expired, or released when its TTL ended): the plain-prefill fallback
	ttft      [3]time.Duration
	modelled  time.Duration // median TTFT of the later turns without the router's measured overhead
	heldMean  int           // KV tokens D held for retained handles, mean over the turns
	heldPeak  int
	ledger    int // the most KV the router counted for its live handles (Router.DecodeKV)
	wrong     int
	answered  int
	expiredOK bool // every expired turn answered right
}

// event is one turn of one conversation at its virtual start time.
type event struct {
	at   time.Duration
	conv int
	turn int
}

// schedule returns every turn's start time: conversation i starts at i
// seconds, then waits a think time drawn uniformly from
// pause×[1-jitter, 1+jitter] after each turn. Turns are run one at a time
// in this order, so each sees the virtual clock at its own start.
func schedule(c config, pause time.Duration) []event {
	var out []event
	for i := range c.conversations {
		rng := rand.New(rand.NewPCG(c.seed^0x9a05e, uint64(i)))
		at := time.Duration(i) * time.Second
		for t := range c.turns {
			out = append(out, event{at: at, conv: i, turn: t})
			f := 1 + c.pauseJitter*(2*rng.Float64()-1)
			at += time.Duration(f * float64(pause))
		}
	}
	slices.SortStableFunc(out, func(a, b event) int {
		switch {
		case a.at < b.at:
			return -1
		case a.at > b.at:
			return 1
		}
		return a.conv - b.conv
	})
	return out
}

// runPause runs every conversation with reuse on and think time pause
// between turns, on a virtual clock that the engines' decoder_kv_blocks_ttl
// and the router's retention TTL both follow.
func runPause(ctx context.Context, c config, pause time.Duration, tick func()) (pauseRow, error) {
	vc := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
	b, err := startBench(c, true, vc)
	if err != nil {
		return pauseRow{}, err
	}
	defer b.close()
	convs := make([]*conversation, c.conversations)
	for i := range convs {
		convs[i] = newConversation(i, c)
	}
	res := modeResult{reuse: true}
	row := pauseRow{pause: pause}
	var held []int
	start := vc.Now()
	for _, ev := range schedule(c, pause) {
		vc.Advance(start.Add(ev.at).Sub(vc.Now()))
		tr, err := runTurn(ctx, b.router, b.clock, b.renders, b.obs, convs[ev.conv], ev.turn, true)
		if err != nil {
			return pauseRow{}, fmt.Errorf("pause %s, conversation %d turn %d: %w", pause, ev.conv, ev.turn, err)
		}
		if b.model != nil {
			learn(b.model, tr, b.p, b.d, c.profile)
		}
		h := b.d.Stats().BlocksPinned * kvroutetest.DefaultBlockSize
		held = append(held, h)
		row.heldPeak = max(row.heldPeak, h)
		l := 0
		for _, kv := range b.router.DecodeKV() {
			l += int(kv.Tokens)
		}
		row.ledger = max(row.ledger, l)
		res.turns = append(res.turns, tr)
		tick()
	}
	if err := join(&res, b.p, b.d, c.profile); err != nil {
		return pauseRow{}, err
	}
	var ds, ms []time.Duration
	for _, t := range res.turns {
		if t.index == 0 {
			continue
		}
		row.later++
		ds = append(ds, t.ttft())
		ms = append(ms, t.engines()+t.render)
		if reused(t) {
			row.reused++
		}
		// A handle past its retention TTL is found expired, or is gone:
		// the router released it on D when its TTL ended.
		if t.missReason == kvroute.MissExpired || t.missReason == kvroute.MissNotFound {
			row.expired++
		}
	}
	row.ttft = percentiles(ds)
	row.modelled = percentiles(ms)[0]
	for _, h := range held {
		row.heldMean += h / max(len(held), 1)
	}
	row.wrong, row.answered = res.wrong, len(res.turns)
	return row, nil
}

// printPauses prints the think-time table.
func (s summary) printPauses(w io.Writer) {
	if len(s.pauses) == 0 {
		return
	}
	fmt.Fprintf(w, "\nThink time between turns (reuse on, virtual clock; D keeps a handle's blocks %s, the router retains it %s):\n",
		kvroutetest.DefaultDecoderBlocksTTL, kvroute.Defaults().TTLs.Retention)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "pause\thit rate\texpired\tTTFT p50\tp95\tp99\tKV held on D: mean\tpeak\trouter's count, peak\twrong answers\t")
	for _, r := range s.pauses {
		peak := s.heldString(r.heldPeak)
		if s.overCapacity(r.heldPeak) {
			peak += " OVER CAPACITY"
		}
		fmt.Fprintf(tw, "%s\t%.0f%%\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%d of %d\t\n", r.pause, 100*float64(r.reused)/float64(max(r.later, 1)), r.expired,
			ms(r.ttft[0]), ms(r.ttft[1]), ms(r.ttft[2]), s.heldString(r.heldMean), peak, s.heldString(r.ledger), r.wrong, r.answered)
	}
	_ = tw.Flush()
	fmt.Fprintln(w, "hit rate and TTFT over the turns after the first; expired: turns whose handle had outlived the retention TTL (found expired, or released by the router when its TTL ended) and ran as plain prefills")
}

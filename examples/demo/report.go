package main

import (
	"fmt"
	"io"
	"math"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/threshold"
)

// bucket is the figures of one turn index across conversations.
type bucket struct {
	turn         int
	tokens       int // the turn's nominal prompt length
	off, on      []turn
	offP, onP    [3]time.Duration // p50, p95, p99 of TTFT
	ratio        float64          // off p50 / on p50
	offRecompute time.Duration    // means of the prefill split
	onRecompute  time.Duration
	onTransfer   time.Duration
	onDecode     time.Duration // mean of D's part with reuse on: its read and first step
	hitRate      float64       // share of "on" turns that reused KV
	recomputed   float64       // share of prompt tokens P computed with reuse on
	heldTokens   int           // mean KV tokens D keeps per conversation, reuse on
}

// verification summarizes token verification over the "on" turns that
// looked a handle up.
type verification struct {
	calls      int              // turns with a render call
	render     [3]time.Duration // modelled render on the API server, p50 p95 p99
	renderSide [3]time.Duration // measured: the router's side of the render call
	longRender time.Duration    // p50 of the modelled render at the longest prompt
	longSide   time.Duration    // p50 of the router's side at the longest prompt
	unverified float64          // mean tokens of a found handle not verified (not reused)
	partial    int              // hits that attached only a verified prefix
}

// summary is the whole result of a demo run.
type summary struct {
	buckets      []bucket
	overhead     [3]time.Duration // router overhead p50, p95, p99 (real time), both modes
	offOverhead  [3]time.Duration // reuse off only
	onOverhead   [3]time.Duration // reuse on only
	hitRate      float64
	peakHeldToks int
	wrong        int
	turnsPerMode int
	profile      string
	kvBytes      float64
	capacity     int // the decode node's KV capacity in tokens, 0: unknown
	reasoning    bool
	verification verification
	published    []published // shown when the run reaches their prompt lengths
	growth       float64
	turns        int
	suffixTokens int
	decodeLocal  bool
	paths        map[threshold.Path]int // reuse-on turns by the cost model's path
	busy         int                    // turns estimated cheapest decode-local that pulled: D was busy
	estErr       [3]float64             // |estimate - modelled engine TTFT| / modelled, p50 p95 p99
	firstTokens  int                    // the first prompt's length with --suffix-tokens
	pauses       []pauseRow             // --pause
	// renderFixed and renderPerToken are the profile's render cost.
	renderFixed, renderPerToken time.Duration
}

func summarize(c config, off, on modeResult) summary {
	s := summary{profile: c.profile.Name, kvBytes: c.kvBytes, capacity: c.capacity, peakHeldToks: on.peakHeldToks,
		wrong: off.wrong + on.wrong, turnsPerMode: len(on.turns), reasoning: c.reasoning,
		growth: c.growth(), turns: c.turns, renderFixed: c.profile.RenderOverhead, renderPerToken: c.profile.RenderPerToken,
		suffixTokens: c.suffixTokens, decodeLocal: c.localMode(), paths: map[threshold.Path]int{}}
	if c.suffixTokens > 0 {
		s.firstTokens = c.nominal(0)
	}
	if !c.reasoning {
		s.published = c.published
	}
	s.buckets = make([]bucket, c.turns)
	for i := range s.buckets {
		s.buckets[i] = bucket{turn: i, tokens: c.nominal(i)}
	}
	var overheads, offOver, onOver []time.Duration
	hits := 0
	for _, t := range off.turns {
		b := &s.buckets[t.index]
		b.off = append(b.off, t)
		overheads = append(overheads, t.overhead)
		offOver = append(offOver, t.overhead)
	}
	var renders, sides, longRenders, longSides, estErrs []time.Duration
	var handles, unverified int
	for _, t := range on.turns {
		b := &s.buckets[t.index]
		b.on = append(b.on, t)
		overheads = append(overheads, t.overhead)
		onOver = append(onOver, t.overhead)
		if reused(t) {
			hits++
			if t.partial {
				s.verification.partial++
			}
		}
		if t.render > 0 {
			renders = append(renders, t.render)
			sides = append(sides, t.renderSide)
			if t.index == c.turns-1 {
				longRenders = append(longRenders, t.render)
				longSides = append(longSides, t.renderSide)
			}
		}
		if t.handleTokens > 0 && t.verified > 0 {
			handles++
			unverified += t.handleTokens - t.verified
		}
		if t.path != "" {
			s.paths[t.path]++
			if t.refusal == threshold.RefuseLocalBusy {
				s.busy++
			}
			if e := t.engines(); e > 0 && t.estimate > 0 {
				estErrs = append(estErrs, time.Duration(1e6*math.Abs(float64(t.estimate-e))/float64(e)))
			}
		}
	}
	for i, p := range percentiles(estErrs) {
		s.estErr[i] = float64(p) / 1e6
	}
	s.overhead = percentiles(overheads)
	s.offOverhead, s.onOverhead = percentiles(offOver), percentiles(onOver)
	if len(on.turns) > 0 {
		s.hitRate = float64(hits) / float64(len(on.turns))
	}
	v := &s.verification
	v.calls = len(renders)
	v.render, v.renderSide = percentiles(renders), percentiles(sides)
	v.longRender, v.longSide = percentiles(longRenders)[0], percentiles(longSides)[0]
	if handles > 0 {
		v.unverified = float64(unverified) / float64(handles)
	}
	for i := range s.buckets {
		s.buckets[i].fill()
	}
	return s
}

func (b *bucket) fill() {
	b.offP = percentiles(ttfts(b.off))
	b.onP = percentiles(ttfts(b.on))
	if b.onP[0] > 0 {
		b.ratio = float64(b.offP[0]) / float64(b.onP[0])
	}
	for _, t := range b.off {
		b.offRecompute += t.recompute / time.Duration(len(b.off))
	}
	var hits, computed, prompt, held int
	for _, t := range b.on {
		n := time.Duration(len(b.on))
		b.onRecompute += t.recompute / n
		b.onTransfer += t.transfer / n
		b.onDecode += t.decodeFirst / n
		if reused(t) {
			hits++
		}
		computed += t.computed
		prompt += t.promptTokens
		held += t.heldTokens
	}
	if n := len(b.on); n > 0 {
		b.hitRate = float64(hits) / float64(n)
		b.heldTokens = held / n
	}
	if prompt > 0 {
		b.recomputed = float64(computed) / float64(prompt)
	}
}

// reused reports whether a turn reused KV: a hit, or a decode-local turn
// (D's prefix cache, warm with the retained handle's blocks).
func reused(t turn) bool {
	return kvroute.ReuseOutcome(t.outcome) == kvroute.ReuseHit || kvroute.ReuseOutcome(t.outcome) == kvroute.ReuseLocal
}

func ttfts(ts []turn) []time.Duration {
	out := make([]time.Duration, len(ts))
	for i, t := range ts {
		out[i] = t.ttft()
	}
	return out
}

// percentiles returns the nearest-rank p50, p95 and p99.
func percentiles(ds []time.Duration) [3]time.Duration {
	if len(ds) == 0 {
		return [3]time.Duration{}
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	var out [3]time.Duration
	for i, p := range []float64{50, 95, 99} {
		k := int(p/100*float64(len(s))+0.999999) - 1
		out[i] = s[min(max(k, 0), len(s)-1)]
	}
	return out
}

// at returns the bucket whose nominal prompt length is tokens.
func (s summary) at(tokens int) (bucket, bool) {
	for _, b := range s.buckets {
		if b.tokens == tokens && len(b.on) > 0 && len(b.off) > 0 {
			return b, true
		}
	}
	return bucket{}, false
}

// ratioAt returns the off/on TTFT p50 ratio of the turn whose nominal
// prompt length is tokens.
func (s summary) ratioAt(tokens int) (float64, bool) {
	b, ok := s.at(tokens)
	return b.ratio, ok
}

// point is the modelled figures of one calibration point, engine time only
// (no render, no router overhead), p50 over the conversations.
type point struct{ off, on, prefillOn, transfer time.Duration }

// pointAt returns the modelled figures at the turn of nominal length tokens.
func (s summary) pointAt(tokens int) (point, bool) {
	b, ok := s.at(tokens)
	if !ok {
		return point{}, false
	}
	p50 := func(ts []turn, f func(turn) time.Duration) time.Duration {
		ds := make([]time.Duration, len(ts))
		for i, t := range ts {
			ds[i] = f(t)
		}
		return percentiles(ds)[0]
	}
	return point{
		off:       p50(b.off, turn.engines),
		on:        p50(b.on, turn.engines),
		prefillOn: p50(b.on, turn.prefillOn),
		transfer:  p50(b.on, func(t turn) time.Duration { return t.transfer }),
	}, true
}

func ms(d time.Duration) string { return fmt.Sprintf("%.0f", msf(d)) }

func kTokens(n int) string {
	if n < 10000 {
		return fmt.Sprintf("%.1fk", float64(n)/1000)
	}
	return fmt.Sprintf("%.0fk", float64(n)/1000)
}

// round rounds d for display: to 10 µs from 1 ms up, else to 1 µs.
func round(d time.Duration) time.Duration {
	if d >= time.Millisecond {
		return d.Round(10 * time.Microsecond)
	}
	return d.Round(time.Microsecond)
}

func pct(got time.Duration, want float64) string {
	return fmt.Sprintf("%.0f (%+.0f%%)", msf(got), 100*(msf(got)/want-1))
}

func (s summary) print(w io.Writer) {
	fmt.Fprintf(w, "\nbidikv demo: profile %s, 1 prefill (prefix caching off) + 1 decode engine, simulated.\n", s.profile)
	if s.reasoning {
		fmt.Fprintf(w, "Replies carry reasoning (<think>…</think>) that the chat template drops from past turns.\n")
	}
	if s.suffixTokens > 0 {
		mode := "on: the router's cost model may answer a turn on the decode engine alone"
		if !s.decodeLocal {
			mode = "off: every hit pulls D's KV to P"
		}
		fmt.Fprintf(w, "Conversations of %d turns: a first prompt of %s tokens, then %d new tokens a turn (a tool result)\nand the reply before it. Decode-local turns %s.\n",
			s.turns, kTokens(s.firstTokens), s.suffixTokens, mode)
	} else {
		fmt.Fprintf(w, "Conversations of %d turns, the prompt growing %.3f× a turn (%.0f%% of each prompt new).\n",
			s.turns, s.growth, 100*(1-1/s.growth))
	}
	fmt.Fprintf(w, "Engine times are MODELLED from the profile (calibrated on published 1P1D results); the router's own\n")
	fmt.Fprintf(w, "overhead is MEASURED in real time on this machine and added unscaled.\n\n")

	fmt.Fprintln(w, "Time to first token, ms (modelled + measured router overhead)")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "prompt\tturns\toff p50\toff p95\toff p99\ton p50\ton p95\ton p99\toff/on p50\t")
	for _, b := range s.buckets {
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%.2f×\t\n", s.label(b.tokens), len(b.on),
			ms(b.offP[0]), ms(b.offP[1]), ms(b.offP[2]), ms(b.onP[0]), ms(b.onP[1]), ms(b.onP[2]), b.ratio)
	}
	_ = tw.Flush()

	fmt.Fprintln(w, "\nWhere the time goes (modelled means, ms), reuse and KV held on decode (reuse on)")
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "prompt\toff: P recompute\ton: P KV pull\tP recompute\tD pull+1st token\thit rate\ttokens recomputed\tKV held on D\t")
	for _, b := range s.buckets {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%.0f%%\t%.0f%%\t%s\t\n", s.label(b.tokens), ms(b.offRecompute), ms(b.onTransfer),
			ms(b.onRecompute), ms(b.onDecode), 100*b.hitRate, 100*b.recomputed, s.heldString(b.heldTokens))
	}
	_ = tw.Flush()

	s.printPublished(w)

	fmt.Fprintf(w, "\nhit rate %.0f%% (the first turn of each conversation cannot hit); ", 100*s.hitRate)
	fmt.Fprintf(w, "peak KV held on decode for next turns: %s\n", s.heldOfCapacity(s.peakHeldToks))
	if s.overCapacity(s.peakHeldToks) {
		fmt.Fprintf(w, "OVER CAPACITY: the holds alone exceed the KV capacity of one %s decode node; real engines would queue and preempt requests (go run ./examples/bench --fleet measures it)\n", s.profile)
	}
	if v := s.verification; v.calls > 0 {
		if v.partial > 0 {
			fmt.Fprintf(w, "token verification: %d render calls; %d hits attached only the verified prefix (%.0f tokens of a handle unverified on average)\n",
				v.calls, v.partial, v.unverified)
		} else {
			fmt.Fprintf(w, "token verification: %d render calls; every hit verified the handle's whole sequence\n", v.calls)
		}
		fmt.Fprintf(w, "  render on the API server (MODELLED; the cost, %s + %s/token, is an assumption): p50 %s p99 %s, %s at the longest prompt\n",
			s.renderFixed, s.renderPerToken, round(v.render[0]), round(v.render[2]), round(v.longRender))
		fmt.Fprintf(w, "  the router's side of the render call (MEASURED: request, reading the token ids): p50 %s p99 %s, %s at the longest prompt\n",
			round(v.renderSide[0]), round(v.renderSide[2]), round(v.longSide))
		fmt.Fprintf(w, "  the fingerprint comparison is part of the reuse-on router overhead below\n")
	}
	fmt.Fprintf(w, "router overhead per turn (MEASURED, real time): reuse off p50 %s p95 %s p99 %s; reuse on p50 %s p95 %s p99 %s\n",
		round(s.offOverhead[0]), round(s.offOverhead[1]), round(s.offOverhead[2]),
		round(s.onOverhead[0]), round(s.onOverhead[1]), round(s.onOverhead[2]))
	if s.decodeLocal {
		fmt.Fprintf(w, "paths of reuse-on turns with a verified handle: pull %d, decode-local %d, recompute %d (%d pulled because D ran its maximum of decode-local prefills)\n",
			s.paths[threshold.PathPull], s.paths[threshold.PathLocal], s.paths[threshold.PathRecompute], s.busy)
		fmt.Fprintf(w, "cost model: |estimated - modelled engine TTFT| / modelled p50 %.0f%% p95 %.0f%% p99 %.0f%% (learned online from the turns, priors threshold.DefaultRates)\n",
			100*s.estErr[0], 100*s.estErr[1], 100*s.estErr[2])
	}
	fmt.Fprintf(w, "answers that differ from a single engine's: %d of %d\n", s.wrong, 2*s.turnsPerMode)
	if n := len(s.buckets); n > 0 {
		last := s.buckets[n-1]
		fmt.Fprintf(w, "off/on TTFT p50 at the longest prompt (%s): %.2f×", kTokens(last.tokens), last.ratio)
		if p := s.published; len(p) > 0 && p[len(p)-1].tokens == last.tokens {
			fmt.Fprintf(w, " (published: %.2f×)", p[len(p)-1].off/p[len(p)-1].on)
		}
		fmt.Fprintln(w)
	}
}

// printPublished compares the modelled engine time with the published
// figures at the calibration points the run reached.
func (s summary) printPublished(w io.Writer) {
	var rows []string
	for _, p := range s.published {
		m, ok := s.pointAt(p.tokens)
		if !ok {
			continue
		}
		rows = append(rows, fmt.Sprintf("%s\t%s\t%s\t%s\t%s\t", kTokens(p.tokens), pct(m.off, p.off), pct(m.on, p.on),
			pct(m.prefillOn, p.prefillOn), pct(m.transfer, p.transfer)))
	}
	if len(rows) == 0 {
		return
	}
	fmt.Fprintln(w, "\nCalibration points: modelled engine time p50, ms (vs published), without render or router overhead")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "prompt\tTTFT off\tTTFT on\tprefill on\tKV transfer\t")
	for _, r := range rows {
		fmt.Fprintln(tw, r)
	}
	_ = tw.Flush()
}

// label is a row's prompt length: in thousands, to a tenth with
// --suffix-tokens, whose rows are close together.
func (s summary) label(tokens int) string {
	if s.suffixTokens > 0 {
		return fmt.Sprintf("%.1fk", float64(tokens)/1000)
	}
	return kTokens(tokens)
}

// heldOfCapacity is heldString with the share of the decode node's KV
// capacity it takes, when the profile knows it.
func (s summary) heldOfCapacity(tokens int) string {
	if s.capacity <= 0 {
		return s.heldString(tokens)
	}
	return fmt.Sprintf("%s: %.0f%% of one %s decode node's KV capacity, %s", s.heldString(tokens),
		100*float64(tokens)/float64(s.capacity), s.profile, s.capacityString())
}

// capacityString is the decode node's KV capacity in tokens and bytes.
func (s summary) capacityString() string {
	if s.capacity < 1_000_000 {
		return s.heldString(s.capacity)
	}
	str := fmt.Sprintf("%.2fM tok", float64(s.capacity)/1e6)
	if s.kvBytes > 0 {
		str += fmt.Sprintf(" (%.1f GiB)", float64(s.capacity)*s.kvBytes/(1<<30))
	}
	return str
}

// overCapacity reports tokens above the decode node's KV capacity.
func (s summary) overCapacity(tokens int) bool { return s.capacity > 0 && tokens > s.capacity }

func (s summary) heldString(tokens int) string {
	if s.kvBytes > 0 {
		return fmt.Sprintf("%s tok (%.1f GiB)", kTokens(tokens), float64(tokens)*s.kvBytes/(1<<30))
	}
	return kTokens(tokens) + " tok"
}

package main

import (
	"fmt"
	"io"
	"slices"
	"text/tabwriter"
	"time"
)

// bucketWidth groups turns by prompt length.
const bucketWidth = 2000

// bucket is the figures of the turns whose prompt length rounds to tokens.
type bucket struct {
	tokens       int
	off, on      []turn
	offP, onP    [3]time.Duration // p50, p95, p99 of TTFT
	ratio        float64          // off p50 / on p50
	offRecompute time.Duration    // means of the prefill split
	onRecompute  time.Duration
	onTransfer   time.Duration
	hitRate      float64 // share of "on" turns that reused KV
	recomputed   float64 // share of prompt tokens P computed with reuse on
	heldTokens   int     // mean KV tokens D keeps per conversation, reuse on
}

// summary is the whole result of a demo run.
type summary struct {
	buckets      []bucket
	overhead     [3]time.Duration // router overhead p50, p95, p99 (real time)
	hitRate      float64
	peakHeldToks int
	wrong        int
	turnsPerMode int
	profile      string
	kvBytes      float64
}

func bucketOf(tokens int) int {
	return max(1, (tokens+bucketWidth/2)/bucketWidth) * bucketWidth
}

func summarize(c config, off, on modeResult) summary {
	s := summary{profile: c.profile.Name, kvBytes: c.kvBytes, peakHeldToks: on.peakHeldToks,
		wrong: off.wrong + on.wrong, turnsPerMode: len(on.turns)}
	by := map[int]*bucket{}
	get := func(tokens int) *bucket {
		k := bucketOf(tokens)
		if by[k] == nil {
			by[k] = &bucket{tokens: k}
		}
		return by[k]
	}
	var overheads []time.Duration
	hits := 0
	for _, t := range off.turns {
		b := get(t.promptTokens)
		b.off = append(b.off, t)
		overheads = append(overheads, t.overhead)
	}
	for _, t := range on.turns {
		b := get(t.promptTokens)
		b.on = append(b.on, t)
		overheads = append(overheads, t.overhead)
		if t.outcome == "hit" {
			hits++
		}
	}
	s.overhead = percentiles(overheads)
	if len(on.turns) > 0 {
		s.hitRate = float64(hits) / float64(len(on.turns))
	}
	for _, b := range by {
		b.fill()
		s.buckets = append(s.buckets, *b)
	}
	slices.SortFunc(s.buckets, func(a, b bucket) int { return a.tokens - b.tokens })
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
		b.onRecompute += t.recompute / time.Duration(len(b.on))
		b.onTransfer += t.transfer / time.Duration(len(b.on))
		if t.outcome == "hit" {
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

// ratioAt returns the off/on TTFT p50 ratio of the bucket holding tokens.
func (s summary) ratioAt(tokens int) (float64, bool) {
	for _, b := range s.buckets {
		if b.tokens == bucketOf(tokens) && len(b.on) > 0 && len(b.off) > 0 {
			return b.ratio, true
		}
	}
	return 0, false
}

func ms(d time.Duration) string { return fmt.Sprintf("%.0f", float64(d)/float64(time.Millisecond)) }

func kTokens(n int) string { return fmt.Sprintf("%.0fk", float64(n)/1000) }

func (s summary) print(w io.Writer) {
	fmt.Fprintf(w, "\nbidikv demo: profile %s, 1 prefill (prefix caching off) + 1 decode engine, simulated.\n", s.profile)
	fmt.Fprintf(w, "Engine times are MODELLED from the profile (calibrated on published 1P1D results); the router's own\n")
	fmt.Fprintf(w, "overhead is MEASURED in real time on this machine and added unscaled.\n\n")

	fmt.Fprintln(w, "Time to first token, ms (modelled + measured router overhead)")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "prompt\tturns\toff p50\toff p95\toff p99\ton p50\ton p95\ton p99\toff/on p50\t")
	for _, b := range s.buckets {
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%.2f×\t\n", kTokens(b.tokens), len(b.on),
			ms(b.offP[0]), ms(b.offP[1]), ms(b.offP[2]), ms(b.onP[0]), ms(b.onP[1]), ms(b.onP[2]), b.ratio)
	}
	_ = tw.Flush()

	fmt.Fprintln(w, "\nPrefill split (modelled means, ms), reuse and KV held on decode (reuse on)")
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	held := "KV held on D"
	fmt.Fprintf(tw, "prompt\toff recompute\ton recompute\ton KV transfer\thit rate\ttokens recomputed\t%s\t\n", held)
	for _, b := range s.buckets {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%.0f%%\t%.0f%%\t%s\t\n", kTokens(b.tokens), ms(b.offRecompute), ms(b.onRecompute),
			ms(b.onTransfer), 100*b.hitRate, 100*b.recomputed, s.heldString(b.heldTokens))
	}
	_ = tw.Flush()

	fmt.Fprintf(w, "\nhit rate %.0f%% (every turn after the first of each conversation can hit); ", 100*s.hitRate)
	fmt.Fprintf(w, "peak KV held on decode for next turns: %s\n", s.heldString(s.peakHeldToks))
	fmt.Fprintf(w, "router overhead per turn (measured, real time): p50 %s p95 %s p99 %s\n",
		s.overhead[0].Round(time.Microsecond), s.overhead[1].Round(time.Microsecond), s.overhead[2].Round(time.Microsecond))
	fmt.Fprintf(w, "answers that differ from a single engine's: %d of %d\n", s.wrong, 2*s.turnsPerMode)
}

func (s summary) heldString(tokens int) string {
	if s.kvBytes > 0 {
		return fmt.Sprintf("%s tok (%.1f GiB)", kTokens(tokens), float64(tokens)*s.kvBytes/(1<<30))
	}
	return kTokens(tokens) + " tok"
}

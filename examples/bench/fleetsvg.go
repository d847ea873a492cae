package main

import (
	"fmt"
	"io"
	"math"
	"slices"
)

// The fleet chart: KV held on the decode engines over time (left, both
// arms, with the capacity and the managed arm's budget) and the TTFT
// distribution (right, both arms, on a log scale).
const (
	fsvgW, fsvgH = 1100, 530
	fpanelW      = 430
	fpanelH      = 300
	fleftX       = 80
	frightX      = 620
	ftopY        = 80
)

var armColors = [3]string{"#2ca02c", "#d62728", "#1f77b4"} // unlimited, hold everything, managed

func writeFleetSVG(w io.Writer, rep fleetReport) error {
	c := rep.cfg
	doc := newSVG(w, fsvgW, fsvgH)
	doc.text(fleftX, 24, `font-size="16" font-weight="bold"`,
		fmt.Sprintf("Decode memory under pressure: %d agent sessions, %dP%dD %s", len(rep.plan), c.prefill, c.decode, c.profileName))
	doc.text(fleftX, 42, `fill="#555"`, fmt.Sprintf("Decode capacity %s tokens per engine (%.0f GiB); managed budget %.0f%% of it. Seed %d; modelled time on an event clock.",
		ktok(rep.capacity), gib(rep.capacity, c.prof.KVBytesPerToken), 100*c.budget, c.seed))
	arms := []armResult{rep.unlimited}
	names := []string{armLabel(rep.unlimited, true)}
	for _, managed := range []bool{false, true} {
		if a := rep.arm(managed, c.replicas); a != nil {
			arms, names = append(arms, *a), append(names, armLabel(*a, false))
		}
	}
	heldPanel(doc, rep, arms, names)
	ttftPanel(doc, arms, names)
	return doc.close()
}

// heldPanel draws the KV held over time, summed over the decode engines.
func heldPanel(doc *svgDoc, rep fleetReport, arms []armResult, names []string) {
	c := rep.cfg
	maxT, maxV := 1.0, float64(rep.capacity*c.decode)
	for _, a := range arms {
		for _, s := range a.samples {
			maxT = max(maxT, s.at.Minutes())
		}
	}
	var ss []series
	for i, a := range arms {
		held := series{name: names[i] + ": held", color: armColors[i]}
		used := series{name: names[i] + ": in use (holds + running)", color: armColors[i], dash: "4 3"}
		for _, s := range a.samples {
			h, u := 0, 0
			for k := range s.held {
				h += s.held[k]
				u += s.used[k]
			}
			held.pts = append(held.pts, [2]float64{s.at.Minutes(), float64(h) / 1e6})
			used.pts = append(used.pts, [2]float64{s.at.Minutes(), float64(u) / 1e6})
		}
		ss = append(ss, held, used)
	}
	left := svgPanel{x: fleftX, y: ftopY, w: fpanelW, h: fpanelH, maxX: maxT, maxY: maxV / 1e6 * 1.1}
	stepT, stepV := niceStep(maxT, 6), niceStep(left.maxY, 5)
	doc.axes(left, "KV held on the decode engines (sum over engines)", "modelled time, minutes", "tokens, millions",
		ticks(maxT, stepT), ticks(left.maxY, stepV), func(v float64) string { return fmt.Sprintf("%.0f", v) },
		func(v float64) string { return fmt.Sprintf("%.2g", v) })
	for _, s := range ss {
		doc.line(left, s)
	}
	capY := float64(rep.capacity*c.decode) / 1e6
	doc.p(`<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="black" stroke-dasharray="1 2"/>`, left.x, left.Y(capY), left.x+left.w, left.Y(capY))
	doc.text(float64(left.x+left.w), left.Y(capY)-4, `text-anchor="end" font-size="10"`, "capacity")
	if b := c.budgetTokens(rep.capacity) * c.decode; b > 0 {
		by := float64(b) / 1e6
		doc.p(`<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="%s" stroke-dasharray="1 2"/>`, left.x, left.Y(by), left.x+left.w, left.Y(by), armColors[2])
		doc.text(float64(left.x+left.w), left.Y(by)-4, `text-anchor="end" font-size="10"`, "managed budget")
	}
	doc.legend(fleftX, ftopY+fpanelH+50, ss)
}

// ttftPanel draws the TTFT distribution: the share of turns whose TTFT is
// at most x, on a log scale.
func ttftPanel(doc *svgDoc, arms []armResult, names []string) {
	lo, hi := 100.0, 1000.0 // ms
	for _, a := range arms {
		for _, t := range a.turns {
			if t.err == "" {
				ms := float64(t.ttft) / 1e6
				lo, hi = min(lo, ms), max(hi, ms)
			}
		}
	}
	l0, l1 := math.Floor(math.Log10(lo)), math.Ceil(math.Log10(hi))
	right := svgPanel{x: frightX, y: ftopY, w: fpanelW, h: fpanelH, maxX: l1 - l0, maxY: 100}
	doc.axes(right, "TTFT distribution (turns with TTFT at most x)", "TTFT (log scale)", "share of turns",
		ticks(l1-l0, 1), ticks(100, 20), func(v float64) string { return fms(math.Pow(10, v+l0)) },
		func(v float64) string { return fmt.Sprintf("%.0f%%", v) })
	var cdfs []series
	for i, a := range arms {
		var ms []float64
		for _, t := range a.turns {
			if t.err == "" {
				ms = append(ms, float64(t.ttft)/1e6)
			}
		}
		slices.Sort(ms)
		s := series{name: names[i], color: armColors[i]}
		for k, v := range ms {
			s.pts = append(s.pts, [2]float64{math.Log10(max(v, lo)) - l0, 100 * float64(k+1) / float64(len(ms))})
		}
		cdfs = append(cdfs, s)
		doc.line(right, s)
	}
	doc.legend(frightX, ftopY+fpanelH+50, cdfs)
}

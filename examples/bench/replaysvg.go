package main

import (
	"fmt"
	"io"
	"slices"
)

// The replay chart: reused tokens against mean held KV (left) and against
// peak held KV (right), both as shares of hold-everything's.
const (
	rsvgW, rsvgH    = 1000, 470
	rpanelW, rpanel = 400, 300
	rleftX, rrightX = 70, 570
	rtopY           = 70
)

func writeReplaySVG(w io.Writer, name string, rep replayReport) error {
	a := rep.all
	share := func(v, of float64) float64 { return 100 * v / of }
	mk := func(get func(budgetRow) outcome, peak bool) [][2]float64 {
		var pts [][2]float64
		for _, r := range rep.rows {
			o := get(r)
			x := o.mean
			if peak {
				x = float64(o.peak)
			}
			pts = append(pts, [2]float64{share(x, a.mean), share(float64(o.reused), float64(a.reused))})
		}
		slices.SortFunc(pts, func(p, q [2]float64) int {
			switch {
			case p[0] < q[0]:
				return -1
			case p[0] > q[0]:
				return 1
			}
			return 0
		})
		return pts
	}
	// The fixed TTL's points: both tunings lie on one curve.
	ttl := func(r budgetRow) []outcome { return []outcome{r.ttl, r.sameTTL} }
	ttlPts := func(peak bool) [][2]float64 {
		var pts [][2]float64
		for _, r := range rep.rows {
			for _, o := range ttl(r) {
				x := o.mean
				if peak {
					x = float64(o.peak)
				}
				pts = append(pts, [2]float64{share(x, a.mean), share(float64(o.reused), float64(a.reused))})
			}
		}
		slices.SortFunc(pts, func(p, q [2]float64) int {
			if p[0] < q[0] {
				return -1
			}
			if p[0] > q[0] {
				return 1
			}
			return 0
		})
		return pts
	}
	panels := []struct {
		x     int
		peak  bool
		title string
		xl    string
	}{
		{rleftX, false, "Reused tokens vs mean KV held", "mean KV held, % of hold-everything's mean"},
		{rrightX, true, "Reused tokens vs peak KV held", "peak KV held, % of hold-everything's mean"},
	}
	doc := newSVG(w, rsvgW, rsvgH)
	doc.text(rleftX, 24, `font-size="16" font-weight="bold"`, "Decode memory: trace replay of "+name)
	doc.text(rleftX, 42, `fill="#555"`, fmt.Sprintf("%d requests; hold everything for the TTL: mean %s tokens held, %s reused. Budgets: caps at 20%%–100%% of that mean.",
		rep.requests, mtok(a.mean), mtok(float64(a.reused))))
	pctf := func(v float64) string { return fmt.Sprintf("%.0f%%", v) }
	for _, pn := range panels {
		maxX := 100.0
		for _, r := range rep.rows {
			for _, o := range append(ttl(r), r.drop, r.managed, r.costly) {
				v := o.mean
				if pn.peak {
					v = float64(o.peak)
				}
				maxX = max(maxX, share(v, a.mean))
			}
		}
		maxX = float64(int(maxX/20)+1) * 20
		ss := []series{
			{name: "drop oldest", color: "#d62728", pts: mk(func(r budgetRow) outcome { return r.drop }, pn.peak), dots: true},
			{name: "fixed TTL", color: "#7f7f7f", dash: "5 3", pts: ttlPts(pn.peak), dots: true},
			{name: "managed (retention/budget)", color: "#1f77b4", pts: mk(func(r budgetRow) outcome { return r.managed }, pn.peak), dots: true},
			{name: "managed, cost-model value", color: "#9ecae1", dash: "2 2", pts: mk(func(r budgetRow) outcome { return r.costly }, pn.peak), dots: true},
		}
		pl := svgPanel{x: pn.x, y: rtopY, w: rpanelW, h: rpanel, maxX: maxX, maxY: 100}
		doc.axes(pl, pn.title, pn.xl, "reused tokens, % of hold-everything's", ticks(maxX, 20), ticks(100, 20), pctf, pctf)
		for _, s := range ss {
			doc.line(pl, s)
		}
		hx := 100.0
		if pn.peak {
			hx = share(float64(a.peak), a.mean)
		}
		doc.p(`<circle cx="%.1f" cy="%.1f" r="5" fill="none" stroke="black" stroke-width="1.5"/>`, pl.X(hx), pl.Y(100))
		doc.text(pl.X(hx)-4, pl.Y(100)-8, `text-anchor="end" font-size="10"`, "hold everything")
		doc.legend(pn.x+rpanelW-190, rtopY+rpanel-80, ss)
	}
	doc.text(rleftX, rsvgH-30, `fill="#555"`, "Managed: retention/budget's victims, gap model learned online (no look-ahead), one default configuration for every budget.")
	doc.text(rleftX, rsvgH-14, `fill="#555"`, "Fixed TTL: no cap, its peak exceeds the budget. Mean: time-averaged over the trace.")
	return doc.close()
}

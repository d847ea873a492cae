package main

import (
	"bufio"
	"fmt"
	"html"
	"io"
	"slices"
	"strings"
)

// The replay chart: reused tokens against mean held KV (left) and against
// peak held KV (right), both as shares of hold-everything's.
const (
	rsvgW, rsvgH    = 1000, 470
	rpanelW, rpanel = 400, 300
	rleftX, rrightX = 70, 570
	rtopY           = 70
)

type series struct {
	name, color, dash string
	pts               [][2]float64 // x: held, y: reused, both shares in %
}

func writeReplaySVG(w io.Writer, name string, rep replayReport) error {
	bw := bufio.NewWriter(w)
	p := func(format string, a ...any) { fmt.Fprintf(bw, format+"\n", a...) }
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
	p(`<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`, rsvgW, rsvgH, rsvgW, rsvgH)
	p(`<rect width="100%%" height="100%%" fill="white"/>`)
	p(`<text x="%d" y="24" font-size="16" font-weight="bold">Decode memory: trace replay of %s</text>`, rleftX, html.EscapeString(name))
	p(`<text x="%d" y="42" fill="#555">%d requests; hold everything for the TTL: mean %s tokens held, %s reused. Budgets: caps at 20%%–100%% of that mean.</text>`,
		rleftX, rep.requests, mtok(a.mean), mtok(float64(a.reused)))
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
			{"drop oldest", "#d62728", "", mk(func(r budgetRow) outcome { return r.drop }, pn.peak)},
			{"fixed TTL", "#7f7f7f", "5 3", ttlPts(pn.peak)},
			{"managed (retention/budget)", "#1f77b4", "", mk(func(r budgetRow) outcome { return r.managed }, pn.peak)},
			{"managed, cost-model value", "#9ecae1", "2 2", mk(func(r budgetRow) outcome { return r.costly }, pn.peak)},
		}
		x := func(v float64) float64 { return float64(pn.x) + v/maxX*rpanelW }
		y := func(v float64) float64 { return float64(rtopY+rpanel) - v/100*rpanel }
		p(`<text x="%d" y="%d" font-weight="bold">%s</text>`, pn.x, rtopY-8, html.EscapeString(pn.title))
		p(`<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`, pn.x, rtopY+rpanel, pn.x+rpanelW, rtopY+rpanel)
		p(`<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`, pn.x, rtopY, pn.x, rtopY+rpanel)
		for i := 0; i <= 5; i++ {
			v := 20 * float64(i)
			p(`<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#ddd"/>`, pn.x, y(v), pn.x+rpanelW, y(v))
			p(`<text x="%d" y="%.1f" text-anchor="end" font-size="10">%.0f%%</text>`, pn.x-4, y(v)+3, v)
		}
		for v := 0.0; v <= maxX; v += 20 {
			p(`<text x="%.1f" y="%d" text-anchor="middle" font-size="10">%.0f%%</text>`, x(v), rtopY+rpanel+14, v)
		}
		p(`<text x="%d" y="%d" text-anchor="middle">%s</text>`, pn.x+rpanelW/2, rtopY+rpanel+32, html.EscapeString(pn.xl))
		p(`<text transform="translate(%d,%d) rotate(-90)" text-anchor="middle">reused tokens, %% of hold-everything's</text>`, pn.x-48, rtopY+rpanel/2)
		for _, s := range ss {
			var pts []string
			for _, pt := range s.pts {
				pts = append(pts, fmt.Sprintf("%.1f,%.1f", x(pt[0]), y(pt[1])))
			}
			p(`<polyline fill="none" stroke="%s" stroke-width="2" stroke-dasharray="%s" points="%s"/>`, s.color, s.dash, strings.Join(pts, " "))
			for _, pt := range s.pts {
				p(`<circle cx="%.1f" cy="%.1f" r="2.5" fill="%s"/>`, x(pt[0]), y(pt[1]), s.color)
			}
		}
		hx := 100.0
		if pn.peak {
			hx = share(float64(a.peak), a.mean)
		}
		p(`<circle cx="%.1f" cy="%.1f" r="5" fill="none" stroke="black" stroke-width="1.5"/>`, x(hx), y(100))
		p(`<text x="%.1f" y="%.1f" text-anchor="end" font-size="10">hold everything</text>`, x(hx)-4, y(100)-8)
		for i, s := range ss {
			yy := rtopY + rpanel - 80 + 16*i
			p(`<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2" stroke-dasharray="%s"/>`, pn.x+rpanelW-190, yy, pn.x+rpanelW-170, yy, s.color, s.dash)
			p(`<text x="%d" y="%d" font-size="11">%s</text>`, pn.x+rpanelW-165, yy+4, html.EscapeString(s.name))
		}
	}
	p(`<text x="%d" y="%d" fill="#555">Managed: retention/budget's victims, gap model learned online (no look-ahead), one default configuration for every budget.</text>`, rleftX, rsvgH-30)
	p(`<text x="%d" y="%d" fill="#555">Fixed TTL: no cap, its peak exceeds the budget. Mean: time-averaged over the trace.</text>`, rleftX, rsvgH-14)
	p(`</svg>`)
	return bw.Flush()
}

package main

import (
	"bufio"
	"fmt"
	"html"
	"io"
	"math"
	"strconv"
	"strings"
	"time"
)

// Chart geometry: two panels side by side.
const (
	svgW, svgH          = 1000, 430
	panelW, panelH      = 400, 300
	leftX, rightX, topY = 70, 570, 60
)

const (
	colOff      = "#d62728"
	colOn       = "#1f77b4"
	colTransfer = "#9ecae1"
)

// writeSVG draws TTFT against prompt length (off vs on, p50 solid, p95
// dashed) and the prefill split (recompute vs KV transfer) per prompt length.
func writeSVG(w io.Writer, s summary) error {
	bw := bufio.NewWriter(w)
	p := func(format string, a ...any) { fmt.Fprintf(bw, format+"\n", a...) }
	p(`<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`, svgW, svgH, svgW, svgH)
	p(`<rect width="100%%" height="100%%" fill="white"/>`)
	p(`<text x="%d" y="24" font-size="16" font-weight="bold">bidikv demo, %s: reuse off (one-way P→D) vs on (bidirectional KV)</text>`, leftX, html.EscapeString(s.profile))
	p(`<text x="%d" y="42" fill="#555">Modelled engine times (calibrated on published 1P1D results) + measured router overhead; 1 prefill (no prefix caching) + 1 decode engine</text>`, leftX)

	minTok, maxTok, maxMS := math.Inf(1), 0.0, 0.0
	for _, b := range s.buckets {
		minTok = math.Min(minTok, float64(b.tokens))
		maxTok = math.Max(maxTok, float64(b.tokens))
		if len(b.off) > 0 {
			maxMS = max(maxMS, msf(b.offP[0]), msf(b.offP[1]))
		}
		if len(b.on) > 0 {
			maxMS = max(maxMS, msf(b.onP[0]), msf(b.onP[1]))
		}
	}
	xAxis := niceAxis(minTok, maxTok, false)
	yAxis := niceAxis(0, maxMS, true)

	// Left: TTFT vs prompt length.
	axes(p, leftX, "prompt length (tokens)", "TTFT (ms)", &xAxis, yAxis, "Time to first token")
	x := func(tok float64) float64 { return leftX + xAxis.frac(tok)*panelW }
	y := func(v float64) float64 { return topY + panelH - yAxis.frac(v)*panelH }
	var drawn [][2]float64 // every point, for the legend's place
	line := func(col, dash string, val func(bucket) time.Duration, on bool) {
		var pts []string
		for _, b := range s.buckets {
			if (on && len(b.on) == 0) || (!on && len(b.off) == 0) {
				continue
			}
			px, py := x(float64(b.tokens)), y(msf(val(b)))
			if len(pts) > 0 { // the segment from the last point, sampled
				last := drawn[len(drawn)-1]
				for k := 1; k < 20; k++ {
					f := float64(k) / 20
					drawn = append(drawn, [2]float64{last[0] + f*(px-last[0]), last[1] + f*(py-last[1])})
				}
			}
			drawn = append(drawn, [2]float64{px, py})
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", px, py))
		}
		p(`<polyline fill="none" stroke="%s" stroke-width="%s" stroke-dasharray="%s" points="%s"/>`, col, map[bool]string{true: "1", false: "2.5"}[dash != ""], dash, strings.Join(pts, " "))
		if dash == "" {
			for _, pt := range pts {
				xy := strings.Split(pt, ",")
				p(`<circle cx="%s" cy="%s" r="3" fill="%s"/>`, xy[0], xy[1], col)
			}
		}
	}
	line(colOff, "", func(b bucket) time.Duration { return b.offP[0] }, false)
	line(colOff, "4 3", func(b bucket) time.Duration { return b.offP[1] }, false)
	line(colOn, "", func(b bucket) time.Duration { return b.onP[0] }, true)
	line(colOn, "4 3", func(b bucket) time.Duration { return b.onP[1] }, true)
	lx, ly := legendPlace(leftX, drawn, 2)
	legend(p, lx, ly, []string{colOff, colOn}, []string{"reuse off, p50 (dashed: p95)", "reuse on, p50 (dashed: p95)"})

	// Right: prefill split per bucket, off bar then on bar.
	maxSplit := 0.0
	for _, b := range s.buckets {
		maxSplit = math.Max(maxSplit, math.Max(msf(b.offRecompute), msf(b.onRecompute+b.onTransfer)))
	}
	split := niceAxis(0, maxSplit, true)
	axes(p, rightX, "prompt length (tokens)", "prefill time (ms)", nil, split, "Prefill: recompute vs KV transfer (means)")
	ys := func(v float64) float64 { return topY + panelH - split.frac(v)*panelH }
	hs := func(v float64) float64 { return split.frac(v) * panelH }
	labels := bucketLabels(s.buckets)
	n := len(s.buckets)
	slot := float64(panelW) / float64(max(n, 1))
	barW := math.Max(2, slot*0.35)
	for i, b := range s.buckets {
		x0 := float64(rightX) + float64(i)*slot + slot*0.1
		rect(p, x0, ys(msf(b.offRecompute)), barW, hs(msf(b.offRecompute)), colOff)
		x1 := x0 + barW + 1
		rc := msf(b.onRecompute)
		tr := msf(b.onTransfer)
		rect(p, x1, ys(rc), barW, hs(rc), colOn)
		rect(p, x1, ys(rc+tr), barW, hs(tr), colTransfer)
		if n <= 12 || i%2 == 0 || i == n-1 { // at most about 12 labels fit
			p(`<text x="%.1f" y="%d" text-anchor="middle" font-size="10">%s</text>`, x0+barW, topY+panelH+14, labels[i])
		}
	}
	legend(p, rightX+10, topY+10, []string{colOff, colOn, colTransfer}, []string{"off: recompute", "on: recompute", "on: KV transfer from D"})
	p(`<text x="%d" y="%d" fill="#555">%s</text>`, leftX, svgH-12, html.EscapeString(footer(s)))
	p(`</svg>`)
	return bw.Flush()
}

// axes draws a panel's frame, grid and ticks: x ticks from xa (none when
// nil: the panel labels its bars), y ticks from ya.
func axes(p func(string, ...any), x0 int, xl, yl string, xa *axis, ya axis, title string) {
	p(`<text x="%d" y="%d" font-weight="bold">%s</text>`, x0, topY-6, html.EscapeString(title))
	p(`<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`, x0, topY+panelH, x0+panelW, topY+panelH)
	p(`<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`, x0, topY, x0, topY+panelH)
	for _, v := range ya.ticks() {
		yy := float64(topY+panelH) - ya.frac(v)*panelH
		p(`<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#ddd"/>`, x0, yy, x0+panelW, yy)
		p(`<text x="%d" y="%.1f" text-anchor="end" font-size="10">%s</text>`, x0-4, yy+3, numLabel(v))
	}
	if xa != nil {
		for _, v := range xa.ticks() {
			xx := float64(x0) + xa.frac(v)*panelW
			p(`<text x="%.1f" y="%d" text-anchor="middle" font-size="10">%s</text>`, xx, topY+panelH+14, tokLabel(v))
		}
	}
	p(`<text x="%d" y="%d" text-anchor="middle">%s</text>`, x0+panelW/2, topY+panelH+32, html.EscapeString(xl))
	p(`<text transform="translate(%d,%d) rotate(-90)" text-anchor="middle">%s</text>`, x0-48, topY+panelH/2, html.EscapeString(yl))
}

// legendWidth is wide enough for the longest legend label.
const legendWidth = 200

// legendPlace returns where, along the left or the right side of the
// panel at x0, a legend of n rows covers the fewest of the points drawn
// (the lines sampled), the highest such place on the left first.
func legendPlace(x0 int, pts [][2]float64, n int) (int, int) {
	h := 16 * n
	var corners [][2]int
	for _, x := range []int{x0 + 10, x0 + panelW - legendWidth - 10} {
		for y := topY + 10; y <= topY+panelH-h-10; y += 10 {
			corners = append(corners, [2]int{x, y})
		}
	}
	best, bestN := corners[0], math.MaxInt
	for _, c := range corners {
		k := 0
		for _, p := range pts {
			if p[0] >= float64(c[0]-6) && p[0] <= float64(c[0]+legendWidth) && p[1] >= float64(c[1]-6) && p[1] <= float64(c[1]+h+6) {
				k++
			}
		}
		if k < bestN {
			best, bestN = c, k
		}
	}
	return best[0], best[1]
}

// axis is a range with evenly spaced ticks at round values.
type axis struct{ lo, hi, step float64 }

// niceAxis covers [min, max] with 3 to 7 ticks at 1, 2, 2.5 or 5 times a
// power of ten: from 0 when zero is asked for or min is under half of max
// (the data then spans most of the range), else from just under min, so
// that data in a narrow band of large values fills the panel.
func niceAxis(min, max float64, zero bool) axis {
	if math.IsInf(min, 0) || max <= 0 {
		return axis{0, 1, 0.25}
	}
	lo := 0.0
	if !zero && min > max/2 {
		lo = min
	}
	if max <= lo {
		max = lo + 1
	}
	step := niceStep((max - lo) / 5)
	a := axis{lo: math.Floor(lo/step) * step, hi: math.Ceil(max/step) * step, step: step}
	if a.hi == a.lo {
		a.hi += step
	}
	return a
}

// niceStep rounds v up to 1, 2, 2.5 or 5 times a power of ten.
func niceStep(v float64) float64 {
	e := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 2.5, 5, 10} {
		if m*e >= v*(1-1e-9) {
			return m * e
		}
	}
	return 10 * e
}

func (a axis) frac(v float64) float64 { return (v - a.lo) / (a.hi - a.lo) }

// ticks lists the axis' tick values, lo to hi.
func (a axis) ticks() []float64 {
	var out []float64
	for i := 0; ; i++ {
		v := a.lo + float64(i)*a.step
		if v > a.hi+a.step/1e6 {
			return out
		}
		out = append(out, math.Round(v*1e6)/1e6)
	}
}

// numLabel writes a tick value exactly: 250, 12.5, 0.25.
func numLabel(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }

// tokLabel writes a token count tick exactly: 0, 500, 5k, 12.5k, 20.5k.
func tokLabel(v float64) string {
	if v != 0 && math.Abs(v) >= 1000 {
		return strconv.FormatFloat(v/1000, 'f', -1, 64) + "k"
	}
	return numLabel(v)
}

// bucketLabels names each bucket's prompt length as the tables do
// (kTokens), with one decimal more when two would read the same.
func bucketLabels(bs []bucket) []string {
	out := make([]string, len(bs))
	seen := map[string]bool{}
	dup := false
	for i, b := range bs {
		out[i] = kTokens(b.tokens)
		dup = dup || seen[out[i]]
		seen[out[i]] = true
	}
	if dup {
		for i, b := range bs {
			out[i] = strconv.FormatFloat(math.Round(float64(b.tokens)/100)/10, 'f', 1, 64) + "k"
		}
	}
	return out
}

// footer is the chart's last line: the figures of the text output's last
// lines, written as it writes them.
func footer(s summary) string {
	f := fmt.Sprintf("hit rate %.0f%%", 100*s.hitRate)
	if n := len(s.buckets); n > 0 {
		last := s.buckets[n-1]
		f += fmt.Sprintf("; off/on TTFT p50 at the longest prompt (%s): %.2f×", kTokens(last.tokens), last.ratio)
	}
	return f + fmt.Sprintf("; router overhead p50 (measured): reuse off %s, on %s", round(s.offOverhead[0]), round(s.onOverhead[0]))
}

func legend(p func(string, ...any), x, y int, cols, labels []string) {
	for i := range cols {
		yy := y + 16*i
		p(`<rect x="%d" y="%d" width="12" height="10" fill="%s"/>`, x, yy, cols[i])
		p(`<text x="%d" y="%d">%s</text>`, x+16, yy+9, html.EscapeString(labels[i]))
	}
}

func rect(p func(string, ...any), x, y, w, h float64, col string) {
	if h <= 0 {
		return
	}
	p(`<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"/>`, x, y, w, h, col)
}

func msf(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

package main

import (
	"bufio"
	"fmt"
	"html"
	"io"
	"math"
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
	p(`<text x="%d" y="42" fill="#555">Modelled engine times (simulated, calibrated on published 1P1D results) + measured router overhead</text>`, leftX)

	maxTok := 0.0
	maxMS := 0.0
	for _, b := range s.buckets {
		maxTok = math.Max(maxTok, float64(b.tokens))
		maxMS = max(maxMS, msf(b.offP[1]), msf(b.onP[1]))
	}
	maxTok = niceCeil(maxTok)
	maxMS = niceCeil(maxMS)

	// Left: TTFT vs prompt length.
	axes(p, leftX, "prompt length (tokens)", "TTFT (ms)", maxTok, maxMS, "Time to first token")
	x := func(tok float64) float64 { return leftX + tok/maxTok*panelW }
	y := func(v float64) float64 { return topY + panelH - v/maxMS*panelH }
	line := func(col, dash string, val func(bucket) time.Duration, on bool) {
		var pts []string
		for _, b := range s.buckets {
			if (on && len(b.on) == 0) || (!on && len(b.off) == 0) {
				continue
			}
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", x(float64(b.tokens)), y(msf(val(b)))))
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
	legend(p, leftX+10, topY+10, []string{colOff, colOn}, []string{"reuse off, p50 (dashed: p95)", "reuse on, p50 (dashed: p95)"})

	// Right: prefill split per bucket, off bar then on bar.
	maxSplit := 0.0
	for _, b := range s.buckets {
		maxSplit = math.Max(maxSplit, math.Max(msf(b.offRecompute), msf(b.onRecompute+b.onTransfer)))
	}
	maxSplit = niceCeil(maxSplit)
	axes(p, rightX, "prompt length (tokens)", "prefill time (ms)", maxTok, maxSplit, "Prefill: recompute vs KV transfer (means)")
	ys := func(v float64) float64 { return topY + panelH - v/maxSplit*panelH }
	n := len(s.buckets)
	slot := float64(panelW) / float64(max(n, 1))
	barW := math.Max(2, slot*0.35)
	for i, b := range s.buckets {
		x0 := float64(rightX) + float64(i)*slot + slot*0.1
		rect(p, x0, ys(msf(b.offRecompute)), barW, msf(b.offRecompute)/maxSplit*panelH, colOff)
		x1 := x0 + barW + 1
		rc := msf(b.onRecompute)
		tr := msf(b.onTransfer)
		rect(p, x1, ys(rc), barW, rc/maxSplit*panelH, colOn)
		rect(p, x1, ys(rc+tr), barW, tr/maxSplit*panelH, colTransfer)
		if n <= 12 || i%2 == 0 || i == n-1 { // at most about 12 labels fit
			p(`<text x="%.1f" y="%d" text-anchor="middle" font-size="10">%s</text>`, x0+barW, topY+panelH+14, kTokens(b.tokens))
		}
	}
	legend(p, rightX+10, topY+10, []string{colOff, colOn, colTransfer}, []string{"off: recompute", "on: recompute", "on: KV transfer from D"})
	p(`<text x="%d" y="%d" fill="#555">hit rate %.0f%%, router overhead p50 %s (measured). Engines: 1 prefill (no prefix caching) + 1 decode.</text>`,
		leftX, svgH-12, 100*s.hitRate, s.overhead[0].Round(time.Microsecond))
	p(`</svg>`)
	return bw.Flush()
}

func axes(p func(string, ...any), x0 int, xl, yl string, maxX, maxY float64, title string) {
	p(`<text x="%d" y="%d" font-weight="bold">%s</text>`, x0, topY-6, html.EscapeString(title))
	p(`<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`, x0, topY+panelH, x0+panelW, topY+panelH)
	p(`<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`, x0, topY, x0, topY+panelH)
	for i := 0; i <= 4; i++ {
		v := maxY * float64(i) / 4
		yy := float64(topY+panelH) - float64(i)/4*panelH
		p(`<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#ddd"/>`, x0, yy, x0+panelW, yy)
		p(`<text x="%d" y="%.1f" text-anchor="end" font-size="10">%.0f</text>`, x0-4, yy+3, v)
	}
	if !strings.Contains(title, "Prefill") {
		for i := 0; i <= 4; i++ {
			v := maxX * float64(i) / 4
			xx := float64(x0) + float64(i)/4*panelW
			p(`<text x="%.1f" y="%d" text-anchor="middle" font-size="10">%s</text>`, xx, topY+panelH+14, kTokens(int(v)))
		}
	}
	p(`<text x="%d" y="%d" text-anchor="middle">%s</text>`, x0+panelW/2, topY+panelH+32, html.EscapeString(xl))
	p(`<text transform="translate(%d,%d) rotate(-90)" text-anchor="middle">%s</text>`, x0-48, topY+panelH/2, html.EscapeString(yl))
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

// niceCeil rounds v up to 1, 2 or 5 times a power of ten.
func niceCeil(v float64) float64 {
	if v <= 0 {
		return 1
	}
	e := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*e >= v {
			return m * e
		}
	}
	return 10 * e
}

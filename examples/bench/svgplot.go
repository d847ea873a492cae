package main

import (
	"bufio"
	"fmt"
	"html"
	"io"
	"strings"
)

// Helpers of the bench's SVG charts (the trace replay's and the fleet's):
// a document, panels with axes and grid, series as polylines, legends.

// svgDoc writes one SVG document.
type svgDoc struct{ bw *bufio.Writer }

// newSVG starts a document of width × height on a white background.
func newSVG(w io.Writer, width, height int) *svgDoc {
	s := &svgDoc{bw: bufio.NewWriter(w)}
	s.p(`<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`, width, height, width, height)
	s.p(`<rect width="100%%" height="100%%" fill="white"/>`)
	return s
}

func (s *svgDoc) p(format string, a ...any) { fmt.Fprintf(s.bw, format+"\n", a...) }

// text writes escaped text at (x, y) with extra attributes.
func (s *svgDoc) text(x, y float64, attrs, t string) {
	s.p(`<text x="%.1f" y="%.1f" %s>%s</text>`, x, y, attrs, html.EscapeString(t))
}

// close ends the document and flushes it.
func (s *svgDoc) close() error {
	s.p(`</svg>`)
	return s.bw.Flush()
}

// svgPanel is a plot area: its top-left corner and size in pixels, and
// the data ranges its axes span (from 0).
type svgPanel struct {
	x, y, w, h int
	maxX, maxY float64
}

// X and Y map data to pixels.
func (pn svgPanel) X(v float64) float64 { return float64(pn.x) + v/pn.maxX*float64(pn.w) }
func (pn svgPanel) Y(v float64) float64 { return float64(pn.y+pn.h) - v/pn.maxY*float64(pn.h) }

// axes draws the panel's title, axes, horizontal grid at yTicks and
// labels at xTicks, formatted by fx and fy.
func (s *svgDoc) axes(pn svgPanel, title, xLabel, yLabel string, xTicks, yTicks []float64, fx, fy func(float64) string) {
	s.text(float64(pn.x), float64(pn.y-8), `font-weight="bold"`, title)
	s.p(`<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`, pn.x, pn.y+pn.h, pn.x+pn.w, pn.y+pn.h)
	s.p(`<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`, pn.x, pn.y, pn.x, pn.y+pn.h)
	for _, v := range yTicks {
		s.p(`<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#ddd"/>`, pn.x, pn.Y(v), pn.x+pn.w, pn.Y(v))
		s.text(float64(pn.x-4), pn.Y(v)+3, `text-anchor="end" font-size="10"`, fy(v))
	}
	for _, v := range xTicks {
		s.text(pn.X(v), float64(pn.y+pn.h+14), `text-anchor="middle" font-size="10"`, fx(v))
	}
	s.text(float64(pn.x+pn.w/2), float64(pn.y+pn.h+32), `text-anchor="middle"`, xLabel)
	s.p(`<text transform="translate(%d,%d) rotate(-90)" text-anchor="middle">%s</text>`, pn.x-48, pn.y+pn.h/2, html.EscapeString(yLabel))
}

// series is a named line of points in data units.
type series struct {
	name, color, dash string
	pts               [][2]float64
	dots              bool // a dot at every point
}

// line draws a series in a panel.
func (s *svgDoc) line(pn svgPanel, ser series) {
	var pts []string
	for _, pt := range ser.pts {
		pts = append(pts, fmt.Sprintf("%.1f,%.1f", pn.X(pt[0]), pn.Y(pt[1])))
	}
	s.p(`<polyline fill="none" stroke="%s" stroke-width="2" stroke-dasharray="%s" points="%s"/>`, ser.color, ser.dash, strings.Join(pts, " "))
	if ser.dots {
		for _, pt := range ser.pts {
			s.p(`<circle cx="%.1f" cy="%.1f" r="2.5" fill="%s"/>`, pn.X(pt[0]), pn.Y(pt[1]), ser.color)
		}
	}
}

// legend lists the series from (x, y) down.
func (s *svgDoc) legend(x, y int, ss []series) {
	for i, ser := range ss {
		yy := y + 16*i
		s.p(`<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2" stroke-dasharray="%s"/>`, x, yy, x+20, yy, ser.color, ser.dash)
		s.text(float64(x+25), float64(yy+4), `font-size="11"`, ser.name)
	}
}

// ticks returns 0, step, 2×step, ... up to max.
func ticks(maxV, step float64) []float64 {
	var out []float64
	for v := 0.0; v <= maxV+step/1e6; v += step {
		out = append(out, v)
	}
	return out
}

// niceStep is a round step (1, 2 or 5 × a power of ten) that cuts maxV
// into about n parts.
func niceStep(maxV float64, n int) float64 {
	if maxV <= 0 {
		return 1
	}
	raw := maxV / float64(n)
	p := 1.0
	for p*10 <= raw {
		p *= 10
	}
	for p > raw {
		p /= 10
	}
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= raw {
			return m * p
		}
	}
	return 10 * p
}

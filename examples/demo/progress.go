package main

import (
	"fmt"
	"io"
	"strings"
	"sync"
)

// progress draws a bar on one terminal line.
type progress struct {
	mu    sync.Mutex
	w     io.Writer // nil: silent
	done  int
	total int
	label string
	shown int // the percentage drawn last
}

func (p *progress) setLabel(s string) {
	p.mu.Lock()
	p.label = s
	p.shown = -1
	p.mu.Unlock()
}

func (p *progress) tick() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done++
	if p.w == nil {
		return
	}
	const width = 30
	pct := 100 * p.done / max(p.total, 1)
	if pct == p.shown && p.done != p.total {
		return // redraw only when the percentage moves
	}
	p.shown = pct
	n := width * p.done / max(p.total, 1)
	fmt.Fprintf(p.w, "\r[%s%s] %d/%d turns  %-12s", strings.Repeat("#", n), strings.Repeat(".", width-n), p.done, p.total, p.label)
	if p.done == p.total {
		fmt.Fprintln(p.w)
	}
}

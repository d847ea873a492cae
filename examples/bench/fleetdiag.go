package main

import (
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"time"
)

// diagRelease is one release request a router sent (--diagnose): the
// handle's remote_request_id (the decode engine's request that left the
// hold) and when, from the run's start.
type diagRelease struct {
	dReq string
	at   time.Duration
}

// noteRelease records a release request's body, sent at now.
func (r *fleetRig) noteRelease(body []byte, now time.Time) {
	var req struct {
		KV struct {
			ID string `json:"remote_request_id"`
		} `json:"kv_transfer_params"`
	}
	if json.Unmarshal(body, &req) != nil || req.KV.ID == "" {
		return
	}
	r.relMu.Lock()
	r.releases = append(r.releases, diagRelease{dReq: req.KV.ID, at: now.Sub(fleetEpoch)})
	r.relMu.Unlock()
}

// printDiagnosis classifies what managed lost against every hold's value
// (the offline bound's items).
func printDiagnosis(w io.Writer, a armResult, plan []sessionPlan, budgetTokens int) {
	type key struct{ s, t int }
	byKey := map[key]fleetTurn{}
	for _, t := range a.turns {
		byKey[key{t.session, t.turn}] = t
	}
	byReq := map[string]key{}
	for _, t := range a.turns {
		if t.dReq != "" {
			byReq[t.dReq] = key{t.session, t.turn}
		}
	}
	rel := map[key]time.Duration{}
	for _, r := range a.releases {
		if k, ok := byReq[r.dReq]; ok {
			rel[k] = r.at
		}
	}
	fmt.Fprintf(w, "\ndiagnosis: %s: %d release requests (%d of a turn's hold)\n", a.spec.name, len(a.releases), len(rel))
	type agg struct{ n, kept, lost, keptTok, lostTok, holdTok, cachedLost, promptLost int64 }
	groups := map[string]*agg{}
	add := func(g string, kept bool, v, h, cached, prompt int) {
		x := groups[g]
		if x == nil {
			x = &agg{}
			groups[g] = x
		}
		x.n++
		x.holdTok += int64(h)
		if kept {
			x.kept++
			x.keptTok += int64(v)
		} else {
			x.lost++
			x.lostTok += int64(v)
			x.cachedLost += int64(cached)
			x.promptLost += int64(prompt)
		}
	}
	samePrefill, turnsWithNext := 0, 0
	sameInstant := 0
	for _, t := range a.turns {
		if t.err != "" || t.decode < 0 {
			continue
		}
		n, ok := byKey[key{t.session, t.turn + 1}]
		if !ok {
			continue
		}
		turnsWithNext++
		if n.prefill == t.prefill {
			samePrefill++
		}
		h := t.dPrompt + t.dCompletion
		v := max(n.reused, min(h, n.prompt)-n.cached)
		if n.sent-t.answered > retentionTTL {
			v = n.reused
		}
		if v <= 0 {
			add("zero-value (P cache covers it, or after TTL)", n.reused > 0, 0, h, n.cached, n.prompt)
			continue
		}
		kept := n.reused > 0
		relAt, released := rel[key{t.session, t.turn}]
		cause := "lost, not released by the ledger"
		if kept {
			cause = "kept"
		} else if released {
			cause = "released"
			if d := n.sent - relAt; d < time.Second {
				sameInstant++
			}
		}
		add("all", kept, v, h, n.cached, n.prompt)
		add("by cause: "+cause, kept, v, h, n.cached, n.prompt)
		kind := "human reply"
		if t.tool {
			kind = "tool result"
		}
		add("by wait for: "+kind, kept, v, h, n.cached, n.prompt)
		add("by hold size: "+sizeBucket(h), kept, v, h, n.cached, n.prompt)
		add("by pause: "+pauseBucket(n.sent-t.answered), kept, v, h, n.cached, n.prompt)
		same := "next turn on another P"
		if n.prefill == t.prefill {
			same = "next turn on the same P"
		}
		add("by P: "+same, kept, v, h, n.cached, n.prompt)
		if released {
			add("released, waited: "+pauseBucket(relAt-t.answered), kept, v, h, n.cached, n.prompt)
			add("released, value/hold: "+ratioBucket(float64(v)/float64(h)), kept, v, h, n.cached, n.prompt)
		}
	}
	names := make([]string, 0, len(groups))
	for g := range groups {
		names = append(names, g)
	}
	sort.Strings(names)
	fmt.Fprintf(w, "  turns with a next turn %d, next on the same P %d (%.0f%%); releases whose hold's next turn came within 1 s: %d\n",
		turnsWithNext, samePrefill, 100*float64(samePrefill)/float64(max(turnsWithNext, 1)), sameInstant)
	fmt.Fprintf(w, "  %-48s %6s %6s %6s %9s %9s %9s %7s\n", "group", "holds", "kept", "lost", "keptTok", "lostTok", "holdTok", "P-cached%")
	for _, g := range names {
		x := groups[g]
		fmt.Fprintf(w, "  %-48s %6d %6d %6d %9s %9s %9s %6.0f%%\n", g, x.n, x.kept, x.lost, ktok(int(x.keptTok)), ktok(int(x.lostTok)),
			ktok(int(x.holdTok)), 100*float64(x.cachedLost)/float64(max(x.promptLost, 1)))
	}
	diagMemory(w, a)
	b := offlineBound(a, plan, budgetTokens, retentionTTL)
	fmt.Fprintf(w, "  offline bound with the budget (%s) for memory, not the capacity: %s (schedule %s); reused %s of it\n",
		ktok(budgetTokens), ktok(int(b.bound)), ktok(int(b.schedule)), pct(float64(figures(a).reused), float64(b.bound)))
}

// diagMemory prints the decode engines' mean KV in use and held, over
// the samples and engines.
func diagMemory(w io.Writer, a armResult) {
	var used, held, n int
	for _, s := range a.samples {
		for i := range s.used {
			used += s.used[i]
			held += s.held[i]
			n++
		}
	}
	n = max(n, 1)
	fmt.Fprintf(w, "  D KV per engine, mean over the samples: in use %s, held %s, running legs %s\n",
		ktok(used/n), ktok(held/n), ktok((used-held)/n))
}

func sizeBucket(h int) string {
	switch {
	case h < 8000:
		return "a <8k"
	case h < 16000:
		return "b 8-16k"
	case h < 32000:
		return "c 16-32k"
	case h < 64000:
		return "d 32-64k"
	}
	return "e >=64k"
}

func pauseBucket(d time.Duration) string {
	switch {
	case d < 10*time.Second:
		return "a <10s"
	case d < 60*time.Second:
		return "b 10-60s"
	case d < 300*time.Second:
		return "c 1-5min"
	case d < retentionTTL:
		return "d 5min-TTL"
	}
	return "e >=TTL"
}

func ratioBucket(r float64) string {
	switch {
	case r < 0.1:
		return "a <0.1"
	case r < 0.3:
		return "b 0.1-0.3"
	case r < 0.7:
		return "c 0.3-0.7"
	}
	return "d >=0.7"
}

// printTail prints what an arm's slowest turns (TTFT at or above its p99)
// are made of (--diagnose): their prompts, where P found the history, and
// the TTFT's parts, as means over those turns, and the slowest few; f is
// the arm's figures (the p99 its table shows).
func printTail(w io.Writer, a armResult, f armFigures) {
	p99 := time.Duration(percentile(f.ttft, 99) * 1e6)
	var tail []fleetTurn
	for _, t := range a.turns {
		if t.err == "" && t.ttft >= p99 {
			tail = append(tail, t)
		}
	}
	if len(tail) == 0 {
		return
	}
	sort.Slice(tail, func(i, j int) bool { return tail[i].ttft > tail[j].ttft })
	var s struct {
		prompt, computed, cached, tier, reused, dPulled, hit, peer int
		render, pLeg, pQueued, dFirst                              time.Duration
	}
	for _, t := range tail {
		s.prompt += t.prompt
		s.computed += t.computed
		s.cached += t.cached
		s.tier += t.tier
		s.reused += t.reused
		s.dPulled += t.dPulled
		s.render += t.render
		s.pLeg += t.pLeg
		s.pQueued += t.pQueued
		s.dFirst += t.dFirst
		if t.hit {
			s.hit++
		}
		if t.peerAsked {
			s.peer++
		}
	}
	n := len(tail)
	dms := func(d time.Duration) string { return fms(float64(d) / 1e6) }
	ms := func(d time.Duration) string { return dms(d / time.Duration(n)) }
	fmt.Fprintf(w, "\ntail: %s: %d turns at or above the p99 (%s); means: prompt %s tokens, P computed %s, cached %s, loaded from a CPU tier %s, pulled from a GPU hold %s (%d hits, %d tier pulls); render %s, prefill leg %s (P queued %s), D's first token %s reading %s tokens\n",
		a.spec.name, n, dms(p99), ktok(s.prompt/n), ktok(s.computed/n), ktok(s.cached/n), ktok(s.tier/n), ktok(s.reused/n),
		s.hit, s.peer, ms(s.render), ms(s.pLeg), ms(s.pQueued), ms(s.dFirst), ktok(s.dPulled/n))
	line := func(t fleetTurn) {
		way := "P"
		switch {
		case t.local:
			way = "local"
		case t.hit:
			way = "GPU hold"
		case t.peerAsked:
			way = "tier pull"
		}
		fmt.Fprintf(w, "  s%04d-t%02d: TTFT %s (%s, D%d): prompt %d, computed %d cached %d tier %d (D's own %d; estimated %d) GPU %d; render %s, leg %s (queued %s), D %s reading %d\n",
			t.session, t.turn, dms(t.ttft), way, t.decode, t.prompt, t.computed, t.cached, t.tier, t.dTier, t.est, t.reused,
			dms(t.render), dms(t.pLeg), dms(t.pQueued), dms(t.dFirst), t.dPulled)
	}
	for _, t := range tail[:min(5, n)] {
		line(t)
	}
	// the slowest turn's session, turn by turn: how it got there
	fmt.Fprintf(w, "  session %d:\n", tail[0].session)
	for _, t := range a.turns {
		if t.session == tail[0].session {
			line(t)
		}
	}
}

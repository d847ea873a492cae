package main

import (
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/bidikv/bidikv/retention/budget"
	"github.com/bidikv/bidikv/threshold"
)

// policy is how a replay decides what decode memory to keep.
type policy int

const (
	holdAll    policy = iota // every finished request for the TTL (vLLM today)
	dropOldest               // a cap on held tokens; over it, the oldest hold goes first
	fixedTTL                 // every finished request for a shorter TTL, no cap
	managed                  // a cap; over it, retention/budget's victims
	oracle                   // a cap; over it, the holds that will not be used go first (knows the future)
)

func (p policy) String() string {
	return [...]string{"hold everything", "drop oldest", "fixed TTL", "managed", "oracle"}[p]
}

// simHold is a request's KV held on the decode engine.
type simHold struct {
	tokens           int64
	created, expires float64 // seconds
}

// outcome is what a replay of one policy at one budget gave.
type outcome struct {
	policy policy
	cap    int64   // tokens; 0: none
	ttl    float64 // seconds
	reused int64   // tokens reused by hits
	hits   int
	saved  float64 // prefill seconds the hits saved, per the cost model
	mean   float64 // held tokens, time-averaged over the trace
	life   float64 // held token-seconds of every hold to its end, over the trace's duration
	// lifeUsed is the part of life spent by holds that ended in a hit.
	lifeUsed float64
	peak     int64
	// released counts the holds a cap removed before they were used or
	// expired.
	released int
	// gaps is what the managed policy's gap model learned, at the last
	// arrival.
	gaps budget.Snapshot
}

// event is the state after a request's arrival, for tests.
type event struct {
	n       int   // the request
	held    int64 // tokens held after it
	hit     int   // the request whose hold it used, -1 for none
	budget  *budget.Budget
	victims int
}

// savedSeconds is the prefill time a hit on n held tokens saves in the
// router's default cost model (threshold.DefaultRates): recomputing them
// minus pulling them, never below zero.
func savedSeconds(n int64) float64 {
	r := threshold.DefaultRates()
	x := float64(n)
	recompute := x*float64(r.PrefillPerToken) + r.PrefillAttention*x*(x-1)/2
	pull := float64(r.PullFixed) + x*float64(r.PullPerToken)
	return max(recompute-pull, 0) / 1e9
}

// tokenSeconds values a hit by the tokens it reuses: one microsecond each.
func tokenSeconds(n int64) float64 { return float64(n) * 1e-6 }

// replayConfig is one replay's policy and parameters.
type replayConfig struct {
	policy policy
	ttl    float64 // seconds a hold lasts at most
	cap    int64   // held tokens at most (dropOldest, managed)
	// opts configure the managed policy's Budget; the replay adds its
	// capacity (the cap) and a block size of one token.
	opts []budget.Option
	// saved is what a hit on n tokens saves, in seconds, as the managed
	// policy's caller tells its Budget.
	saved func(n int64) float64
}

// replay runs the trace under c; check, if not nil, sees every arrival.
func replay(tr *trace, c replayConfig, check func(event) error) (outcome, error) {
	o := outcome{policy: c.policy, cap: c.cap, ttl: c.ttl}
	var bud *budget.Budget
	if c.policy == managed {
		var err error
		opts := append([]budget.Option{budget.WithFraction(1), budget.WithCapacity(c.cap), budget.WithBlockSize(1)}, c.opts...)
		if bud, err = budget.New(opts...); err != nil {
			return o, err
		}
	}
	start := tr.reqs[0].at()
	epoch := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	clock := func(s float64) time.Time { return epoch.Add(time.Duration(math.Round(s * 1e9))) }

	holds := map[int]simHold{}
	var fifo []int // by creation, which is expiry order: one TTL per replay
	head := 0
	var held int64
	last := start
	integ := 0.0
	// advance expires what ends by t and integrates held memory up to t.
	advance := func(t float64) {
		for head < len(fifo) {
			r := fifo[head]
			h, ok := holds[r]
			if !ok {
				head++
				continue
			}
			if h.expires > t {
				break
			}
			integ += float64(held) * (h.expires - last)
			last = h.expires
			held -= h.tokens
			delete(holds, r)
			head++
		}
		integ += float64(held) * (t - last)
		last = t
	}
	drop := func(r int, t float64) {
		h := holds[r]
		held -= h.tokens
		o.life -= float64(h.tokens) * (h.expires - t)
		delete(holds, r)
	}

	for n, q := range tr.reqs {
		t := q.at()
		advance(t)
		ev := event{n: n, hit: -1, budget: bud}
		// The conversations this request continues: only it can use their
		// holds, and it uses the one that saves most.
		best := -1
		for _, r32 := range tr.firsts[n] {
			r := int(r32)
			_, live := holds[r]
			if bud != nil {
				if got := bud.Return(strconv.Itoa(r), clock(t)); got != live {
					return o, fmt.Errorf("request %d: the budget says hold %d live %v, the replay %v", n, r, got, live)
				}
			}
			if live && (best < 0 || min(holds[r].tokens, int64(q.InputLength)) > min(holds[best].tokens, int64(q.InputLength))) {
				best = r
			}
		}
		if best >= 0 {
			o.lifeUsed += float64(holds[best].tokens) * (t - holds[best].created)
			reused := min(holds[best].tokens, int64(q.InputLength))
			o.reused += reused
			o.saved += savedSeconds(reused)
			o.hits++
			ev.hit = best
		}
		for _, r := range tr.firsts[n] {
			if _, live := holds[int(r)]; live {
				drop(int(r), t) // used, or dead: its conversation has moved on
			}
		}
		// This request's own hold.
		h := simHold{tokens: q.held(), created: t, expires: t + c.ttl}
		holds[n] = h
		fifo = append(fifo, n)
		held += h.tokens
		o.life += float64(h.tokens) * c.ttl
		switch c.policy {
		case dropOldest:
			for held > c.cap {
				for {
					if _, ok := holds[fifo[head]]; ok {
						break
					}
					head++
				}
				drop(fifo[head], t)
				o.released++
				ev.victims++
			}
		case oracle:
			for held > c.cap {
				// Worst first: a hold its next turn will not use before it
				// expires (the oldest of those), else the one used last.
				worst, wk := -1, 0.0
				for r, h := range holds {
					k := tr.usedAt(r)
					if k < 0 || k >= h.expires {
						k = 1e12 - h.created
					}
					if worst < 0 || k > wk || (k == wk && r < worst) {
						worst, wk = r, k
					}
				}
				drop(worst, t)
				o.released++
				ev.victims++
			}
		case managed:
			err := bud.Add(budget.Hold{
				Key: strconv.Itoa(n), Engine: "D", Tokens: int(h.tokens),
				Created: clock(t), Expires: clock(h.expires),
				Features: budget.Features{Turn: tr.turn[n]},
				Saved:    time.Duration(c.saved(h.tokens) * 1e9),
			})
			if err != nil {
				return o, err
			}
			for _, v := range bud.Victims("D", 0, clock(t)) {
				r, err := strconv.Atoi(v.Key)
				if _, ok := holds[r]; err != nil || !ok {
					return o, fmt.Errorf("request %d: victim %q is not held", n, v.Key)
				}
				drop(r, t)
				o.released++
				ev.victims++
			}
		}
		o.peak = max(o.peak, held)
		ev.held = held
		if check != nil {
			if err := check(ev); err != nil {
				return o, fmt.Errorf("request %d: %w", n, err)
			}
		}
	}
	end := tr.reqs[len(tr.reqs)-1].at()
	if bud != nil {
		o.gaps = bud.Snapshot(clock(end), time.Duration(c.ttl*1e9))
	}
	if d := end - start; d > 0 {
		o.mean = integ / d
		o.life /= d
		o.lifeUsed /= d
	}
	return o, nil
}

// tuneTTL finds the fixed TTL whose mean held memory is target tokens (to
// within 0.1%), by bisection: the mean grows with the TTL.
func tuneTTL(tr *trace, maxTTL float64, target float64) (outcome, error) {
	lo, hi := 0.0, maxTTL
	var best outcome
	for range 40 {
		mid := (lo + hi) / 2
		o, err := replay(tr, replayConfig{policy: fixedTTL, ttl: mid}, nil)
		if err != nil {
			return o, err
		}
		if o.mean > target {
			hi = mid
		} else {
			lo, best = mid, o
		}
		if math.Abs(o.mean-target) < target*1e-3 && o.mean <= target {
			return o, nil
		}
	}
	return best, nil
}

package sim

import (
	"context"
	"errors"
	"time"
)

// The scheduler: KV capacity as vLLM's v1 scheduler (vllm/v1/core/sched/
// scheduler.py) and KV cache manager decide it, per data-parallel rank.
//
//   - A request joins the tail of the waiting queue. The head is admitted
//     when the pool can give it blocks for its whole prompt, less what the
//     prefix cache already holds (kv_cache_manager.allocate_slots: the free
//     queue, evictable cached blocks included, must cover the new blocks
//     plus the cached hits that are themselves free) and fewer than
//     MaxNumSeqs requests run; otherwise it and everything behind it wait
//     (first come, first served: schedule() stops at the first request it
//     cannot allocate).
//   - At most MaxNumSeqs requests run (len(self.running) ==
//     max_num_running_reqs stops the waiting loop). An admitted request
//     that reads from a remote (a pull) is loading (WAITING_FOR_REMOTE_KVS):
//     it holds its blocks, counts as waiting, takes no running slot and
//     cannot be preempted. It waits in the skipped_waiting queue, which
//     the first-come-first-served policy scans before the waiting queue
//     (_select_waiting_queue_for_scheduling): once read, it runs when a
//     slot is free, ahead of preempted and new requests.
//   - A running request allocates one block each time its sequence crosses
//     a block boundary (one decode token at a time). With no free block it
//     preempts the running request scheduled last (running.pop(), FCFS
//     policy), which may be itself: the victim's blocks are freed (they stay
//     in the prefix cache until evicted), it goes to the front of the
//     waiting queue, and when admitted again it recomputes its prompt and
//     the tokens generated so far, less its prefix-cache hit
//     (_preempt_request, num_computed_tokens = 0).
//   - After a preemption nothing is admitted in that step (schedule()
//     runs its waiting loop only "if not preempted_reqs"): not a request
//     whose KV has been read, though the preemption freed a running slot,
//     not the victim. Admission resumes at the next step, one decode step
//     (Profile.InterTokenLatency) later.
//   - Blocks held for a remote reader (P for the lease, D for
//     decoder_kv_blocks_ttl) stay allocated: counted as used, never evicted.
//   - Whatever frees blocks (a request finishing, a notification, an expiry)
//     admits what now fits.
//
// Compute is not shared: each request's modelled durations are its own, as
// before; only KV memory is contended. Waiting and recomputation add
// modelled time to the request (Record.Queued, Requeued, Recompute,
// FirstToken).

// turnState is where a request is in the scheduler.
type turnState int

const (
	stateNew       turnState = iota
	stateQueued              // waiting, never admitted
	stateLoading             // admitted, about to run or reading from a remote (pulling): not preemptible
	stateLoaded              // read from a remote, waiting in the queue for a running slot
	stateRunning             // in the running list
	statePreempted           // waiting again after a preemption
	stateDone                // finished, failed or aborted
	stateDead                // the engine restarted while it waited
)

// phases of a running request
const (
	phasePrefill = iota
	phaseDecode
)

var errEngineRestarted = errors.New("sim: engine restarted")

// admit queues t on its rank and waits until the scheduler gives it blocks
// for its prompt. A D request given up while it waits (never scheduled)
// still notifies P, which frees its blocks, as the connector's
// request_finished does for a request whose do_remote_prefill is still set;
// a P request given up while it waits notifies nobody (its D handle stays
// held). e.mu not held.
func (e *Engine) admit(ctx context.Context, t *turn) error {
	e.mu.Lock()
	r := e.ranks[t.rank]
	t.rk = r
	t.wake = make(chan struct{}, 1)
	t.arrived = e.clock.Now()
	t.state = stateQueued
	r.waiting = append(r.waiting, t)
	e.schedule(r)
	if t.state == stateQueued {
		e.stats.Queued++
		e.startHeartbeat(t)
	}
	err := e.waitAdmitted(ctx, t)
	var notify func()
	if err != nil && t.state == stateDone && t.role == RoleDecode && t.params != nil && t.params.Usable() {
		p := t.params
		notify = func() {
			if peer := e.reg.Lookup(p.Host, p.Port); peer != nil {
				_ = peer.Notify(context.WithoutCancel(ctx), p.EngineID, p.RequestID)
			}
		}
	}
	if err == nil {
		t.rec.Queued = e.elapsed(t.arrived)
	}
	e.mu.Unlock()
	if notify != nil {
		notify()
	}
	return err
}

// waitAdmitted blocks t while it waits in its rank's queue (e.mu held). On
// ctx's end it leaves the queue.
//
// A request let in while its client went away stays admitted (its caller
// ends it with the blocks it was given); one still waiting leaves the
// queue (stateDone).
func (e *Engine) waitAdmitted(ctx context.Context, t *turn) error {
	_, timers := e.clock.(Timer)
	waiting := func() bool { return t.state == stateQueued || t.state == statePreempted || t.state == stateLoaded }
	for waiting() {
		e.block(ctx, t, !timers)
		if !waiting() {
			break
		}
		if err := ctx.Err(); err != nil {
			e.leaveQueue(t)
			return err
		}
		if !timers {
			e.schedule(t.rk)
		}
	}
	e.stopHeartbeat(t)
	if t.state == stateDead {
		return errEngineRestarted
	}
	return ctx.Err()
}

// leaveQueue takes t out of its rank's waiting queues; e.mu held.
func (e *Engine) leaveQueue(t *turn) {
	r := t.rk
	r.unqueue(t)
	e.stopHeartbeat(t)
	t.state = stateDone
	e.schedule(r)
}

// schedule admits waiting requests of rank r while a running slot is
// free: first those whose KV has been read from a remote (they need no
// blocks), then the waiting queue head first while its requests fit; it
// admits nothing in the step of a preemption. It arms a timer for the next
// hold expiry when some still wait; e.mu held. A request that will read
// from a remote is admitted to load (it takes no running slot until read).
func (e *Engine) schedule(r *rank) {
	now := e.clock.Now()
	e.sweep(now)
	for !now.Before(r.stepEnd) && len(r.loaded)+len(r.waiting) > 0 {
		if e.cfg.MaxNumSeqs > 0 && r.slots() >= e.cfg.MaxNumSeqs {
			break
		}
		if len(r.loaded) > 0 {
			t := r.loaded[0]
			r.loaded = r.loaded[1:]
			t.state = stateRunning
			r.running = append(r.running, t)
			e.wakeTurn(t)
			continue
		}
		t := r.waiting[0]
		if !e.allocate(r, t) {
			break
		}
		r.waiting = r.waiting[1:]
		if t.state == stateQueued {
			t.state = stateLoading
			r.loading++
			if _, plan := e.pullPlan(t); plan == PullRead || t.tierTokens > 0 {
				// get_num_new_matched_tokens: load_kv_async
				t.pulling = true
				r.pulls++
			}
		} else {
			t.state = stateRunning
			r.running = append(r.running, t)
		}
		e.wakeTurn(t)
	}
	e.armExpiry(r, now)
}

// allocate gives t blocks for its sequence so far (its prompt, or after a
// preemption its prompt and the tokens generated before it), using the
// prefix cache; it reports false when the pool cannot. e.mu held.
func (e *Engine) allocate(r *rank, t *turn) bool {
	toks := t.toks
	if t.started {
		toks = t.allToks[:t.sofar()]
	}
	p := r.pool
	hits := p.lookup(toks)
	evictable := 0
	for _, b := range hits {
		if b.ref == 0 {
			evictable++
		}
	}
	need := (len(toks)+p.bs-1)/p.bs - len(hits)
	if p.freeCount()-evictable < need {
		return false
	}
	for _, b := range hits {
		p.touch(b)
	}
	fresh, _ := p.allocate(need)
	t.pool = p
	t.seq = &seq{pool: p, blocks: append(hits, fresh...)}
	t.hit = len(hits) * p.bs
	e.tierLoad(r, t, toks)
	if t.started {
		// recomputed: the same KV the request held before
		for pos := t.hit; pos < len(toks); pos++ {
			s := t.seq.at(pos)
			s.kv, s.tok = t.allKV[pos], toks[pos]
		}
		p.commit(t.seq.blocks, toks)
	}
	return true
}

// grow makes t's blocks cover n positions (a decode step), preempting the
// running request scheduled last while the pool has no free block. It
// reports false when t itself was preempted. e.mu held.
//
// Like vLLM, it does not let waiting requests in while it preempts; the
// blocks its victims free beyond its own need admit them afterwards.
func (e *Engine) grow(t *turn, n int) bool {
	p, r := t.pool, t.rk
	need := (n+p.bs-1)/p.bs - len(t.seq.blocks)
	if need <= 0 {
		return true
	}
	e.sweep(e.clock.Now())
	for p.freeCount() < need {
		if len(r.running) == 0 {
			// t is not in the running list (cannot happen): wait as a
			// preempted request does
			e.preempt(t)
			return false
		}
		v := r.running[len(r.running)-1]
		e.preempt(v)
		if v == t {
			e.schedule(r)
			return false
		}
	}
	fresh, _ := p.allocate(need)
	t.seq.blocks = append(t.seq.blocks, fresh...)
	e.schedule(r)
	return true
}

// preempt frees v's blocks and puts it at the front of its rank's waiting
// queue, counting the tokens it generated until now; e.mu held.
func (e *Engine) preempt(v *turn) {
	r := v.rk
	if v.phase == phaseDecode && v.chunk > 0 {
		if itl := e.cfg.Profile.InterTokenLatency; itl > 0 {
			v.done += min(v.chunk, int(e.elapsed(v.phaseAt)/itl))
		} else {
			v.done += v.chunk
		}
		v.chunk = 0
	}
	if v.seq != nil {
		// what it computed stays in the prefix cache until evicted
		e.commitDone(v)
		v.seq.release()
	}
	for i, w := range r.running {
		if w == v {
			r.running = append(r.running[:i], r.running[i+1:]...)
			break
		}
	}
	v.state = statePreempted
	v.recompute = true
	v.rec.Preemptions++
	v.waitFrom = e.clock.Now()
	r.preemptions++
	e.stats.Preemptions++
	r.waiting = append([]*turn{v}, r.waiting...)
	if v.stopWork != nil {
		v.stopWork()
	}
	e.wakeTurn(v)
	e.endStep(r)
}

// resume waits until a preempted t is admitted again and recomputes what
// it had (its prompt and the tokens generated so far, less its prefix-cache
// hit), as often as it is preempted meanwhile. e.mu held.
//
// A preempted request may be let in again before its goroutine looks (the
// blocks its preemption freed fit it again): it recomputes all the same.
func (e *Engine) resume(ctx context.Context, t *turn) error {
	for t.recompute {
		if err := e.waitAdmitted(ctx, t); err != nil {
			return err
		}
		t.recompute = false
		t.rec.Requeued += e.elapsed(t.waitFrom)
		n := t.sofar()
		d := e.cfg.Profile.Prefill(n-t.hit, t.hit)
		if t.role != RolePrefill {
			// a decode engine recomputes as its plain requests prefill
			d = e.cfg.Profile.LocalPrefill(n-t.hit, t.hit)
		}
		t.rec.Recompute += d
		e.stats.TokensRecomputed += n - t.hit
		t.phase, t.phaseAt, t.chunk = phasePrefill, e.clock.Now(), 0
		if err := e.work(ctx, t, d); err != nil {
			return err
		}
	}
	if t.state != stateRunning {
		return errEngineRestarted
	}
	return nil
}

// prefill moves an admitted t to the running list and passes its prefill;
// e.mu held. A t that read from a remote first waits in the queue for a
// running slot.
func (e *Engine) prefill(ctx context.Context, t *turn) error {
	r := t.rk
	r.loading--
	if t.pulling {
		if err := e.awaitSlot(ctx, t); err != nil {
			return err
		}
	} else {
		t.state = stateRunning
		r.running = append(r.running, t)
	}
	t.phase, t.phaseAt, t.chunk = phasePrefill, e.clock.Now(), 0
	if err := e.work(ctx, t, t.rec.Prefill); err != nil {
		return err
	}
	if err := e.resume(ctx, t); err != nil {
		return err
	}
	switch e.mode {
	case modeEvent, modeReal:
		// what passed: a preemption may have cut a prefill short
		t.rec.FirstToken = e.elapsed(t.arrived)
	default:
		// time passed serially, or not at all
		t.rec.FirstToken = t.rec.Queued + t.rec.Transfer + t.rec.Prefill + t.rec.Requeued + t.rec.Recompute
	}
	return nil
}

// decode passes steps decode steps of t (one generated token each; the
// first token costs one step too), allocating a block at each block
// boundary and resuming after preemptions; e.mu held.
func (e *Engine) decode(ctx context.Context, t *turn, steps int) error {
	itl := e.cfg.Profile.InterTokenLatency
	for steps > 0 {
		if err := e.resume(ctx, t); err != nil {
			return err
		}
		// generated token j needs the KV of positions up to t.n+j-1
		// (n > 1 choices stream more steps than choice 0 has tokens;
		// the blocks hold choice 0's)
		j := t.done
		if j >= 1 && !e.grow(t, min(t.n+j, len(t.allKV))) {
			continue
		}
		k := steps
		if covered := len(t.seq.blocks) * t.pool.bs; covered < len(t.allKV) {
			k = max(min(steps, covered-t.n-j+1), 1)
		}
		t.phase, t.phaseAt, t.chunk = phaseDecode, e.clock.Now(), k
		before, epoch := t.done, t.rec.Preemptions
		if err := e.work(ctx, t, itl*time.Duration(k)); err != nil {
			return err
		}
		if t.rec.Preemptions != epoch {
			// the preemption counted what it generated
			steps -= t.done - before
			continue
		}
		t.chunk = 0
		t.done += k
		steps -= k
		e.commitDone(t)
	}
	return nil
}

// sofar is the length of t's sequence so far: its prompt and the tokens
// it generated.
func (t *turn) sofar() int { return min(t.n+t.done, len(t.allToks)) }

// commitDone writes the KV of the positions t has computed so far into
// its blocks and caches the full ones; e.mu held.
func (e *Engine) commitDone(t *turn) {
	upto := min(t.n+t.done-1, len(t.allKV), len(t.seq.blocks)*t.pool.bs)
	for pos := t.n; pos < upto; pos++ {
		s := t.seq.at(pos)
		s.kv, s.tok = t.allKV[pos], t.allToks[pos]
	}
	t.pool.commit(t.seq.blocks, t.allToks[:upto])
	e.offload(t, t.allToks, upto)
}

// work waits d of modelled work for t (e.mu held, released while it
// waits). It returns early when t is preempted (t.state tells) or ctx
// ends.
func (e *Engine) work(ctx context.Context, t *turn, d time.Duration) error {
	if d <= 0 || e.mode == modeInstant {
		return ctx.Err()
	}
	if e.mode == modeSleep {
		s := e.clock.(Sleeper)
		e.mu.Unlock()
		err := s.Sleep(ctx, d)
		e.mu.Lock()
		return err
	}
	t.gen++
	gen := t.gen
	fired := false
	epoch := t.rec.Preemptions // a preemption ends the wait, even if t is let in again at once
	stop := e.afterWork(d, func() {
		e.mu.Lock()
		defer e.mu.Unlock()
		if t.gen == gen {
			fired = true
			e.wakeTurn(t)
		}
	})
	t.stopWork = stop
	for !fired && t.rec.Preemptions == epoch && (t.state == stateRunning || t.state == stateLoading) && ctx.Err() == nil {
		e.block(ctx, t, false)
	}
	t.stopWork = nil
	t.gen++
	if !fired {
		stop()
	}
	return ctx.Err()
}

// block parks t until it is woken (or ctx ends, or, with poll, pollEvery
// passed); e.mu held on entry and return, released meanwhile.
func (e *Engine) block(ctx context.Context, t *turn, poll bool) {
	select { // a wake given before t looked at its state again
	case <-t.wake:
	default:
	}
	if !t.parked {
		t.parked = true
		e.park()
	}
	e.mu.Unlock()
	var tick <-chan time.Time
	if poll {
		tm := time.NewTimer(pollEvery)
		defer tm.Stop()
		tick = tm.C
	}
	select {
	case <-t.wake:
	case <-ctx.Done():
	case <-tick:
	}
	e.mu.Lock()
	if t.parked {
		t.parked = false
		t.resume = e.unpark()
	}
	if resume := t.resume; resume != nil {
		// an event clock lets woken goroutines go on one at a time
		t.resume = nil
		e.mu.Unlock()
		resume()
		e.mu.Lock()
	}
}

// wakeTurn wakes t if it waits; e.mu held.
func (e *Engine) wakeTurn(t *turn) {
	if t.parked {
		t.parked = false
		t.resume = e.unpark()
	}
	select {
	case t.wake <- struct{}{}:
	default:
	}
}

// finishTurn takes t out of the scheduler (finished, failed or aborted):
// its blocks are released unless keep (a hold took them), and whatever
// now fits is admitted; e.mu held.
func (e *Engine) finishTurn(t *turn, keep bool) {
	r := t.rk
	if r == nil {
		return
	}
	switch t.state {
	case stateLoading:
		r.loading--
		if t.pulling {
			t.pulling = false
			r.pulls--
		}
	case stateRunning:
		for i, w := range r.running {
			if w == t {
				r.running = append(r.running[:i], r.running[i+1:]...)
				break
			}
		}
	case stateQueued, statePreempted, stateLoaded:
		r.unqueue(t)
	}
	t.state = stateDone
	e.unpinTier(t)
	if !keep && t.seq != nil {
		t.seq.release()
	}
	e.stopHeartbeat(t)
	e.schedule(r)
}

// armExpiry arms one timer per rank for the earliest hold deadline while
// requests wait for blocks, so that an expiry admits them at its time;
// e.mu held.
func (e *Engine) armExpiry(r *rank, now time.Time) {
	if len(r.waiting)+len(r.loaded) == 0 {
		if r.expiryStop != nil {
			r.expiryStop()
			r.expiryStop = nil
		}
		return
	}
	var next time.Time
	for _, h := range r.active {
		if next.IsZero() || h.deadline.Before(next) {
			next = h.deadline
		}
	}
	if next.IsZero() || (r.expiryStop != nil && !r.expiryAt.After(next)) {
		return
	}
	if r.expiryStop != nil {
		r.expiryStop()
	}
	stop, ok := e.afterClock(next.Sub(now), func() {
		e.mu.Lock()
		defer e.mu.Unlock()
		if r.expiryAt.Equal(next) {
			r.expiryStop = nil
		}
		e.schedule(r)
	})
	if ok {
		r.expiryStop, r.expiryAt = stop, next
	}
}

// startHeartbeat keeps P's blocks alive while D request t waits for blocks,
// as the connector's heartbeats do (every kv_lease_duration/6, D's own
// setting); e.mu held.
func (e *Engine) startHeartbeat(t *turn) {
	p := t.params
	if t.role != RoleDecode || p == nil || !p.Usable() {
		return
	}
	every := e.cfg.LeaseDuration / 6
	if every <= 0 {
		return
	}
	var beat func()
	beat = func() {
		e.mu.Lock()
		if t.state != stateQueued {
			e.mu.Unlock()
			return
		}
		t.heartbeat, _ = e.afterClock(every, beat)
		e.mu.Unlock()
		if peer := e.reg.Lookup(p.Host, p.Port); peer != nil {
			_ = peer.Heartbeat(context.Background(), p.EngineID, p.RequestID)
		}
	}
	t.heartbeat, _ = e.afterClock(every, beat)
}

func (e *Engine) stopHeartbeat(t *turn) {
	if t.heartbeat != nil {
		t.heartbeat()
		t.heartbeat = nil
	}
}

package sim

import (
	"context"
	"time"
)

// Running slots and scheduler steps (sched.go has the rest of the
// scheduler): a request loading KV from a remote takes no running slot and,
// once read, waits for one ahead of the waiting queue; after a preemption
// nothing is admitted until the next step.

// slots is the number of running slots of rank r taken: the running
// requests and the admitted ones about to run; a request reading from a
// remote takes none.
func (r *rank) slots() int { return len(r.running) + r.loading - r.pulls }

// awaitSlot puts t, whose KV was read from a remote, in its rank's queue
// of loaded requests (skipped_waiting) and waits until the scheduler lets
// it run (it keeps its blocks meanwhile; the wait counts in
// Record.Queued); e.mu held.
func (e *Engine) awaitSlot(ctx context.Context, t *turn) error {
	r := t.rk
	t.pulling = false
	r.pulls--
	t.state = stateLoaded
	r.loaded = append(r.loaded, t)
	from := e.clock.Now()
	e.schedule(r)
	if err := e.waitAdmitted(ctx, t); err != nil {
		return err
	}
	t.rec.Queued += e.elapsed(from)
	return nil
}

// endStep makes rank r admit nothing until its next step, one decode step
// from now, and arms the timer that schedules then; e.mu held. Without a
// modelled step (zero cost, or a clock that passes modelled time serially)
// the next scheduling event is the next step.
func (e *Engine) endStep(r *rank) {
	step := e.cfg.Profile.InterTokenLatency
	if step <= 0 || (e.mode != modeEvent && e.mode != modeReal) {
		return
	}
	if r.stepStop != nil {
		r.stepStop()
	}
	clockStep := step
	if e.mode == modeReal {
		clockStep = time.Duration(float64(step) / e.cfg.Speed)
	}
	r.stepEnd = e.clock.Now().Add(clockStep)
	r.stepStop = e.afterWork(step, func() {
		e.mu.Lock()
		defer e.mu.Unlock()
		r.stepStop = nil
		e.schedule(r)
	})
}

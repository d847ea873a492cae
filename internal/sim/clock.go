package sim

import (
	"context"
	"time"
)

// Clock tells the engine the time.
type Clock interface{ Now() time.Time }

// Sleeper is an optional Clock capability: a clock that implements it (such
// as a virtual clock) receives the modelled durations instead of real sleeps.
// Unless the clock is also a Parker, the engine calls Sleep and takes its
// return as the end of the modelled work (a virtual clock that moves by
// Sleep serialises modelled time: fit for one request at a time).
type Sleeper interface {
	Sleep(ctx context.Context, d time.Duration) error
}

// Timer is an optional Clock capability: AfterFunc calls f once the clock
// has moved d past its Now (in its own goroutine or in the one that moves
// the clock), unless stop, called first, returns true. The engine uses it
// for the deadlines of leases and decoder_kv_blocks_ttl while requests wait
// for blocks, and for heartbeats. Without it, a waiting request looks at the
// clock every 5 ms of real time.
type Timer interface {
	AfterFunc(d time.Duration, f func()) (stop func() bool)
}

// Parker is an optional Clock capability of a discrete-event clock, one
// whose time moves only when a driver fires its next timer: every goroutine
// the engine blocks (a request waiting for blocks, or for the end of its
// modelled work, which the engine then times with Timer instead of Sleep)
// is counted by Park before it blocks, and uncounted by Unpark, called
// synchronously by whoever wakes it. The woken goroutine calls the resume
// function Unpark returned before it goes on: the clock lets woken
// goroutines run one at a time, in the order they were woken, so that a
// run does not depend on how the Go scheduler orders them. A driver that
// knows how many goroutines are meant to be blocked can so tell when the
// system has settled and the next timer may fire (kvroutetest.EventClock).
type Parker interface {
	Timer
	Park()
	Unpark() (resume func())
}

type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }

func (realClock) AfterFunc(d time.Duration, f func()) func() bool { return time.AfterFunc(d, f).Stop }

// pollEvery is how often a request waiting for blocks looks at a clock
// without timers.
const pollEvery = 5 * time.Millisecond

// clockMode is how the engine passes modelled work.
type clockMode int

const (
	modeInstant clockMode = iota // real clock, speed 0: no wait at all
	modeReal                     // real time: modelled / speed
	modeSleep                    // the clock's Sleep (VirtualClock: advances at once)
	modeEvent                    // a Parker: timers on the clock, goroutines parked
)

func (e *Engine) clockMode() clockMode {
	switch e.clock.(type) {
	case Parker:
		return modeEvent
	case Sleeper:
		return modeSleep
	}
	if e.cfg.Speed > 0 {
		return modeReal
	}
	return modeInstant
}

// afterClock calls f once the engine's clock has moved d (leases, TTLs,
// heartbeats). It reports false when the clock has no timers.
func (e *Engine) afterClock(d time.Duration, f func()) (stop func() bool, ok bool) {
	if tm, ok := e.clock.(Timer); ok {
		return tm.AfterFunc(max(d, 0), f), true
	}
	return nil, false
}

// afterWork calls f once d of modelled work has passed: on the clock's
// timers for an event clock, in real time divided by the speed otherwise.
func (e *Engine) afterWork(d time.Duration, f func()) (stop func() bool) {
	if e.mode == modeEvent {
		return e.clock.(Timer).AfterFunc(d, f)
	}
	return time.AfterFunc(time.Duration(float64(d)/e.cfg.Speed), f).Stop
}

// elapsed is the modelled time since t on the engine's clock: real time
// times the speed when modelled work runs in scaled real time.
func (e *Engine) elapsed(since time.Time) time.Duration {
	d := e.clock.Now().Sub(since)
	if e.mode == modeReal {
		d = time.Duration(float64(d) * e.cfg.Speed)
	}
	return max(d, 0)
}

func (e *Engine) park() {
	if p, ok := e.clock.(Parker); ok {
		p.Park()
	}
}

// unpark uncounts a parked goroutine; it returns what that goroutine must
// call before it goes on (nil when nothing).
func (e *Engine) unpark() func() {
	if p, ok := e.clock.(Parker); ok {
		return p.Unpark()
	}
	return nil
}

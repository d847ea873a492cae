package kvroutetest

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// Clock tells an engine the time.
type Clock interface{ Now() time.Time }

// VirtualClock is a Clock that moves only when told to. Engines on it also
// advance it by their modelled durations (prefill, transfer, decode) instead
// of sleeping, so modelled time can be read off the clock: time is serial,
// fit for one request at a time (EventClock runs concurrent requests in
// modelled time). Its timers (AfterFunc) fire as Advance passes them; the
// engines use them for the lease and TTL deadlines that let a request
// waiting for blocks in. Safe for concurrent use.
type VirtualClock struct {
	mu     sync.Mutex
	now    time.Time
	timers timerHeap
	seq    uint64
}

// NewVirtualClock returns a clock reading start.
func NewVirtualClock(start time.Time) *VirtualClock { return &VirtualClock{now: start} }

// Now returns the clock's time.
func (c *VirtualClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Advance moves the clock forward by d (negative d is ignored), running the
// timers it passes in order, each at its own time, in the calling
// goroutine.
func (c *VirtualClock) Advance(d time.Duration) {
	if d <= 0 {
		return
	}
	c.mu.Lock()
	end := c.now.Add(d)
	for len(c.timers) > 0 && !c.timers[0].at.After(end) {
		tm := heap.Pop(&c.timers).(*timer)
		c.now = later(c.now, tm.at)
		tm.fired = true
		c.mu.Unlock()
		tm.f()
		c.mu.Lock()
	}
	c.now = later(c.now, end)
	c.mu.Unlock()
}

// Sleep advances the clock by d at once; it fails only when ctx is done.
func (c *VirtualClock) Sleep(ctx context.Context, d time.Duration) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	c.Advance(d)
	return nil
}

// AfterFunc runs f when an Advance (or Sleep) moves the clock d past now,
// unless stop, called first, returns true.
func (c *VirtualClock) AfterFunc(d time.Duration, f func()) (stop func() bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.seq++
	tm := &timer{at: c.now.Add(max(d, 0)), seq: c.seq, f: f}
	heap.Push(&c.timers, tm)
	return func() bool { return c.stop(tm) }
}

func (c *VirtualClock) stop(tm *timer) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if tm.fired || tm.index < 0 {
		return false
	}
	heap.Remove(&c.timers, tm.index)
	return true
}

// EventClock is a discrete-event clock for many concurrent requests in
// modelled time, such as a fleet of agent sessions: time moves only when
// its next timer fires, and a timer fires only when every participant is
// blocked on the clock. Engines on it pass their modelled work (prefill,
// transfer, each decode step, render) on its timers, and count every
// goroutine they block (a request waiting for KV blocks, or for the end of
// its modelled work) as blocked; so do Sleep's callers. A request then
// takes exactly its modelled time, waits in an engine's queue while the
// engine has no room, and is preempted at the modelled moment another
// request needs its blocks.
//
// A driver makes each session a participant (Join, Leave when it ends)
// whose every step blocks on the clock: its think time is Sleep, its
// requests block in the engines (one request in flight per session: a
// session whose request blocks twice at once, such as a render beside a
// prefill leg, counts twice), and calls Run:
//
//	clk := kvroutetest.NewEventClock(start)
//	// engines WithClock(clk), the router WithClock(clk.Now)
//	for i := range sessions {
//		clk.Join()
//		go func() {
//			defer clk.Leave()
//			for turn := range turns {
//				_ = clk.Sleep(ctx, pause(i, turn))
//				send(i, turn) // through the router; answers as modelled
//			}
//		}()
//	}
//	err := clk.Run(ctx)
//
// Run fires the earliest timer whenever as many goroutines are blocked as
// there are participants, one timer at a time. The goroutines a timer or a
// running session wakes go on one at a time, in the order they were woken
// (a session runs until it blocks on the clock again, and only then does
// the next one go on), so a run does not depend on the Go scheduler and
// repeats exactly. Sessions must start blocked (Sleep until their first
// arrival) or be started before Run. A client that gives up on a request
// breaks the count for a moment (the engine notices in real time): let the
// session wait until the engine has let the request go
// (Engine.FinishedRequests) before it goes on or leaves; such a run is
// still correct, but no longer repeats exactly. Times a client reads off the clock
// while an answer streams may be later than the engine's: take modelled
// figures from the engines' records (RequestRecord.FirstToken, Queued,
// Preemptions). Safe for concurrent use.
type EventClock struct {
	mu           sync.Mutex
	cond         *sync.Cond
	now          time.Time
	timers       timerHeap
	seq          uint64
	blocked      int
	participants int
	fired        int
	running      bool            // a woken goroutine holds the turn to run
	queue        []chan struct{} // woken goroutines waiting for the turn
}

// NewEventClock returns an event clock reading start.
func NewEventClock(start time.Time) *EventClock {
	c := &EventClock{now: start}
	c.cond = sync.NewCond(&c.mu)
	return c
}

// Now returns the clock's time.
func (c *EventClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// AfterFunc runs f when the clock reaches now + d (d <= 0: at the next
// Fire), in the goroutine that fires it, unless stop, called first, returns
// true.
func (c *EventClock) AfterFunc(d time.Duration, f func()) (stop func() bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.seq++
	tm := &timer{at: c.now.Add(max(d, 0)), seq: c.seq, f: f}
	heap.Push(&c.timers, tm)
	c.cond.Broadcast()
	return func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		if tm.fired || tm.index < 0 {
			return false
		}
		heap.Remove(&c.timers, tm.index)
		return true
	}
}

// Park counts a goroutine that is about to block until a timer or another
// goroutine wakes it; it ends the caller's turn to run, which passes to
// the goroutine woken first since.
func (c *EventClock) Park() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.blocked++
	c.pass()
	c.cond.Broadcast()
}

// Unpark, called by whoever wakes a goroutine counted by Park, uncounts
// it; the woken goroutine calls resume before it goes on, which returns
// when its turn to run comes.
func (c *EventClock) Unpark() (resume func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.blocked--
	turn := make(chan struct{})
	switch {
	case c.participants <= 0:
		// no run: nothing to take turns with
		close(turn)
	case !c.running:
		c.running = true
		close(turn)
	default:
		c.queue = append(c.queue, turn)
		c.cond.Broadcast()
	}
	return func() { <-turn }
}

// pass hands the turn to run to the next woken goroutine, if any; c.mu
// held.
func (c *EventClock) pass() {
	if len(c.queue) == 0 {
		c.running = false
		return
	}
	close(c.queue[0])
	c.queue[0] = nil
	c.queue = c.queue[1:]
}

// Sleep blocks the caller, counted as blocked, until the clock has moved d
// (d <= 0 returns at once), or until ctx is done.
func (c *EventClock) Sleep(ctx context.Context, d time.Duration) error {
	if err := ctx.Err(); err != nil || d <= 0 {
		return err
	}
	done := make(chan struct{})
	var resume func()
	// the timer first: Run fires only once the caller counts as blocked
	stop := c.AfterFunc(d, func() {
		resume = c.Unpark()
		close(done)
	})
	c.Park()
	select {
	case <-done:
		resume()
		return nil
	case <-ctx.Done():
		if stop() {
			c.Unpark()()
		} else {
			<-done
			resume()
		}
		return ctx.Err()
	}
}

// Join adds a participant: Run fires a timer only when at least as many
// goroutines are blocked as there are participants.
func (c *EventClock) Join() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.participants++
}

// Leave removes a participant, when its session ends; it ends the
// caller's turn to run.
func (c *EventClock) Leave() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.participants--
	c.pass()
	if c.participants <= 0 {
		c.passAll()
	}
	c.cond.Broadcast()
}

// Blocked returns the number of goroutines blocked on the clock.
func (c *EventClock) Blocked() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.blocked
}

// Next returns the time of the earliest timer, false when there is none.
func (c *EventClock) Next() (time.Time, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.timers) == 0 {
		return time.Time{}, false
	}
	return c.timers[0].at, true
}

// Fired returns the number of timers fired so far.
func (c *EventClock) Fired() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.fired
}

// Fire moves the clock to the earliest timer and runs it in the calling
// goroutine; it reports false when there is none.
func (c *EventClock) Fire() bool {
	c.mu.Lock()
	if len(c.timers) == 0 {
		c.mu.Unlock()
		return false
	}
	tm := heap.Pop(&c.timers).(*timer)
	c.now = later(c.now, tm.at)
	tm.fired = true
	c.fired++
	c.mu.Unlock()
	tm.f()
	return true
}

// AwaitBlocked waits until at least n goroutines are blocked on the clock
// (or ctx is done).
func (c *EventClock) AwaitBlocked(ctx context.Context, n int) error {
	stop := context.AfterFunc(ctx, func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.cond.Broadcast()
	})
	defer stop()
	c.mu.Lock()
	defer c.mu.Unlock()
	for c.blocked < n && ctx.Err() == nil {
		c.cond.Wait()
	}
	return ctx.Err()
}

// strayGrace is how long Run lets a goroutine hold the turn to run while
// every participant is blocked before it takes it: only a goroutine that
// belongs to no session (a request whose client gave up) holds it longer.
const strayGrace = 100 * time.Millisecond

// ErrStalled is returned by Run when every participant is blocked and no
// timer is left to wake any.
var ErrStalled = errors.New("kvroutetest: event clock stalled: all participants blocked, no timer")

// Run drives the clock until no participant is left: whenever at least as
// many goroutines are blocked as there are participants, it fires the
// earliest timer. It returns ErrStalled when they are all blocked with no
// timer left, or ctx's error.
func (c *EventClock) Run(ctx context.Context) error {
	stop := context.AfterFunc(ctx, func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.cond.Broadcast()
	})
	defer stop()
	for {
		c.mu.Lock()
		var held time.Time // since when a goroutine holds the turn while all else waits
		for c.participants > 0 && ctx.Err() == nil {
			if c.blocked+len(c.queue) < c.participants {
				held = time.Time{}
				c.cond.Wait()
				continue
			}
			if !c.running {
				break
			}
			// Every participant is blocked or waits for its turn, yet a
			// goroutine holds the turn: it is about to block, or it
			// belongs to no session (a request whose client left, a
			// second request of a session) and never will. After a grace
			// period in real time, take the turn from it.
			if held.IsZero() {
				held = time.Now()
				time.AfterFunc(strayGrace, func() {
					c.mu.Lock()
					defer c.mu.Unlock()
					c.cond.Broadcast()
				})
			} else if time.Since(held) >= strayGrace {
				c.pass()
				held = time.Time{}
				continue
			}
			c.cond.Wait()
		}
		c.running = false
		participants, blocked, timers := c.participants, c.blocked, len(c.timers)
		if participants <= 0 {
			c.passAll()
		}
		c.mu.Unlock()
		switch {
		case ctx.Err() != nil:
			c.mu.Lock()
			c.passAll()
			c.mu.Unlock()
			return ctx.Err()
		case participants <= 0:
			return nil
		case timers == 0:
			return fmt.Errorf("%w (%d blocked, %d participants)", ErrStalled, blocked, participants)
		}
		c.Fire()
	}
}

// passAll lets every woken goroutine go on; c.mu held.
func (c *EventClock) passAll() {
	for _, turn := range c.queue {
		close(turn)
	}
	c.queue = nil
	c.running = false
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// timer is a pending AfterFunc.
type timer struct {
	at    time.Time
	seq   uint64 // FIFO among timers due at the same time
	f     func()
	index int
	fired bool
}

type timerHeap []*timer

func (h timerHeap) Len() int { return len(h) }
func (h timerHeap) Less(i, j int) bool {
	if !h[i].at.Equal(h[j].at) {
		return h[i].at.Before(h[j].at)
	}
	return h[i].seq < h[j].seq
}
func (h timerHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}
func (h *timerHeap) Push(x any) {
	tm := x.(*timer)
	tm.index = len(*h)
	*h = append(*h, tm)
}
func (h *timerHeap) Pop() any {
	old := *h
	tm := old[len(old)-1]
	old[len(old)-1] = nil
	tm.index = -1
	*h = old[:len(old)-1]
	return tm
}

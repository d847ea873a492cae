package main

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// The router's release requests (kvroute's releaser.go) run in the
// background, outside any session, yet block in a prefill engine on the
// event clock like a session's request. Uncounted, the clock would take
// their blocking for a session's and move on while a session still runs;
// the run would no longer repeat. So a release is a participant of the
// clock from the moment it takes its handle from the Store (in the
// router's goroutine that the turn's retain started, before that turn's
// session blocks again) until its response has been read whole (the
// engine has then finished with it and handed the turn on to the
// release). The session requests carry a context mark; a Take without it
// is a release's.
//
// The releases start in a goroutine of their own, which the session does
// not wait for: after each turn the session settles, waiting (in real
// time, for at most settleWait) until every hold the ledger chose to
// release has been taken (budget.Stats.Released equals the releases'
// Takes) and no engine is over its budget, so that the clock cannot move
// on before the releases joined it.

// releaseUserAgent is the User-Agent of the router's release requests.
const releaseUserAgent = "bidikv-release"

type sessionMark struct{}

// markSession marks ctx as a session's.
func markSession(ctx context.Context) context.Context {
	return context.WithValue(ctx, sessionMark{}, true)
}

func isSession(ctx context.Context) bool { return ctx.Value(sessionMark{}) != nil }

// clockStore is the router's Store: it makes a release a participant
// when it takes its handle.
type clockStore struct {
	kvroute.Store
	clk    *kvroutetest.EventClock
	takes  *atomic.Int64 // the releases' Takes
	joined *atomic.Int64 // the releases that joined at their Take, not yet sent
}

// Take implements kvroute.Store.
func (s clockStore) Take(ctx context.Context, key string) ([]byte, bool, error) {
	v, ok, err := s.Store.Take(ctx, key)
	if !isSession(ctx) {
		if ok && err == nil {
			s.clk.Join()
			s.joined.Add(1)
		}
		s.takes.Add(1)
	}
	return v, ok, err
}

// Put implements kvroute.Store. A release's Put puts back what its Take
// found and is not its to release (a later hold under the key, which
// another replica sharing the Store retained): that release sends
// nothing, and leaves the clock here, in the goroutine that took it.
func (s clockStore) Put(ctx context.Context, key string, value []byte, ttl time.Duration) error {
	err := s.Store.Put(ctx, key, value, ttl)
	if !isSession(ctx) && s.joined.Add(-1) >= 0 {
		s.clk.Leave()
	} else if !isSession(ctx) {
		s.joined.Add(1)
	}
	return err
}

// settleWait bounds a session's wait for the releases its turn started.
const settleWait = time.Second

// settle waits until the releases the ledgers chose have all taken their
// handles and no engine is over budget; it reports false when it gave
// up after settleWait.
func (r *fleetRig) settle() bool {
	if len(r.ledgers) == 0 {
		return true
	}
	deadline := time.Now().Add(settleWait)
	for {
		now := r.clk.Now()
		ok := r.released() == r.takes.Load()
		for _, l := range r.ledgers {
			for _, e := range r.d {
				if held, b := l.Held(e.URL(), now); b > 0 && held > b {
					ok = false
				}
			}
		}
		if ok {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Microsecond)
	}
}

// taken waits, like settle, until every hold the ledger chose to release
// has been taken (the release joined the clock), without the budget
// check; false when it gave up after settleWait.
func (r *fleetRig) taken() bool {
	if len(r.ledgers) == 0 {
		return true
	}
	deadline := time.Now().Add(settleWait)
	for r.released() != r.takes.Load() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Microsecond)
	}
	return true
}

// released is the holds the ledgers chose to release: over the budget or
// to make room (Victims), and past their retention (Expired, which the
// routers' sweep calls every second of real time).
func (r *fleetRig) released() int64 {
	var n int64
	for _, l := range r.ledgers {
		s := l.Stats()
		n += s.Released + s.Overdue
	}
	return n
}

// clockTransport ends a release's participation once its response is
// read. A session's request waits until the releases already chosen have
// joined the clock: the router chooses the holds that make room for a
// decode leg before it sends the leg (kvroute's memory.go), and the
// release requests start in the background; without the wait, whether
// the engine sees the leg or the release first would depend on real time.
type clockTransport struct {
	base http.RoundTripper
	clk  *kvroutetest.EventClock
	rig  *fleetRig
}

// RoundTrip implements http.RoundTripper.
func (t clockTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Header.Get("User-Agent") != releaseUserAgent {
		if !t.rig.taken() {
			t.rig.unsettled.Add(1)
		}
		return t.base.RoundTrip(req)
	}
	// A release whose handle was taken joined the clock then; one of a
	// handle the router did not keep (kvroute's orphan.go) took nothing,
	// and joins now. Which of them is which does not matter: each release
	// joins once and leaves once.
	if t.rig.joined.Add(-1) < 0 {
		t.rig.joined.Add(1)
		t.clk.Join()
	}
	defer t.clk.Leave()
	if t.rig.diagnose && req.Body != nil {
		b, err := io.ReadAll(req.Body)
		req.Body.Close()
		if err != nil {
			return nil, err
		}
		req.Body = io.NopCloser(bytes.NewReader(b))
		t.rig.noteRelease(b, t.clk.Now())
	}
	resp, err := t.base.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return nil, err
	}
	resp.Body = io.NopCloser(bytes.NewReader(body))
	return resp, nil
}

package kvroutetest

import (
	"sync"

	"github.com/bidikv/bidikv/kvroute"
)

// Records is a kvroute.Observer and kvroute.EndpointObserver that keeps
// what the router reports: each turn's record, in the order the turns
// were observed, until Take returns it, and every endpoint event. A test
// reads the last turn (Last) or all of them (All); a harness that sets
// X-Request-Id on its requests takes back what the router did with each
// (Take), which also keeps the records of a long run from piling up. It is
// safe for concurrent use; the zero value is ready.
type Records struct {
	mu     sync.Mutex
	recs   []kvroute.TurnRecord
	events []kvroute.EndpointEvent
}

var (
	_ kvroute.Observer         = (*Records)(nil)
	_ kvroute.EndpointObserver = (*Records)(nil)
)

// ObserveTurn implements kvroute.Observer.
func (o *Records) ObserveTurn(rec *kvroute.TurnRecord) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.recs = append(o.recs, *rec)
}

// ObserveEndpoint implements kvroute.EndpointObserver.
func (o *Records) ObserveEndpoint(ev kvroute.EndpointEvent) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.events = append(o.events, ev)
}

// Take returns and forgets the last record of request id (and forgets any
// earlier one of the same id), false when no turn of that id was observed
// (or it was taken already).
func (o *Records) Take(id string) (kvroute.TurnRecord, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	var rec kvroute.TurnRecord
	found := false
	kept := o.recs[:0]
	for _, r := range o.recs {
		if r.RequestID == id {
			rec, found = r, true
			continue
		}
		kept = append(kept, r)
	}
	clear(o.recs[len(kept):]) // no record is held past its forgetting
	o.recs = kept
	return rec, found
}

// Last returns the record of the turn observed last (and not taken), the
// zero TurnRecord when there is none.
func (o *Records) Last() kvroute.TurnRecord {
	o.mu.Lock()
	defer o.mu.Unlock()
	if len(o.recs) == 0 {
		return kvroute.TurnRecord{}
	}
	return o.recs[len(o.recs)-1]
}

// All returns a copy of the records observed and not taken, in the order
// they were observed.
func (o *Records) All() []kvroute.TurnRecord {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]kvroute.TurnRecord(nil), o.recs...)
}

// Endpoints returns a copy of the endpoint events observed, in order.
func (o *Records) Endpoints() []kvroute.EndpointEvent {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]kvroute.EndpointEvent(nil), o.events...)
}

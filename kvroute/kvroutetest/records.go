package kvroutetest

import (
	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/internal/observed"
)

// Records is a kvroute.Observer and kvroute.EndpointObserver that keeps
// what the router reports: each turn's record, in the order the turns
// were observed, until Take returns it, and every endpoint event. A test
// reads the last turn (Last) or all of them (All); a harness that sets
// X-Request-Id on its requests takes back what the router did with each
// (Take), which also keeps the records of a long run from piling up. It is
// safe for concurrent use; the zero value is ready.
type Records struct {
	turns  observed.Log[kvroute.TurnRecord]
	events observed.Log[kvroute.EndpointEvent]
}

var (
	_ kvroute.Observer         = (*Records)(nil)
	_ kvroute.EndpointObserver = (*Records)(nil)
)

// ObserveTurn implements kvroute.Observer.
func (o *Records) ObserveTurn(rec *kvroute.TurnRecord) { o.turns.Add(rec) }

// ObserveEndpoint implements kvroute.EndpointObserver.
func (o *Records) ObserveEndpoint(ev kvroute.EndpointEvent) { o.events.Add(&ev) }

// Take returns and forgets the last record of request id (and forgets any
// earlier one of the same id), false when no turn of that id was observed
// (or it was taken already).
func (o *Records) Take(id string) (kvroute.TurnRecord, bool) {
	return o.turns.Take(func(rec *kvroute.TurnRecord) bool { return rec.RequestID == id })
}

// Last returns the record of the turn observed last (and not taken), the
// zero TurnRecord when there is none.
func (o *Records) Last() kvroute.TurnRecord { return o.turns.Last() }

// All returns a copy of the records observed and not taken, in the order
// they were observed.
func (o *Records) All() []kvroute.TurnRecord { return o.turns.All() }

// Endpoints returns a copy of the endpoint events observed, in order.
func (o *Records) Endpoints() []kvroute.EndpointEvent { return o.events.All() }

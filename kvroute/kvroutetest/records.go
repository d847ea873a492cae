package kvroutetest

import (
	"sync"

	"github.com/bidikv/bidikv/kvroute"
)

// Records is a kvroute.Observer that keeps each turn's record by its
// request id until Take returns it: a harness that sets X-Request-Id on
// its requests reads back what the router did with each. It is safe for
// concurrent use; the zero value is ready.
type Records struct {
	mu   sync.Mutex
	recs map[string]kvroute.TurnRecord
}

// ObserveTurn implements kvroute.Observer.
func (o *Records) ObserveTurn(rec *kvroute.TurnRecord) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.recs == nil {
		o.recs = map[string]kvroute.TurnRecord{}
	}
	o.recs[rec.RequestID] = *rec
}

// Take returns and forgets the record of request id, false when no turn
// of that id was observed (or it was taken already).
func (o *Records) Take(id string) (kvroute.TurnRecord, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	rec, ok := o.recs[id]
	delete(o.recs, id)
	return rec, ok
}

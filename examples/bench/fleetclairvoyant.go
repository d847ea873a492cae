package main

import (
	"fmt"
	"sync"
	"time"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/retention/budget"
)

// The clairvoyant bound (--clairvoyant). The managed arm's ledger ranks
// holds by what the plan knows and no router can: when each
// conversation's next turn comes (budget.WithValue). A hold whose next
// turn comes before it expires is worth 1/(seconds until then + 1) per
// block, others nothing: the holds released first are those used last or
// never, as Belady's rule for caches. It is an upper bound on what any
// choice of victims reaches with the same budget, capacity and room on
// arrival, to judge the gap model's choices against.

// clairvoyant knows each retained key's session and each session's next
// pause: the plan's, once the turn's reply says whether it called the
// tool (the pause after a tool call is the tool's, else a person's).
type clairvoyant struct {
	plan  []sessionPlan
	keys  sync.Map // store key → session id, as the router retained it
	pause sync.Map // session id → the pause after its current turn; absent: no next turn
}

// turn records, as turn t of session id is retained, the pause after it
// (none when the session ends with it).
func (cv *clairvoyant) turn(id, t int, called bool) {
	turns := cv.plan[id].turns
	if t >= len(turns)-1 {
		cv.pause.Delete(id)
		return
	}
	cv.pause.Store(id, turns[t].pause(called))
}

// value is the budget.ValueFunc.
func (cv *clairvoyant) value(h budget.Held, waited time.Duration, _ float64) float64 {
	id, ok := cv.keys.Load(h.Key)
	if !ok {
		return 0
	}
	p, ok := cv.pause.Load(id)
	if !ok {
		return 0
	}
	pause := p.(time.Duration)
	next := h.Created.Add(pause)
	if next.After(h.Expires) {
		return 0
	}
	return 1 / (max(pause-waited, 0).Seconds() + 1)
}

// keyRecorder is the router's Identifier (the default one) noting which
// session each retained key belongs to, from the turn's X-Request-Id
// (s<session>-t<turn>), and the pause after the turn (the reply's tool
// calls decide it) before the handle is retained.
type keyRecorder struct {
	kvroute.Identifier
	cv *clairvoyant
}

func (k keyRecorder) Key(req *kvroute.Request, c kvroute.Candidates, reply *kvroute.Reply) (kvroute.Retention, error) {
	ret, err := k.Identifier.Key(req, c, reply)
	var id, turn int
	if ret.Key != "" {
		if _, serr := fmt.Sscanf(req.Header.Get("X-Request-Id"), "s%d-t%d", &id, &turn); serr == nil && id < len(k.cv.plan) {
			k.cv.turn(id, turn, reply != nil && (len(reply.ToolCalls) > 2 || reply.FinishReason == "tool_calls"))
			k.cv.keys.Store(ret.Key, id)
		}
	}
	return ret, err
}

package kvroute

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"time"
)

// turn is what the phases of one Do call share: the request, the ids the
// client and the engines see, the record they report into (which only
// the turn's end reads: the observer path), the trace, how engine
// requests are built, the pooled buffers the turn owns and its
// verification. Phases hand each other results (found, hit, way, ...),
// never fields of the turn; the retainer Do owns ends it once (do.go).
type turn struct {
	r      *Router
	req    *Request
	id     string // the request id the client sees: its own, or a generated one
	start  time.Time
	stream bool // the client streams
	rec    TurnRecord
	legs   legs
	trace  turnTrace
	bufs   turnBufs
	proof  proof // the turn's verification (verify.go)
	// sampling is the decode engine whose streams of the API this turn's
	// stream shows (buffered.go), released when the turn ends.
	sampling string
	// roomMade: a decode leg of the turn had room made on its engine
	// (memory.go, arrive): its other legs make none.
	roomMade bool
	// values is Do's context without its cancellation: the Store calls
	// that retain the turn's handle carry its values (a trace, a
	// caller's marks) but are not lost when the client goes, and may run
	// after the turn (a render answered late).
	values context.Context
}

// begin starts a turn for req: its ids, its record, its buffers and its
// verification. A client's X-Request-Id is echoed and, made unique, sent to
// the engines; absent or invalid, the router generates one.
func (r *Router) begin(req *Request) *turn {
	t := &turn{r: r, req: req, start: r.cfg.clock(), values: context.Background()}
	if req.Header == nil {
		req.Header = http.Header{}
	}
	t.id = req.Header.Get(headerRequestID)
	legID := t.id
	switch {
	case !validRequestID(t.id):
		// Absent, too long or not visible ASCII: never echoed, forwarded
		// or logged.
		t.id = newRequestID()
		legID = t.id
	default:
		// The client's id, made unique for the engines: two clients that
		// chose the same id never share one on an engine.
		legID = engineRequestID(t.id)
	}
	t.rec.RequestID = t.id
	t.rec.EngineRequestID = legID
	t.rec.Path = req.Path
	t.rec.CachedTokens = -1
	// Reuse stays "" until the lookup: a turn that fails before it is no
	// reuse miss.
	t.trace.tr = r.cfg.tracer
	t.legs = legs{req: req, id: legID, apiKey: r.cfg.apiKey, trace: &t.trace}
	t.bufs.b = &r.bufs
	t.proof = r.verification(t)
	return t
}

// maxRequestIDBytes bounds a client's X-Request-Id. An id that is longer,
// empty, or holds anything but visible ASCII (0x21 to 0x7e) is ignored: the
// router generates its own for both legs, the response and the TurnRecord.
const maxRequestIDBytes = 128

func validRequestID(id string) bool {
	if id == "" || len(id) > maxRequestIDBytes {
		return false
	}
	for i := 0; i < len(id); i++ {
		if id[i] < 0x21 || id[i] > 0x7e {
			return false
		}
	}
	return true
}

func newRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return "bidikv-" + hex.EncodeToString(b[:])
}

// engineRequestID is the id a turn's legs carry for a client's id: the
// client's, for correlation, and 64 random bits.
func engineRequestID(client string) string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return client + "-" + hex.EncodeToString(b[:])
}

func (t *turn) since() time.Duration { return t.r.cfg.clock().Sub(t.start) }

// miss records that the turn reuses no handle, and why.
func (t *turn) miss(reason MissReason) {
	t.rec.Reuse = ReuseMiss
	t.rec.MissReason = reason
}

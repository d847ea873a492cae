package capture

import (
	"bytes"
	"errors"
	"fmt"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/sse"
)

// NewTyped returns the capture of one stream of an API whose events are
// named: the handle may sit in the member nested (besides the top level),
// the stream ends with one of the final event types, and reply reads the
// reply from a final event's data (nil: none is read).
func NewTyped(nested string, final map[string]bool, reply func([]byte) *Reply) *Typed {
	return &Typed{nested: nested, final: final, reply: reply}
}

// Typed is the capture of APIs whose events are named and carry a
// JSON object with a "type" (Responses, Messages): the handle may sit at
// the top level of an event or inside one object member (nested), and the
// stream ends with one of the final event types (no data: [DONE]).
type Typed struct {
	nested string              // member that may hold the handle, "" for none
	final  map[string]bool     // event types that end the stream
	reply  func([]byte) *Reply // reads the reply from a final event's data

	handle []byte
	rep    *Reply
	done   bool
	out    []byte
	seq    int64 // the last sequence_number seen, valid with hasSeq
	hasSeq bool
}

// Done reports whether a final event was seen.
func (s *Typed) Done() bool { return s.done }

// Handle returns the decode handle seen, nil when none.
func (s *Typed) Handle() []byte { return s.handle }

// HandleBlocks returns the zero Known: the handle is checked in full.
func (s *Typed) HandleBlocks() jsonraw.Known { return jsonraw.Known{} }

// IDs returns no token ids: these APIs' engines send none.
func (s *Typed) IDs() ([]uint32, []uint32, bool) { return nil, nil, false }

// Usage returns nil: the typed APIs report usage in their own shape
// (input_tokens), which no caller reads.
func (s *Typed) Usage() []byte { return nil }

// Reply returns the reply read from the final event.
func (s *Typed) Reply() *Reply {
	if s.rep == nil {
		return &Reply{Incomplete: true}
	}
	return s.rep
}

// Forward returns ev as it may reach the client, through
// sse.ScrubEvent, taking the handle and the reply on the way.
func (s *Typed) Forward(ev sse.Event) ([]byte, error) {
	if ev.Incomplete {
		return nil, nil // never dispatched by a client: never forwarded
	}
	var seq int64
	hasSeq := false
	if ev.HasData && len(ev.Data) > 0 && string(ev.Data) != "[DONE]" {
		obj, err := jsonraw.Parse(ev.Data)
		switch {
		case err == nil:
			s.observe(obj, ev)
			s.takeHandle(obj)
			if v, ok := obj.Get("sequence_number"); ok {
				seq, hasSeq = jsonraw.Int(v)
			}
		case !errors.Is(err, jsonraw.ErrNotObject):
			return nil, fmt.Errorf("%w: %w", sse.ErrMalformedData, err)
		}
	}
	// The one mechanism: every kv_transfer_params removed at any depth,
	// members only handles have anywhere else refused, and of the lines
	// outside the data only what a client reads.
	out, rewritten, err := sse.ScrubEvent(s.out[:0], ev, ev.Data, false)
	if err != nil {
		return nil, err
	}
	if rewritten {
		s.out = out
	}
	if hasSeq {
		s.seq, s.hasSeq = seq, true // numbered: the last event forwarded
	}
	return out, nil
}

// Sequence returns the sequence_number of the last event forwarded
// (Responses events carry one), and whether one was.
func (s *Typed) Sequence() (int64, bool) { return s.seq, s.hasSeq }

// observe notes a final event and reads the reply from it.
func (s *Typed) observe(obj jsonraw.Object, ev sse.Event) {
	typ := ""
	if v, ok := obj.Get("type"); ok {
		typ, _ = jsonraw.String(v)
	}
	if s.final[typ] || s.final[ev.Name] {
		s.done = true
		if s.reply != nil {
			s.rep = s.reply(ev.Data)
		}
	}
}

// takeHandle keeps the handle wherever this API may put it: the top level,
// or the nested object (the last non-null one wins). ScrubEvent removes
// it, with every other kv_transfer_params.
func (s *Typed) takeHandle(obj jsonraw.Object) {
	if h, ok := obj.Get(sse.HandleKey); ok && !jsonraw.IsNull(h) {
		s.handle = bytes.Clone(h)
	}
	if s.nested == "" {
		return
	}
	if inner, ok := obj.Get(s.nested); ok && len(inner) > 0 && inner[0] == '{' {
		if h, ok := jsonraw.Lookup(inner, sse.HandleKey); ok && !jsonraw.IsNull(h) {
			s.handle = bytes.Clone(h)
		}
	}
}

package kvroute

import (
	"bytes"
	"errors"
	"fmt"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/sse"
)

// streamCapture inspects a decode stream's events on their way to the
// caller: it removes every kv_transfer_params (and the token ids the
// router asked for), keeps the decode handle, and reassembles the reply.
// Each API's seam makes its own (api.newStream).
type streamCapture interface {
	// Forward returns the bytes to send in place of ev, or an error when
	// ev may hold a handle that cannot be removed safely.
	Forward(ev sse.Event) ([]byte, error)
	// Done reports whether the stream's final event was seen.
	Done() bool
	// Handle returns the decode handle seen, nil when none.
	Handle() []byte
	// Reply returns the reply reassembled so far.
	Reply() *Reply
	// TokenIDs returns the prompt's and the generated token ids, ok when
	// the engine sent both.
	TokenIDs() (prompt, generated []uint32, ok bool)
}

// openAIStream is the capture of chat and completions streams.
type openAIStream struct{ c *sse.Capture }

func newOpenAIStream(tokens, strip bool) streamCapture {
	opts := []sse.CaptureOption{sse.WithReply()}
	if tokens {
		opts = append(opts, sse.WithTokenIDs(strip))
	}
	return openAIStream{c: sse.NewCapture(opts...)}
}

// useIDBuffer gives the capture a slice for the prompt's token ids.
func (s openAIStream) useIDBuffer(buf []uint32) { s.c.UseIDBuffer(buf) }

// useHandleBuffer gives the capture a buffer for D's handle.
func (s openAIStream) useHandleBuffer(buf []byte) { s.c.UseHandleBuffer(buf) }

// releaseHandleBuffer takes the handle's buffer back.
func (s openAIStream) releaseHandleBuffer() []byte { return s.c.ReleaseHandleBuffer() }

// expectPromptIDs gives the capture the rendered prompt ids and their text
// (sse.Capture.ExpectPromptIDs).
func (s openAIStream) expectPromptIDs(raw []byte, ids []uint32) { s.c.ExpectPromptIDs(raw, ids) }

func (s openAIStream) Forward(ev sse.Event) ([]byte, error) { return s.c.Forward(ev) }
func (s openAIStream) Done() bool                           { return s.c.Done() }
func (s openAIStream) Handle() []byte                       { return s.c.Handle() }

func (s openAIStream) Reply() *Reply {
	r := s.c.Reply()
	return &r
}

func (s openAIStream) TokenIDs() ([]uint32, []uint32, bool) {
	return s.c.PromptTokenIDs(), s.c.TokenIDs(), s.c.HasTokenIDs()
}

// typedStream is the capture of APIs whose events are named and carry a
// JSON object with a "type" (Responses, Messages): the handle may sit at
// the top level of an event or inside one object member (nested), and the
// stream ends with one of the final event types (no data: [DONE]).
type typedStream struct {
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

func (s *typedStream) Done() bool                           { return s.done }
func (s *typedStream) Handle() []byte                       { return s.handle }
func (s *typedStream) TokenIDs() ([]uint32, []uint32, bool) { return nil, nil, false }

func (s *typedStream) Reply() *Reply {
	if s.rep == nil {
		return &Reply{Incomplete: true}
	}
	return s.rep
}

func (s *typedStream) Forward(ev sse.Event) ([]byte, error) {
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

// sequence returns the sequence_number of the last event forwarded
// (Responses events carry one), and whether one was.
func (s *typedStream) sequence() (int64, bool) { return s.seq, s.hasSeq }

// observe notes a final event and reads the reply from it.
func (s *typedStream) observe(obj jsonraw.Object, ev sse.Event) {
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
func (s *typedStream) takeHandle(obj jsonraw.Object) {
	if h, ok := obj.Get(kvKey); ok && !jsonraw.IsNull(h) {
		s.handle = bytes.Clone(h)
	}
	if s.nested == "" {
		return
	}
	if inner, ok := obj.Get(s.nested); ok && len(inner) > 0 && inner[0] == '{' {
		if h, ok := jsonraw.Lookup(inner, kvKey); ok && !jsonraw.IsNull(h) {
			s.handle = bytes.Clone(h)
		}
	}
}

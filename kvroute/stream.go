package kvroute

import (
	"bytes"

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

func (s openAIStream) Forward(ev sse.Event) ([]byte, error) { return s.c.Forward(ev) }
func (s openAIStream) Done() bool                           { return s.c.Done() }
func (s openAIStream) Handle() []byte                       { return s.c.Handle() }

func (s openAIStream) Reply() *Reply {
	sr := s.c.Reply()
	return &Reply{
		Content:      sr.Content,
		ToolCalls:    sr.ToolCalls,
		Reasoning:    sr.Reasoning,
		FinishReason: sr.FinishReason,
		StopReason:   s.c.StopReason(),
		Incomplete:   sr.Incomplete,
	}
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

// mayHold is the cheap test for a kv_transfer_params key, literal or
// escaped, or a member only handles have.
func mayHold(b []byte) bool {
	return bytes.Contains(b, []byte(kvKey)) || bytes.Contains(b, []byte(`\u`)) ||
		bytes.Contains(b, []byte("remote_block_ids")) || bytes.Contains(b, []byte("remote_engine_id"))
}

func (s *typedStream) Forward(ev sse.Event) ([]byte, error) {
	if !ev.HasData {
		if mayHold(ev.Raw) {
			return nil, nil // a comment that names the key: dropped
		}
		return ev.Raw, nil
	}
	d := ev.Data
	obj, err := jsonraw.Parse(d)
	if err != nil {
		if mayHold(d) {
			return nil, sse.ErrMalformedData
		}
		return ev.Raw, nil
	}
	typ := ""
	if v, ok := obj.Get("type"); ok {
		typ, _ = jsonraw.String(v)
	}
	if s.final[typ] || s.final[ev.Name] {
		s.done = true
		if s.reply != nil {
			s.rep = s.reply(d)
		}
	}
	if !mayHold(ev.Raw) {
		return ev.Raw, nil
	}
	// Take and remove the handle wherever this API may put it.
	var set []jsonraw.Member
	if h, ok := obj.Get(kvKey); ok && !jsonraw.IsNull(h) {
		s.handle = bytes.Clone(h)
	}
	if s.nested != "" {
		if inner, ok := obj.Get(s.nested); ok && len(inner) > 0 && inner[0] == '{' {
			if io, err := jsonraw.Parse(inner); err == nil && io.Has(kvKey) {
				if h, _ := io.Get(kvKey); !jsonraw.IsNull(h) {
					s.handle = bytes.Clone(h)
				}
				set = append(set, jsonraw.Member{Key: s.nested, Value: io.Edit([]string{kvKey})})
			}
		}
	}
	data := obj.Edit([]string{kvKey}, set...)
	if sse.HasHandleKey(data) {
		return nil, sse.ErrMalformedData // a handle where this API puts none
	}
	key := []byte(kvKey)
	if len(data) == len(d) && bytes.Count(ev.Raw, key) == bytes.Count(d, key) && !otherLinesName(ev.Raw, d) {
		// Nothing removed and no other line names the key: the word sits
		// in content (a model may write it), which is the client's.
		return ev.Raw, nil
	}
	// Re-frame as event + one data line: any other line that named the key
	// is dropped with it.
	s.out = s.out[:0]
	if ev.Name != "" {
		s.out = append(s.out, "event: "...)
		s.out = append(s.out, ev.Name...)
		s.out = append(s.out, '\n')
	}
	s.out = append(s.out, "data: "...)
	for _, c := range data {
		if c == '\n' || c == '\r' {
			c = ' '
		}
		s.out = append(s.out, c)
	}
	s.out = append(s.out, "\n\n"...)
	return s.out, nil
}

// otherLinesName reports whether raw holds handle member names outside its
// data (in a comment, id or event line).
func otherLinesName(raw, data []byte) bool {
	for _, m := range [...]string{"remote_block_ids", "remote_engine_id"} {
		if bytes.Count(raw, []byte(m)) > bytes.Count(data, []byte(m)) {
			return true
		}
	}
	return false
}

package capture

import (
	"bytes"
	"errors"
	"fmt"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/kvhandle"
	"github.com/bidikv/bidikv/sse"
)

// Option configures a Chunks.
type Option interface {
	apply(*Chunks)
}

type optionFunc func(*Chunks)

func (f optionFunc) apply(c *Chunks) { f(c) }

// WithReply makes the Chunks reassemble the reply of choice 0 (content,
// reasoning and tool calls of chat chunks, text of completions chunks) for
// Chunks.Reply. It is off by default, which keeps Forward free of
// allocations for events that carry no handle.
func WithReply() Option {
	return optionFunc(func(c *Chunks) { c.reply = true })
}

// Chunks inspects the events of a vLLM /v1/chat/completions or
// /v1/completions stream on their way to the client. For each event,
// Forward returns the bytes to forward, with every kv_transfer_params
// member removed at any depth (ScrubEvent, see Forward); the Chunks keeps
// the last non-null value of the top-level member, and records the finish
// reason of choice 0, the usage and whether the "[DONE]" event was seen.
//
// A Chunks serves one stream and is not safe for concurrent use.
type Chunks struct {
	reply bool

	obj    jsonraw.Object
	out    []byte
	handle []byte
	// handleBlocks is where handle's block list is, when the parse of its
	// event read it.
	handleBlocks jsonraw.Known
	usage        []byte
	finish       string
	stop         []byte
	done         bool

	asm assembler

	tokens, stripTokens     bool
	strip                   stripScratch
	promptIDs, genIDs       []uint32
	sawPromptIDs, sawGenIDs bool
	badIDs                  bool
	// knownRaw and knownIDs (ExpectPromptIDs): the prompt's ids the
	// caller already has and their JSON text, until the first data event;
	// knownUsed records that the stream's prompt ids were taken as them,
	// and spare keeps the Chunks's own slice meanwhile.
	knownRaw  []byte
	knownIDs  []uint32
	knownUsed bool
	spare     []uint32
	// handleBuf (UseHandleBuffer) is where the handle is copied, when
	// useHandleBuf is set.
	handleBuf    []byte
	useHandleBuf bool
}

// NewChunks returns a Chunks for one stream.
func NewChunks(opts ...Option) *Chunks {
	c := &Chunks{}
	for _, o := range opts {
		o.apply(c)
	}
	return c
}

// Forward inspects e and returns the bytes to send to the client in its
// place, through ScrubEvent: every kv_transfer_params member removed at
// any depth (only a top-level one is taken as the engine's handle), and
// of the lines outside the data only what a client reads and cannot hold
// a handle. An event that needs no change is returned as it is: the
// result is e.Raw itself, and no memory is allocated. Otherwise the result
// is owned by the Chunks and valid until the next call to Forward.
//
// Forward returns ErrMalformedData, and no bytes, when e's data is neither
// JSON nor "[DONE]" (or empty), or holds a member only handles have
// outside kv_transfer_params: such an event must not be forwarded, and
// the stream must end. An Incomplete event (the stream ended inside it) is
// neither inspected nor forwarded: Forward returns no bytes and no error.
func (c *Chunks) Forward(e sse.Event) ([]byte, error) {
	if e.Incomplete {
		return nil, nil
	}
	d := e.Data
	done := e.HasData && string(d) == "[DONE]"
	data, edited := d, false
	if e.HasData && !done && len(d) > 0 {
		strip := c.stripTokens && mayHoldTokenIDs(d)
		// Every event's data is validated and indexed once, and then
		// inspected from its index (D's first chunk in token mode: the
		// prompt's ids are converted in the same pass).
		var perr error
		var blocks jsonraw.Known
		idMember := -1
		var ids []uint32
		if c.tokens && !c.sawPromptIDs {
			// The first chunk's prompt ids (chat: a top-level member) are
			// converted in the same pass that validates them, or, when
			// their text is the one the caller expects, not read at all.
			var same bool
			ids, idMember, same, perr = c.obj.ResetIDsKnown(d, PromptTokenIDsKey, c.promptIDs, c.knownRaw)
			switch {
			case same:
				c.takeKnown()
				ids = c.knownIDs
			case idMember < 0:
				c.promptIDs = ids[:0] // scratch; kept for its room
			}
		} else {
			// A handle's block list is read in the pass that validates.
			blocks, perr = kvhandle.ResetAnswer(&c.obj, d)
		}
		switch {
		case perr == nil:
			for i := range c.obj.Len() {
				if i == idMember {
					c.promptIDsParsed(ids)
					continue
				}
				c.inspectMember(c.obj.Member(i))
			}
			if v, ok := c.obj.Get(sse.HandleKey); ok && !jsonraw.IsNull(v) {
				c.handleBlocks = blocks
				if c.useHandleBuf {
					c.handleBuf = append(c.handleBuf[:0], v...)
					c.handle = c.handleBuf
				} else {
					c.handle = bytes.Clone(v)
				}
			}
			if strip {
				data = c.strip.strip(c.obj, false)
				edited = len(data) != len(d)
			}
		case !errors.Is(perr, jsonraw.ErrNotObject):
			return nil, fmt.Errorf("%w: %w", sse.ErrMalformedData, perr)
		}
	}
	if e.HasData {
		// The caller's text is compared with the first data only.
		c.knownRaw, c.knownIDs = nil, nil
	}
	if done {
		c.done = true
	}
	out, rewritten, err := sse.ScrubValidEvent(c.out[:0], e, data, edited)
	if err != nil {
		return nil, err
	}
	if rewritten {
		c.out = out
	}
	return out, nil
}

// Handle returns a copy of the last non-null kv_transfer_params value seen,
// as raw JSON, or nil. With UseHandleBuffer, the copy is in the Chunks's
// buffer: valid until the next Forward that sees a handle, or until
// ReleaseHandleBuffer.
func (c *Chunks) Handle() []byte { return c.handle }

// HandleBlocks returns where Handle's block list is, when the parse of the
// event that carried it read it (kvhandle.ResetAnswer), else the zero
// Known.
func (c *Chunks) HandleBlocks() jsonraw.Known {
	if c.handle == nil {
		return jsonraw.Known{}
	}
	return c.handleBlocks
}

// UseHandleBuffer makes the Chunks copy each handle it sees into buf
// (from buf[:0], into a larger slice when it does not fit) rather than into
// a new slice, so that a caller can reuse one buffer across streams. Take
// the buffer back with ReleaseHandleBuffer.
func (c *Chunks) UseHandleBuffer(buf []byte) {
	c.handleBuf, c.useHandleBuf = buf[:0], true
}

// ReleaseHandleBuffer returns the buffer given to UseHandleBuffer, or the
// larger one the Chunks moved to, and stops using it: Handle returns nil
// until another handle is seen, and later handles are copied into new
// slices. It returns nil without UseHandleBuffer.
func (c *Chunks) ReleaseHandleBuffer() []byte {
	b := c.handleBuf
	if c.useHandleBuf && c.handle != nil {
		c.handle = nil // it aliases b
	}
	c.handleBuf, c.useHandleBuf = nil, false
	return b
}

// FinishReason returns the last non-null finish_reason of choice 0, or "".
func (c *Chunks) FinishReason() string { return c.finish }

// Done reports whether the "data: [DONE]" event was seen.
func (c *Chunks) Done() bool { return c.done }

// Usage returns the raw JSON of the last non-null top-level usage member
// seen, or nil. The slice is owned by the Chunks and valid until the next
// call to Forward.
func (c *Chunks) Usage() []byte { return c.usage }

// inspectMember records the finish reason, usage, reply fragments and
// token ids of one top-level member of a chunk.
func (c *Chunks) inspectMember(key string, v []byte) {
	switch key {
	case "choices":
		c.choices(v)
	case "usage":
		if !jsonraw.IsNull(v) {
			c.usage = append(c.usage[:0], v...)
		}
	case PromptTokenIDsKey:
		if c.tokens {
			c.addPromptIDs(v)
		}
	}
}

// choices handles the choice with index 0 (or, without an index, the first).
func (c *Chunks) choices(arr []byte) {
	pos := 0
	_ = jsonraw.Elements(arr, func(choice []byte) error {
		var index, delta, text, finish, stop, promptIDs, genIDs []byte
		_ = jsonraw.Members(choice, func(key string, v []byte) error {
			switch key {
			case PromptTokenIDsKey:
				promptIDs = v
			case TokenIDsKey:
				genIDs = v
			case "index":
				index = v
			case "delta":
				delta = v
			case "text":
				text = v
			case "finish_reason":
				finish = v
			case "stop_reason":
				stop = v
			}
			return nil
		})
		first := pos == 0
		pos++
		if index != nil {
			if n, ok := jsonraw.Int(index); !ok || n != 0 {
				return nil
			}
		} else if !first {
			return nil
		}
		if finish != nil && !jsonraw.IsNull(finish) {
			c.finish = finishReason(finish)
			c.stop = append(c.stop[:0], stop...)
			if stop == nil {
				c.stop = nil
			}
		}
		if c.reply {
			c.asm.add(delta, text)
		}
		if c.tokens {
			if promptIDs != nil {
				c.addPromptIDs(promptIDs)
			}
			if genIDs != nil {
				c.addGenIDs(genIDs)
			}
		}
		return nil
	})
}

// finishReason decodes a finish_reason without allocating for the values
// vLLM uses.
func finishReason(v []byte) string {
	switch string(v) {
	case `"stop"`:
		return "stop"
	case `"length"`:
		return "length"
	case `"tool_calls"`:
		return "tool_calls"
	case `"abort"`:
		return "abort"
	case `"error"`:
		return "error"
	}
	s, _ := jsonraw.String(v)
	return s
}

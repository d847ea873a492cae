package capture

import (
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
	return optionFunc(func(c *Chunks) { c.reply.fragments = true })
}

// WithTokenIDs makes the Chunks collect the token ids of choice 0: the
// prompt's (prompt_token_ids, top level or in the choice) and the generated
// ones (the choice's token_ids, concatenated over the stream's chunks), for
// Chunks.IDs. With strip, Forward also removes those members from every
// event, so that a client that did not ask for token ids never sees them.
func WithTokenIDs(strip bool) Option {
	return optionFunc(func(c *Chunks) { c.ids.on, c.stripIDs = true, strip })
}

// Chunks inspects the events of a vLLM /v1/chat/completions or
// /v1/completions stream on their way to the client. For each event,
// Forward returns the bytes to forward, with every kv_transfer_params
// member removed at any depth (ScrubEvent, see Forward), and hands what
// it reads to the collectors it holds: the decode handle (the last
// non-null top-level kv_transfer_params), choice 0's reply, finish and
// stop reasons, and its token ids. The Chunks itself owns the event's
// parse and output buffers, the last usage member and whether the
// "[DONE]" event was seen.
//
// A Chunks serves one stream and is not safe for concurrent use.
type Chunks struct {
	obj   jsonraw.Object
	out   []byte
	usage []byte
	done  bool

	handle   handleCopy
	reply    assembler
	ids      tokenIDs
	stripIDs bool // WithTokenIDs(true): token ids removed from every event
	strip    stripScratch
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
		strip := c.stripIDs && mayHoldTokenIDs(d)
		// Every event's data is validated and indexed once, and then
		// inspected from its index (D's first chunk in token mode: the
		// prompt's ids are converted in the same pass).
		var perr error
		var blocks jsonraw.Known
		idMember := -1
		var ids []uint32
		if c.ids.on && !c.ids.sawPrompt {
			// The first chunk's prompt ids (chat: a top-level member) are
			// converted in the same pass that validates them, or, when
			// their text is the one the caller expects, not read at all.
			ids, idMember, perr = c.ids.reset(&c.obj, d)
		} else {
			// A handle's block list is read in the pass that validates.
			blocks, perr = kvhandle.ResetAnswer(&c.obj, d)
		}
		switch {
		case perr == nil:
			for i := range c.obj.Len() {
				if i == idMember {
					c.ids.parsed(ids)
					continue
				}
				c.inspectMember(c.obj.Member(i))
			}
			if v, ok := c.obj.Get(sse.HandleKey); ok && !jsonraw.IsNull(v) {
				c.handle.take(v, blocks)
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
		c.ids.dataSeen()
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

// Done reports whether the "data: [DONE]" event was seen.
func (c *Chunks) Done() bool { return c.done }

// Usage returns the raw JSON of the last non-null top-level usage member
// seen, or nil. The slice is owned by the Chunks and valid until the next
// call to Forward.
func (c *Chunks) Usage() []byte { return c.usage }

// Handle returns a copy of the last non-null kv_transfer_params value seen,
// as raw JSON, or nil. With UseHandleBuffer, the copy is in the Chunks's
// buffer: valid until the next Forward that sees a handle, or until
// ReleaseHandleBuffer.
func (c *Chunks) Handle() []byte { return c.handle.bytes() }

// HandleBlocks returns where Handle's block list is, when the parse of the
// event that carried it read it (kvhandle.ResetAnswer), else the zero
// Known.
func (c *Chunks) HandleBlocks() jsonraw.Known { return c.handle.blockList() }

// UseHandleBuffer makes the Chunks copy each handle it sees into buf
// (from buf[:0], into a larger slice when it does not fit) rather than into
// a new slice, so that a caller can reuse one buffer across streams. Take
// the buffer back with ReleaseHandleBuffer.
func (c *Chunks) UseHandleBuffer(buf []byte) { c.handle.use(buf) }

// ReleaseHandleBuffer returns the buffer given to UseHandleBuffer, or the
// larger one the Chunks moved to, and stops using it: Handle returns nil
// until another handle is seen, and later handles are copied into new
// slices. It returns nil without UseHandleBuffer.
func (c *Chunks) ReleaseHandleBuffer() []byte { return c.handle.release() }

// Reply returns the reply reassembled so far. Content, Reasoning and
// ToolCalls stay empty unless the Chunks was made WithReply; FinishReason
// (the last non-null finish_reason of choice 0) and StopReason are always
// kept.
func (c *Chunks) Reply() *Reply { return c.reply.reply() }

// IDs returns choice 0's token ids seen so far, collected by a Chunks made
// WithTokenIDs: the prompt's (nil when the engine sent none), the generated
// ones in order, and ok when the engine sent both and both could be read.
func (c *Chunks) IDs() (prompt, generated []uint32, ok bool) { return c.ids.ids() }

// UseIDBuffer makes the Chunks parse the prompt's token ids into buf
// (from buf[:0]; a larger slice is allocated when they do not fit), so a
// caller can reuse one slice across streams; IDs then returns buf's array.
// It has no effect once the prompt's ids were seen.
func (c *Chunks) UseIDBuffer(buf []uint32) { c.ids.useBuffer(buf) }

// ExpectPromptIDs gives the Chunks the prompt's token ids the caller
// already has (ids) with the JSON text they were converted from (raw: an
// array of ids as a render answer spells it, from '[' to ']', which the
// caller has validated and converted to ids in full, for example with
// AppendTokenIDs). When the stream's first data event carries a
// prompt_token_ids (top level, or in choice 0) whose value is byte for
// byte raw, the value is not read again: IDs then returns ids itself as
// the prompt's, not a copy, and PromptIDsExpected reports it. Any other
// value (one id or one space different) is parsed as without this call.
// The Chunks keeps raw and ids only until that first data event: the
// caller must leave raw unchanged until Forward has returned for an event
// with data (or the Chunks is no longer used), and ids unchanged while it
// uses IDs. It has no effect once the prompt's ids were seen, without
// WithTokenIDs, or for no ids.
func (c *Chunks) ExpectPromptIDs(raw []byte, ids []uint32) { c.ids.expect(raw, ids) }

// PromptIDsExpected reports whether the prompt's token ids were those given
// to ExpectPromptIDs, taken without being parsed.
func (c *Chunks) PromptIDsExpected() bool { return c.ids.expected() }

// inspectMember hands one top-level member of a chunk to its collector:
// the finish reason, reply fragments and token ids of choice 0, the usage,
// the prompt's token ids.
func (c *Chunks) inspectMember(key string, v []byte) {
	switch key {
	case "choices":
		c.choices(v)
	case "usage":
		if !jsonraw.IsNull(v) {
			c.usage = append(c.usage[:0], v...)
		}
	case PromptTokenIDsKey:
		if c.ids.on {
			c.ids.addPrompt(v)
		}
	}
}

// choices hands the choice with index 0 (or, without an index, the first)
// to the reply and token-id collectors.
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
		c.reply.choice(delta, text, finish, stop)
		if c.ids.on {
			if promptIDs != nil {
				c.ids.addPrompt(promptIDs)
			}
			if genIDs != nil {
				c.ids.addGen(genIDs)
			}
		}
		return nil
	})
}

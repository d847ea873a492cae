package sse

import (
	"bytes"
	"errors"
	"fmt"
	"slices"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// HandleKey is the top-level member of an engine's response that carries
// its KV handle.
const HandleKey = "kv_transfer_params"

// ErrMalformedData is returned by Capture.Forward for an event whose data
// may carry a kv_transfer_params member but is not valid JSON, so that the
// member cannot be removed safely. Such an event must not be forwarded.
var ErrMalformedData = errors.New("sse: malformed event data may carry a KV handle")

// CaptureOption configures a Capture.
type CaptureOption interface {
	applyCapture(*Capture)
}

type captureOptionFunc func(*Capture)

func (f captureOptionFunc) applyCapture(c *Capture) { f(c) }

// WithReply makes the Capture reassemble the reply of choice 0 (content,
// reasoning and tool calls of chat chunks, text of completions chunks) for
// Capture.Reply. It is off by default, which keeps Forward free of
// allocations for events that carry no handle.
func WithReply() CaptureOption {
	return captureOptionFunc(func(c *Capture) { c.reply = true })
}

// Capture inspects the events of a vLLM /v1/chat/completions or
// /v1/completions stream on their way to the client. For each event,
// Forward returns the bytes to forward, with every kv_transfer_params
// member removed (top level and in choices, see Forward); the Capture keeps
// the last non-null value of the top-level member, and records the finish
// reason of choice 0, the usage and whether the "[DONE]" event was seen.
//
// A Capture serves one stream and is not safe for concurrent use.
type Capture struct {
	reply bool

	obj    jsonraw.Object
	out    []byte
	handle []byte
	usage  []byte
	finish string
	stop   []byte
	done   bool

	asm assembler

	tokens, stripTokens     bool
	strip                   stripScratch
	promptIDs, genIDs       []uint32
	sawPromptIDs, sawGenIDs bool
	badIDs                  bool
	// knownRaw and knownIDs (ExpectPromptIDs): the prompt's ids the
	// caller already has and their JSON text, until the first data event;
	// knownUsed records that the stream's prompt ids were taken as them,
	// and spare keeps the Capture's own slice meanwhile.
	knownRaw  []byte
	knownIDs  []uint32
	knownUsed bool
	spare     []uint32
	// handleBuf (UseHandleBuffer) is where the handle is copied, when
	// useHandleBuf is set.
	handleBuf    []byte
	useHandleBuf bool
}

// NewCapture returns a Capture for one stream.
func NewCapture(opts ...CaptureOption) *Capture {
	c := &Capture{}
	for _, o := range opts {
		o.applyCapture(c)
	}
	return c
}

// Forward inspects e and returns the bytes to send to the client in its
// place.
//
// An event without kv_transfer_params is returned unchanged: the result is
// e.Raw itself, and no memory is allocated. An event whose JSON data has a
// kv_transfer_params member at the top level or in an element of its
// choices array (whatever the escaping of its key) is rewritten without it;
// only a top-level one is taken as the engine's handle. The rest of the JSON
// keeps its bytes, but the event is re-framed with the JSON on a single
// "data: " line (line breaks between JSON tokens of a multi-line data field
// become spaces) while its other lines are kept. A line other than a data
// line (a comment, id, event, retry or unknown field) that contains the
// bytes kv_transfer_params is dropped, with its line break: such lines carry
// no JSON, so they are not rewritten, and they never reach a client. The
// result is then owned by the Capture and valid until the next call to
// Forward.
//
// Forward returns ErrMalformedData, and no bytes, when e's data may hold the
// member but is not valid JSON, or is a JSON array.
func (c *Capture) Forward(e Event) ([]byte, error) {
	d := e.Data
	done := e.HasData && string(d) == "[DONE]"
	strip := e.HasData && !done && c.stripTokens && mayHoldTokenIDs(d)
	// Data to rewrite is validated and indexed once, and then inspected
	// from its index (D's first chunk in token mode: the prompt's ids).
	parse := e.HasData && !done && (strip || MayHoldHandle(d))
	var perr error
	idMember := -1
	var ids []uint32
	if parse {
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
			perr = c.obj.Reset(d)
		}
	}
	if done {
		c.done = true
	} else if e.HasData {
		if parse && perr == nil {
			for i := range c.obj.Len() {
				if i == idMember {
					c.promptIDsParsed(ids)
					continue
				}
				c.inspectMember(c.obj.Member(i))
			}
		} else {
			c.inspect(d)
		}
	}
	if e.HasData {
		// The caller's text is compared with the first data only.
		c.knownRaw, c.knownIDs = nil, nil
	}
	if !strip && !MayHoldHandle(e.Raw) && !namesHandle(e.Raw) {
		return e.Raw, nil
	}
	data, changed := d, false
	if parse {
		if err := perr; err != nil {
			if !errors.Is(err, jsonraw.ErrNotObject) {
				return nil, fmt.Errorf("%w: %w", ErrMalformedData, err)
			}
			// Valid JSON but no object: a string or number has no member
			// to remove; an array that may hold one is never forwarded
			// (vLLM sends none).
			if t := bytes.TrimLeft(d, " \t\r\n"); len(t) > 0 && t[0] == '[' && MayHoldHandle(d) {
				return nil, fmt.Errorf("%w: an array", ErrMalformedData)
			}
		} else {
			v, hasHandle := c.obj.Get(HandleKey)
			if hasHandle && !jsonraw.IsNull(v) {
				if c.useHandleBuf {
					c.handleBuf = append(c.handleBuf[:0], v...)
					c.handle = c.handleBuf
				} else {
					c.handle = bytes.Clone(v)
				}
			}
			switch {
			case strip:
				data = c.strip.strip(c.obj, hasHandle)
				changed = hasHandle || len(data) != len(d)
			case hasHandle:
				data = c.obj.Edit([]string{HandleKey})
				changed = true
			}
			if MayHoldHandle(data) {
				if out, ok := StripChoiceHandles(data); ok {
					data, changed = out, true
				}
			}
		}
	}
	if e.HasData && !done && HasHandleKey(data) {
		// A handle somewhere engines do not put one (below a choice, say):
		// it cannot be removed with certainty, so it is never forwarded.
		return nil, fmt.Errorf("%w: a nested handle", ErrMalformedData)
	}
	out, rewritten := Rewrite(c.out[:0], e, data, changed)
	if rewritten {
		c.out = out
	}
	return out, nil
}

// StripChoiceHandles returns obj, a JSON object, without the
// kv_transfer_params members of the elements of its choices array, and true;
// or obj itself and false when no element has one (or obj is not a valid
// object). A top-level kv_transfer_params is left as it is.
func StripChoiceHandles(obj []byte) ([]byte, bool) {
	choices, ok := jsonraw.Lookup(obj, "choices")
	if !ok || !MayHoldHandle(choices) || len(choices) == 0 || choices[0] != '[' {
		return obj, false
	}
	out := make([]byte, 0, len(choices))
	out = append(out, '[')
	changed := false
	n := 0
	err := jsonraw.Elements(choices, func(v []byte) error {
		if n > 0 {
			out = append(out, ',')
		}
		n++
		if MayHoldHandle(v) {
			if o, err := jsonraw.Parse(v); err == nil && o.Has(HandleKey) {
				out = append(out, o.Edit([]string{HandleKey})...)
				changed = true
				return nil
			}
		}
		out = append(out, v...)
		return nil
	})
	if err != nil || !changed {
		return obj, false
	}
	out = append(out, ']')
	o, err := jsonraw.Parse(obj)
	if err != nil {
		return obj, false
	}
	return o.Edit(nil, jsonraw.Member{Key: "choices", Value: out}), true
}

// MayHoldHandle is the cheap test for a kv_transfer_params member in JSON
// text b: a key that decodes to it is either spelled literally or contains
// a \u escape (no other JSON escape produces a letter or '_'). False means
// b certainly holds none.
func MayHoldHandle(b []byte) bool {
	return bytes.Contains(b, []byte(HandleKey)) || bytes.Contains(b, []byte(`\u`))
}

// handleMembers are members only a KV handle has; a line outside the data
// that names one is dropped even without the kv_transfer_params key.
var handleMembers = [...]string{HandleKey, "remote_block_ids", "remote_engine_id"}

// namesHandle reports whether b names kv_transfer_params or a handle
// member.
func namesHandle(b []byte) bool {
	for _, m := range handleMembers {
		if bytes.Contains(b, []byte(m)) {
			return true
		}
	}
	return false
}

// HasHandleKey reports whether JSON text b still holds kv_transfer_params
// as a member name anywhere (a quoted occurrence followed by a colon, not
// inside a string, where its quotes would be escaped). After stripping the
// places where engines put handles, such a body or event is malformed and
// must not be forwarded. A model's text that mentions the word is not a
// member name.
func HasHandleKey(b []byte) bool {
	key := []byte(`"` + HandleKey + `"`)
	for i := 0; ; {
		j := bytes.Index(b[i:], key)
		if j < 0 {
			return false
		}
		j += i
		i = j + len(key)
		if j > 0 && b[j-1] == '\\' {
			continue // inside a string: its quotes are escaped
		}
		k := i
		for k < len(b) && (b[k] == ' ' || b[k] == '\t' || b[k] == '\n' || b[k] == '\r') {
			k++
		}
		if k < len(b) && b[k] == ':' {
			return true // a member name
		}
	}
}

// Handle returns a copy of the last non-null kv_transfer_params value seen,
// as raw JSON, or nil. With UseHandleBuffer, the copy is in the Capture's
// buffer: valid until the next Forward that sees a handle, or until
// ReleaseHandleBuffer.
func (c *Capture) Handle() []byte { return c.handle }

// UseHandleBuffer makes the Capture copy each handle it sees into buf
// (from buf[:0], into a larger slice when it does not fit) rather than into
// a new slice, so that a caller can reuse one buffer across streams. Take
// the buffer back with ReleaseHandleBuffer.
func (c *Capture) UseHandleBuffer(buf []byte) {
	c.handleBuf, c.useHandleBuf = buf[:0], true
}

// ReleaseHandleBuffer returns the buffer given to UseHandleBuffer, or the
// larger one the Capture moved to, and stops using it: Handle returns nil
// until another handle is seen, and later handles are copied into new
// slices. It returns nil without UseHandleBuffer.
func (c *Capture) ReleaseHandleBuffer() []byte {
	b := c.handleBuf
	if c.useHandleBuf && c.handle != nil {
		c.handle = nil // it aliases b
	}
	c.handleBuf, c.useHandleBuf = nil, false
	return b
}

// FinishReason returns the last non-null finish_reason of choice 0, or "".
func (c *Capture) FinishReason() string { return c.finish }

// Done reports whether the "data: [DONE]" event was seen.
func (c *Capture) Done() bool { return c.done }

// Usage returns the raw JSON of the last non-null top-level usage member
// seen, or nil. The slice is owned by the Capture and valid until the next
// call to Forward.
func (c *Capture) Usage() []byte { return c.usage }

// inspect records the finish reason, usage and reply fragments of a chunk.
// It trusts the engine's JSON: malformed data is ignored (at worst its
// metadata is missed).
func (c *Capture) inspect(d []byte) {
	_ = jsonraw.Members(d, func(key string, v []byte) error {
		c.inspectMember(key, v)
		return nil
	})
}

// inspectMember is inspect for one top-level member.
func (c *Capture) inspectMember(key string, v []byte) {
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
func (c *Capture) choices(arr []byte) {
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

// reframe appends to dst the event raw without its non-data lines that
// contain kv_transfer_params and, when replace is set, with its data lines
// replaced by one "data: " line holding data, at the place of the first
// data line.
func reframe(dst, raw, data []byte, replace bool) []byte {
	// One growth of dst, not one per doubling: the new data line and
	// room for the short lines around it, or raw as it is. (Not raw when
	// replacing: raw may be a large event whose data shrank, such as a
	// first chunk whose prompt ids are stripped.)
	if replace {
		dst = slices.Grow(dst, len("data: \n")+len(data)+64)
	} else {
		dst = slices.Grow(dst, len(raw))
	}
	wrote := false
	for len(raw) > 0 {
		end, next := lineEnd(raw)
		// A byte order mark before a data line is dropped with it: the
		// Reader ignores one only at the start of a stream.
		line := raw[:end]
		if !isDataLine(bytes.TrimPrefix(line, []byte(bom))) {
			if !namesHandle(line) {
				dst = append(dst, raw[:next]...)
			}
			raw = raw[next:]
			continue
		}
		if !replace {
			dst = append(dst, raw[:next]...)
		} else if !wrote {
			wrote = true
			dst = append(dst, "data: "...)
			start := len(dst)
			dst = append(dst, data...)
			for i, b := range dst[start:] {
				if b == '\n' || b == '\r' {
					dst[start+i] = ' '
				}
			}
			dst = append(dst, '\n')
		}
		raw = raw[next:]
	}
	return dst
}

// Rewrite returns the bytes to forward for e once its data may have been
// edited to data (changed says whether it was): e.Raw itself when nothing
// changed and no line outside the data names a handle (kv_transfer_params,
// remote_block_ids or remote_engine_id); otherwise, appended to dst, e
// with every non-data line that names a handle dropped and, when changed,
// its data lines replaced by one "data: " line holding data. rewritten
// reports the second case, in which the result aliases dst.
func Rewrite(dst []byte, e Event, data []byte, changed bool) (out []byte, rewritten bool) {
	if !changed && !otherLineHolds(e.Raw) {
		return e.Raw, false
	}
	return reframe(dst, e.Raw, data, changed), true
}

// otherLineHolds reports whether a line of raw other than a data line
// contains kv_transfer_params.
func otherLineHolds(raw []byte) bool {
	if !namesHandle(raw) {
		return false
	}
	for len(raw) > 0 {
		end, next := lineEnd(raw)
		line := raw[:end]
		if !isDataLine(bytes.TrimPrefix(line, []byte(bom))) && namesHandle(line) {
			return true
		}
		raw = raw[next:]
	}
	return false
}

func isDataLine(line []byte) bool {
	return bytes.HasPrefix(line, []byte("data")) && (len(line) == 4 || line[4] == ':')
}

// lineEnd returns the end of the first line of b and the start of the next.
func lineEnd(b []byte) (end, next int) {
	// Two byte searches, each vectorised, rather than IndexAny's loop:
	// a data line of D's first chunk in token mode is ~166 KB long.
	i := bytes.IndexByte(b, '\n')
	lim := i
	if lim < 0 {
		lim = len(b)
	}
	if j := bytes.IndexByte(b[:lim], '\r'); j >= 0 {
		i = j
	}
	switch {
	case i < 0:
		return len(b), len(b)
	case b[i] == '\r' && i+1 < len(b) && b[i+1] == '\n':
		return i, i + 2
	default:
		return i, i + 1
	}
}

package kvroute

import (
	"bytes"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/sse"
)

// capture reads a decode stream's chunks as they pass: it removes
// kv_transfer_params from every chunk, keeps the last non-null one, and
// reassembles choice 0's reply (content or text, reasoning, tool calls,
// finish and stop reasons) for the Identifier.
type capture struct {
	chat       bool
	handle     []byte
	done       bool
	finish     string
	stopReason []byte
	content    []byte
	reasoning  []byte
	calls      []toolCall
	broken     bool
	out        []byte
	obj        jsonraw.Object
}

type toolCall struct {
	id, typ, name, args []byte
}

var doneData = []byte("[DONE]")

// event returns the bytes to forward for ev: ev.Raw itself when it carries
// no kv_transfer_params (no copy), otherwise the event re-framed without it.
func (c *capture) event(ev sse.Event) []byte {
	if !ev.HasData {
		return ev.Raw
	}
	if bytes.Equal(ev.Data, doneData) {
		c.done = true
		return ev.Raw
	}
	c.read(ev.Data)
	h, ok := jsonraw.Lookup(ev.Data, kvKey)
	if !ok {
		return ev.Raw
	}
	if !jsonraw.IsNull(h) {
		c.handle = append(c.handle[:0], h...)
	}
	if err := c.obj.Reset(ev.Data); err != nil {
		c.broken = true
		return ev.Raw
	}
	return c.reframe(ev.Raw, c.obj.Edit([]string{kvKey}))
}

// reframe rebuilds raw with its data lines replaced by data, keeping every
// other line (event, id, retry, comments, the blank line) in place.
func (c *capture) reframe(raw, data []byte) []byte {
	c.out = c.out[:0]
	wrote := false
	for len(raw) > 0 {
		line, rest, eol := cutLine(raw)
		raw = rest
		if bytes.Equal(line, []byte("data")) || bytes.HasPrefix(line, []byte("data:")) {
			if !wrote {
				wrote = true
				for _, l := range bytes.Split(data, []byte("\n")) {
					c.out = append(c.out, "data: "...)
					c.out = append(c.out, l...)
					c.out = append(c.out, '\n')
				}
			}
			continue
		}
		c.out = append(c.out, line...)
		c.out = append(c.out, eol...)
	}
	return c.out
}

// cutLine splits b after its first line ending (\n, \r or \r\n).
func cutLine(b []byte) (line, rest, eol []byte) {
	i := bytes.IndexAny(b, "\r\n")
	if i < 0 {
		return b, nil, nil
	}
	n := 1
	if b[i] == '\r' && i+1 < len(b) && b[i+1] == '\n' {
		n = 2
	}
	return b[:i], b[i+n:], b[i : i+n]
}

// read takes what the reply needs from one chunk's JSON.
func (c *capture) read(data []byte) {
	choices, ok := jsonraw.Lookup(data, "choices")
	if !ok {
		return
	}
	_ = jsonraw.Elements(choices, func(ch []byte) error {
		if idx, ok := jsonraw.Lookup(ch, "index"); ok {
			if n, _ := jsonraw.Int(idx); n != 0 {
				return nil
			}
		}
		if v, ok := jsonraw.Lookup(ch, "finish_reason"); ok && !jsonraw.IsNull(v) {
			c.finish, _ = jsonraw.String(v)
			if sr, ok := jsonraw.Lookup(ch, "stop_reason"); ok {
				c.stopReason = append(c.stopReason[:0], sr...)
			}
		}
		if !c.chat {
			if v, ok := jsonraw.Lookup(ch, "text"); ok {
				c.appendString(&c.content, v)
			}
			return nil
		}
		delta, ok := jsonraw.Lookup(ch, "delta")
		if !ok {
			return nil
		}
		if v, ok := jsonraw.Lookup(delta, "content"); ok {
			c.appendString(&c.content, v)
		}
		for _, k := range [...]string{"reasoning_content", "reasoning"} {
			if v, ok := jsonraw.Lookup(delta, k); ok {
				c.appendString(&c.reasoning, v)
			}
		}
		if v, ok := jsonraw.Lookup(delta, "tool_calls"); ok && !jsonraw.IsNull(v) {
			_ = jsonraw.Elements(v, c.toolDelta)
		}
		return nil
	})
}

func (c *capture) appendString(dst *[]byte, v []byte) {
	if jsonraw.IsNull(v) {
		return
	}
	out, ok := jsonraw.AppendString(*dst, v)
	if !ok {
		c.broken = true
		return
	}
	*dst = out
}

// toolDelta merges one streamed tool-call fragment, addressed by index.
func (c *capture) toolDelta(d []byte) error {
	iv, ok := jsonraw.Lookup(d, "index")
	idx, isInt := jsonraw.Int(iv)
	if !ok || !isInt || idx < 0 || idx > 1024 {
		c.broken = true
		return nil
	}
	for int(idx) >= len(c.calls) {
		c.calls = append(c.calls, toolCall{})
	}
	tc := &c.calls[idx]
	if v, ok := jsonraw.Lookup(d, "id"); ok && !jsonraw.IsNull(v) {
		tc.id, _ = jsonraw.AppendString(tc.id[:0], v)
	}
	if v, ok := jsonraw.Lookup(d, "type"); ok && !jsonraw.IsNull(v) {
		tc.typ, _ = jsonraw.AppendString(tc.typ[:0], v)
	}
	if fn, ok := jsonraw.Lookup(d, "function"); ok && !jsonraw.IsNull(fn) {
		if v, ok := jsonraw.Lookup(fn, "name"); ok {
			c.appendString(&tc.name, v)
		}
		if v, ok := jsonraw.Lookup(fn, "arguments"); ok {
			c.appendString(&tc.args, v)
		}
	}
	return nil
}

// reply returns the reassembled reply.
func (c *capture) reply() *Reply {
	rep := &Reply{
		Content:      string(c.content),
		Reasoning:    string(c.reasoning),
		FinishReason: c.finish,
		Incomplete:   c.broken,
	}
	if c.stopReason != nil {
		rep.StopReason = c.stopReason
	}
	if len(c.calls) > 0 {
		b := []byte{'['}
		for i, tc := range c.calls {
			if len(tc.id) == 0 || len(tc.name) == 0 {
				rep.Incomplete = true
			}
			if i > 0 {
				b = append(b, ',')
			}
			typ := tc.typ
			if len(typ) == 0 {
				typ = []byte("function")
			}
			b = append(b, `{"id":`...)
			b = jsonraw.AppendQuote(b, string(tc.id))
			b = append(b, `,"type":`...)
			b = jsonraw.AppendQuote(b, string(typ))
			b = append(b, `,"function":{"name":`...)
			b = jsonraw.AppendQuote(b, string(tc.name))
			b = append(b, `,"arguments":`...)
			b = jsonraw.AppendQuote(b, string(tc.args))
			b = append(b, "}}"...)
		}
		rep.ToolCalls = append(b, ']')
	}
	return rep
}

package streamsynth

import (
	"fmt"
	"io"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// block is one content block of a Messages answer, raw; nil when absent.
type block struct {
	raw, typ                  []byte
	text, thinking, signature []byte
	input                     []byte
	hasInput                  bool
}

// readBlock reads and validates a content block: an object with a string
// type; a text block's text, a thinking block's thinking and signature
// strings.
func readBlock(b []byte) (block, error) {
	bl := block{raw: b}
	if len(b) == 0 || b[0] != '{' {
		return bl, fmt.Errorf("%w: a content block is not an object", ErrMalformed)
	}
	_ = jsonraw.Members(b, func(key string, v []byte) error {
		switch key {
		case "type":
			bl.typ = v
		case "text":
			bl.text = v
		case "thinking":
			bl.thinking = v
		case "signature":
			bl.signature = v
		case "input":
			bl.input, bl.hasInput = v, true
		}
		return nil
	})
	if bl.typ == nil || bl.typ[0] != '"' {
		return bl, fmt.Errorf("%w: a content block's type is not a string", ErrMalformed)
	}
	switch string(bl.typ) {
	case `"text"`:
		if bl.text == nil || bl.text[0] != '"' {
			return bl, fmt.Errorf("%w: a text block's text is not a string", ErrMalformed)
		}
	case `"thinking"`:
		if bl.thinking == nil || bl.thinking[0] != '"' || !isText(bl.signature) {
			return bl, fmt.Errorf("%w: a thinking block's thinking or signature is not a string", ErrMalformed)
		}
	}
	return bl, nil
}

// writeMessages writes a Messages answer as the Messages stream, each
// event named by an event field (the Anthropic SDKs skip unnamed ones):
// message_start with the answer's members but an empty content, a null
// stop_reason and stop_sequence and output_tokens 0; per content block, in
// order, content_block_start with the block's streamed member emptied
// (text "", thinking and signature "", tool_use input {}), one
// content_block_delta with the whole member (text_delta, thinking_delta
// then signature_delta, input_json_delta whose partial_json is the input's
// JSON text) and content_block_stop (a block of another type starts whole
// and stops); message_delta with stop_reason, stop_sequence and the
// answer's usage; message_stop.
func writeMessages(w io.Writer, obj jsonraw.Object) error {
	content, ok := obj.Get("content")
	if !ok || len(content) == 0 || content[0] != '[' {
		return fmt.Errorf("%w: content is not an array", ErrMalformed)
	}
	if err := jsonraw.Elements(content, func(b []byte) error {
		_, err := readBlock(b)
		return err
	}); err != nil {
		return err
	}
	stop, _ := obj.Get("stop_reason")
	seq, _ := obj.Get("stop_sequence")
	usage, _ := obj.Get("usage")
	if !isText(stop) || !isText(seq) {
		return fmt.Errorf("%w: stop_reason or stop_sequence is not a string", ErrMalformed)
	}
	if present(usage) && usage[0] != '{' {
		return fmt.Errorf("%w: usage is not an object", ErrMalformed)
	}
	o := newOut(w)
	writeMessageStart(o, obj, usage)
	i := 0
	_ = jsonraw.Elements(content, func(b []byte) error {
		bl, _ := readBlock(b)
		writeBlock(o, &bl, i)
		i++
		return nil
	})
	o.s("event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":")
	o.rawOr(stop, "null")
	o.s(`,"stop_sequence":`)
	o.rawOr(seq, "null")
	o.s(`},"usage":`)
	o.rawOr(usage, `{"output_tokens":0}`)
	o.s("}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n")
	return o.flush()
}

// writeMessageStart writes message_start: the answer's members in their
// order, with content [], stop_reason and stop_sequence null and usage's
// output_tokens 0 (each added at the end when the answer lacks it).
func writeMessageStart(o out, obj jsonraw.Object, usage []byte) {
	o.s("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{")
	var seen [4]bool // content, stop_reason, stop_sequence, usage
	for i := range obj.Len() {
		key, v := obj.Member(i)
		if i > 0 {
			o.s(",")
		}
		o.key(key)
		switch key {
		case "content":
			o.s("[]")
			seen[0] = true
		case "stop_reason":
			o.s("null")
			seen[1] = true
		case "stop_sequence":
			o.s("null")
			seen[2] = true
		case "usage":
			writeStartUsage(o, v)
			seen[3] = true
		default:
			o.raw(v)
		}
	}
	sep := ","
	if obj.Len() == 0 {
		sep = ""
	}
	for k, s := range [...]string{`"content":[]`, `"stop_reason":null`, `"stop_sequence":null`, `"usage":`} {
		if seen[k] {
			continue
		}
		o.s(sep)
		o.s(s)
		sep = ","
		if k == 3 {
			writeStartUsage(o, usage)
		}
	}
	o.s("}}\n\n")
}

// writeStartUsage writes usage with output_tokens 0: message_start's
// usage, which counts the prompt only.
func writeStartUsage(o out, usage []byte) {
	if !present(usage) {
		o.s(`{"input_tokens":0,"output_tokens":0}`)
		return
	}
	o.s("{")
	n := 0
	_ = jsonraw.Members(usage, func(key string, v []byte) error {
		if n > 0 {
			o.s(",")
		}
		n++
		o.key(key)
		if key == "output_tokens" {
			o.s("0")
		} else {
			o.raw(v)
		}
		return nil
	})
	if _, ok := jsonraw.Lookup(usage, "output_tokens"); !ok {
		if n > 0 {
			o.s(",")
		}
		o.s(`"output_tokens":0`)
	}
	o.s("}")
}

// writeBlock writes the events of content block i.
func writeBlock(o out, bl *block, i int) {
	start := func() {
		o.s("event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":")
		_, _ = o.w.Write(appendInt(o, i))
		o.s(`,"content_block":`)
	}
	delta := func(typ, key string, v []byte, quote bool) {
		o.s("event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":")
		_, _ = o.w.Write(appendInt(o, i))
		o.s(`,"delta":{"type":"`)
		o.s(typ)
		o.s(`","`)
		o.s(key)
		o.s(`":`)
		if quote {
			o.quote(v)
		} else {
			o.raw(v)
		}
		o.s("}}\n\n")
	}
	start()
	switch string(bl.typ) {
	case `"text"`:
		writeEmptied(o, bl.raw, "text", "", `""`)
		o.s("}\n\n")
		if nonEmpty(bl.text) {
			delta("text_delta", "text", bl.text, false)
		}
	case `"thinking"`:
		writeEmptied(o, bl.raw, "thinking", "signature", `""`)
		o.s("}\n\n")
		if nonEmpty(bl.thinking) {
			delta("thinking_delta", "thinking", bl.thinking, false)
		}
		if nonEmpty(bl.signature) {
			delta("signature_delta", "signature", bl.signature, false)
		}
	case `"tool_use"`:
		writeEmptied(o, bl.raw, "input", "", `{}`)
		o.s("}\n\n")
		if bl.hasInput {
			delta("input_json_delta", "partial_json", bl.input, true)
		}
	default:
		o.raw(bl.raw)
		o.s("}\n\n")
	}
	o.s("event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":")
	_, _ = o.w.Write(appendInt(o, i))
	o.s("}\n\n")
}

// writeEmptied writes the object obj with the members named a and b (when
// not "") given the value empty, in place.
func writeEmptied(o out, obj []byte, a, b, empty string) {
	o.s("{")
	n := 0
	_ = jsonraw.Members(obj, func(key string, v []byte) error {
		if n > 0 {
			o.s(",")
		}
		n++
		o.key(key)
		if key == a || (b != "" && key == b) {
			o.s(empty)
		} else {
			o.raw(v)
		}
		return nil
	})
	o.s("}")
}

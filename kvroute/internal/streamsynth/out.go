package streamsynth

import (
	"bufio"
	"bytes"
	"io"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// bufSize is the output buffer: events are assembled in it and leave in
// writes of about this size; a value larger than what is left of it (a
// long content string) goes from the answer body to the writer directly,
// never copied.
const bufSize = 4 << 10

// out writes an SSE stream through a bufio.Writer and keeps the first
// write error.
type out struct {
	w *bufio.Writer
}

func newOut(w io.Writer) out {
	if bw, ok := w.(*bufio.Writer); ok && bw.Size() >= bufSize {
		return out{w: bw}
	}
	return out{w: bufio.NewWriterSize(w, bufSize)}
}

// s writes a constant.
func (o out) s(s string) { _, _ = o.w.WriteString(s) }

// raw writes a JSON value taken from a validated document. A valid JSON
// value holds a line feed or a carriage return only as whitespace between
// tokens (inside strings they are escaped), and either would end the SSE
// data line: they are left out, which leaves the same JSON value.
func (o out) raw(v []byte) {
	for len(v) > 0 {
		i := bytes.IndexByte(v, '\n')
		if i < 0 {
			i = len(v)
		}
		if j := bytes.IndexByte(v[:i], '\r'); j >= 0 {
			i = j
		}
		_, _ = o.w.Write(v[:i])
		if i == len(v) {
			return
		}
		v = v[i+1:]
	}
}

// rawOr writes v, or def when v is absent or null.
func (o out) rawOr(v []byte, def string) {
	if v == nil || isNull(v) {
		o.s(def)
		return
	}
	o.raw(v)
}

// quote writes the JSON text v (a validated value) as a JSON string, the
// shape of Anthropic's partial_json: v's own bytes, with the characters a
// JSON string must escape escaped. Line feeds and carriage returns, which
// v holds only as whitespace, are left out.
func (o out) quote(v []byte) {
	const hex = "0123456789abcdef"
	_ = o.w.WriteByte('"')
	start := 0
	for i := 0; i < len(v); i++ {
		c := v[i]
		if c >= 0x20 && c != '"' && c != '\\' {
			continue // UTF-8 bytes too: valid JSON text is valid UTF-8 or already escaped
		}
		_, _ = o.w.Write(v[start:i])
		start = i + 1
		switch c {
		case '"':
			o.s(`\"`)
		case '\\':
			o.s(`\\`)
		case '\t':
			o.s(`\t`)
		case '\n', '\r':
		default:
			o.s(`\u00`)
			_ = o.w.WriteByte(hex[c>>4])
			_ = o.w.WriteByte(hex[c&0xf])
		}
	}
	_, _ = o.w.Write(v[start:])
	_ = o.w.WriteByte('"')
}

// flush sends what is buffered and returns the first write error.
func (o out) flush() error { return o.w.Flush() }

func isNull(v []byte) bool { return string(v) == "null" }

// key writes a member name (decoded) as a JSON string and a colon.
func (o out) key(k string) {
	_, _ = o.w.Write(jsonraw.AppendQuote(o.w.AvailableBuffer(), k))
	_ = o.w.WriteByte(':')
}

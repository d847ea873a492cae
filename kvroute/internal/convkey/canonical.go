package convkey

import (
	"bytes"
	"encoding/binary"
	"errors"
	"slices"
	"strings"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

var errStop = errors.New("stop")

// canonicalContent maps content to one form, returned as a tag byte and
// the bytes that follow it (aliasing v or scratch, which is returned for
// reuse); for tag 't' the bytes are a raw JSON string, hashed as its
// decoding without building it (Hasher.writeText). vLLM turns string content
// into a list of one text part and null into no parts, then hands the
// template either the parts (its "openai" content format, where a template
// concatenates text parts) or their texts joined with newlines ("string"
// format); the router cannot know which. So a string and a single text
// part give the text tagged "t", and null, absent, "" and [] the empty
// text; two or more text parts give their texts, each length-prefixed,
// tagged "p", unlike any string; anything else (images, audio, parts with
// other members) gives its compacted JSON tagged "j".
func canonicalContent(v, scratch []byte) (tag byte, body, buf []byte) {
	if len(v) == 0 || jsonraw.IsNull(v) {
		return 't', nil, scratch
	}
	if v[0] == '"' {
		return 't', v, scratch // a raw string: writeMessage decodes it
	}
	if v[0] == '[' {
		// Text parts: their raw strings first, decoded below.
		var small [4][]byte
		parts := small[:0]
		allText := true
		_ = jsonraw.Elements(v, func(p []byte) error {
			var typ, text []byte
			hasText := false
			other := false
			_ = jsonraw.Members(p, func(k string, pv []byte) error {
				switch k {
				case "type":
					typ = pv
				case "text":
					text = pv
					hasText = len(pv) > 0 && pv[0] == '"'
				default:
					if !jsonraw.IsNull(pv) {
						other = true
					}
				}
				return nil
			})
			if !hasText || other || !isText(typ) {
				allText = false
				return errStop
			}
			parts = append(parts, text)
			return nil
		})
		if allText {
			switch len(parts) {
			case 0:
				return 't', nil, scratch
			case 1:
				return 't', parts[0], scratch
			}
			b := scratch[:0]
			for _, p := range parts {
				// Decoded after a length placeholder, then the length put
				// in front: each part is appended once.
				at := len(b)
				b = append(b, make([]byte, binary.MaxVarintLen64)...)
				b, _ = jsonraw.AppendString(b, p)
				n := len(b) - at - binary.MaxVarintLen64
				var l [binary.MaxVarintLen64]byte
				k := binary.PutUvarint(l[:], uint64(n))
				copy(b[at:], l[:k])
				b = append(b[:at+k], b[at+binary.MaxVarintLen64:]...)
			}
			return 'p', b, b
		}
	}
	out := Compact(bytes.NewBuffer(scratch[:0]), v)
	return 'j', out, out
}

// isText reports whether a part's type is the JSON string "text".
func isText(typ []byte) bool {
	if string(typ) == `"text"` {
		return true
	}
	s, ok := jsonraw.String(typ)
	return ok && s == "text"
}

// writeMessage hashes one message in canonical form: content is tag
// followed by the digest of body (Hasher.content). A text body (tag 't') is the JSON string of a request's
// content, hashed as its decoding; text is set when body is the text itself
// (a reply D sent, which may begin with a quote like any text), hashed as
// is.
func writeMessage(d *Hasher, role string, tag byte, body []byte, text bool, name, toolCallID string, toolCalls []byte, extra [][2][]byte) {
	d.FieldString("role", role)
	d.content("content", tag, body, tag == 't' && !text && len(body) > 0 && body[0] == '"')
	d.FieldString("name", name)
	d.FieldString("tool_call_id", toolCallID)
	writeToolCalls(d, toolCalls)
	if len(extra) > 0 {
		var buf bytes.Buffer
		for _, e := range extra {
			buf.Reset()
			d.Field("x:"+string(e[0]), Compact(&buf, e[1]))
		}
	}
	d.tmp[0] = 0xff // end of message
	d.Write(d.tmp[:1])
}

// writeToolCalls hashes tool calls; null and [] hash like none. Each call
// hashes every member that is not null, in key order (clients re-serialize
// calls in their own member order: the OpenAI SDK echoes
// {"id","function":{"arguments","name"},"type"} for the engine's
// {"id","type","function":{"name","arguments"}}), with an absent type read
// as "function". function's members are hashed the same way, arguments by
// toolArguments, every other value as canonical JSON.
func writeToolCalls(h *Hasher, v []byte) {
	if len(v) == 0 || jsonraw.IsNull(v) {
		return
	}
	var buf []byte
	_ = jsonraw.Elements(v, func(call []byte) error {
		h.Field("call", nil)
		if len(call) == 0 || call[0] != '{' {
			buf = canonicalJSON(buf[:0], call)
			h.Field("c", buf)
			return nil
		}
		hasType := false
		members := sortedMembers(call)
		for _, m := range members {
			if m.key == "type" {
				hasType = true
			}
		}
		if !hasType {
			members = append(members, member{"type", []byte(`"function"`)})
			slices.SortStableFunc(members, func(a, b member) int { return strings.Compare(a.key, b.key) })
		}
		for _, m := range members {
			if m.key == "function" && len(m.v) > 0 && m.v[0] == '{' {
				h.Field("c:function", []byte("object"))
				for _, f := range sortedMembers(m.v) {
					if f.key == "arguments" {
						buf = toolArguments(buf[:0], f.v)
					} else {
						buf = canonicalJSON(buf[:0], f.v)
					}
					h.Field("f:"+f.key, buf)
				}
				continue
			}
			buf = canonicalJSON(buf[:0], m.v)
			h.Field("c:"+m.key, buf)
		}
		return nil
	})
}

// toolArguments appends the canonical form of a tool call's arguments: a
// string as 's' and its text, any other JSON value as 'j' and its
// canonical JSON, so the string "{}" and the object {} differ (the engine
// returns the string form, and a client that echoes it back unchanged
// hits; the object form renders through the template's own serializer).
func toolArguments(dst, v []byte) []byte {
	if s, ok := jsonraw.String(v); ok {
		return append(append(dst, 's'), s...)
	}
	return canonicalJSON(append(dst, 'j'), v)
}

type member struct {
	key string
	v   []byte
}

// sortedMembers returns obj's members that are not null, sorted by key
// (stably: duplicates keep their order).
func sortedMembers(obj []byte) []member {
	var ms []member
	_ = jsonraw.Members(obj, func(k string, v []byte) error {
		if !jsonraw.IsNull(v) {
			ms = append(ms, member{k, v})
		}
		return nil
	})
	slices.SortStableFunc(ms, func(a, b member) int { return strings.Compare(a.key, b.key) })
	return ms
}

// canonicalJSON appends v without insignificant whitespace and with every
// string re-encoded in one escaping, so "\u0061" and "a" agree. Object
// members keep their order, as Python dicts (and so chat templates) do;
// numbers keep their spelling.
func canonicalJSON(dst, v []byte) []byte {
	i := 0
	for i < len(v) && isJSONSpace(v[i]) {
		i++
	}
	j := len(v)
	for j > i && isJSONSpace(v[j-1]) {
		j--
	}
	v = v[i:j]
	if len(v) == 0 {
		return dst
	}
	switch v[0] {
	case '"':
		s, ok := jsonraw.String(v)
		if !ok {
			return append(dst, v...)
		}
		return jsonraw.AppendQuote(dst, s)
	case '{':
		dst = append(dst, '{')
		n := 0
		_ = jsonraw.Members(v, func(k string, mv []byte) error {
			if n > 0 {
				dst = append(dst, ',')
			}
			n++
			dst = jsonraw.AppendQuote(dst, k)
			dst = append(dst, ':')
			dst = canonicalJSON(dst, mv)
			return nil
		})
		return append(dst, '}')
	case '[':
		dst = append(dst, '[')
		n := 0
		_ = jsonraw.Elements(v, func(e []byte) error {
			if n > 0 {
				dst = append(dst, ',')
			}
			n++
			dst = canonicalJSON(dst, e)
			return nil
		})
		return append(dst, ']')
	}
	return append(dst, v...)
}

func isJSONSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

package convkey_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"unicode/utf16"

	"github.com/bidikv/bidikv/kvroute/internal/convkey"
)

// FuzzMessageRespelled: a message hashes as the same message re-serialized
// with encoding/json's reader in another member order, with other string
// escapes and other whitespace, and otherwise than the message with one
// member more. What is re-spelled is what the canonical form promises to
// read through: member names, the role, name and tool_call_id, string
// content and tool calls (every string in them); other members and
// non-string content keep their text, whose escapes are not promised
// away.
func FuzzMessageRespelled(f *testing.F) {
	for _, m := range []string{
		`{"role":"user","content":"hi"}`,
		`{"role":"user","content":"caf\u00e9 \ud83d\ude00 <b>&amp;</b>","name":"bob"}`,
		`{"content":[{"type":"text","text":"a"},{"type":"text","text":"b"}],"role":"user"}`,
		`{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"ls","arguments":"{\"dir\":\"\/\"}"}}],"refusal":null}`,
		`{"role":"tool","tool_call_id":"c\u0031","content":"a.go\nb.go"}`,
		`{"role":"assistant","content":"x","reasoning_content":"I think","x":{"b":[1,2.50,true]}}`,
		`{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:x"}}]}`,
		"{\"role\":\"user\",\"content\":\"\xff\\u0000\"}",
		`{"r\u006fle":"user","content":""}`,
		"{\"\xff\":\"\xfe\",\"role\":\"us\xc3er\",\"tool_calls\":[{\"\xff\":1.0e2}]}",
	} {
		f.Add([]byte(m), uint8(0))
		f.Add([]byte(m), uint8(1))
	}
	f.Fuzz(func(t *testing.T, m []byte, style uint8) {
		members, ok := topMembers(m)
		if !ok {
			return // not an object, or not JSON: the router never hashes it
		}
		want, _, err := convkey.NewChainer().Message([32]byte{}, m, nil)
		if err != nil {
			t.Fatalf("%q: %v", m, err)
		}
		slices.Reverse(members)
		var b bytes.Buffer
		b.WriteByte('{')
		for i, mb := range members {
			if i > 0 {
				b.WriteByte(',')
			}
			writeString(&b, mb.key, style)
			b.WriteByte(':')
			switch respell := mb.key == "role" || mb.key == "name" || mb.key == "tool_call_id" || mb.key == "tool_calls" ||
				mb.key == "content" && mb.value[0] == '"'; {
			case respell:
				dec := json.NewDecoder(bytes.NewReader(mb.value))
				dec.UseNumber()
				if err := reencode(&b, dec, style); err != nil {
					t.Fatalf("%q: %v", mb.value, err)
				}
			default:
				b.Write(mb.value)
			}
		}
		b.WriteByte('}')
		respelled := b.Bytes()
		got, _, err := convkey.NewChainer().Message([32]byte{}, respelled, nil)
		if err != nil || got != want {
			t.Fatalf("%q hashes otherwise (%v) respelled as %q", m, err, respelled)
		}
		var indented bytes.Buffer
		if err := json.Indent(&indented, respelled, " ", "\t"); err != nil {
			t.Fatalf("%q: %v", respelled, err)
		}
		if got, _, _ := convkey.NewChainer().Message([32]byte{}, indented.Bytes(), nil); got != want {
			t.Fatalf("%q hashes otherwise indented as %q", m, indented.Bytes())
		}
		for _, mb := range members {
			if mb.key == "fuzz-extra" {
				return
			}
		}
		more := append(append([]byte(`{"fuzz-extra":1,`), respelled[1:len(respelled)-1]...), '}')
		if len(members) == 0 {
			more = []byte(`{"fuzz-extra":1}`)
		}
		if got, _, _ := convkey.NewChainer().Message([32]byte{}, more, nil); got == want {
			t.Fatalf("%q hashes as %q, a member more", m, more)
		}
	})
}

// member is a top-level member of a message, its name decoded.
type member struct {
	key   string
	value json.RawMessage
}

// topMembers reads the members of the JSON object m with encoding/json;
// ok is false when m is not one, or holds a name twice (which of the two
// a reader takes is a matter of order).
func topMembers(m []byte) ([]member, bool) {
	if !json.Valid(m) {
		return nil, false
	}
	dec := json.NewDecoder(bytes.NewReader(m))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, false
	}
	var out []member
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, false
		}
		key := tok.(string)
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil || seen[key] {
			return nil, false
		}
		seen[key] = true
		out = append(out, member{key, v})
	}
	return out, true
}

// reencode writes the next JSON value of dec compactly, member order and
// numbers as they are, every string spelled by writeString.
func reencode(w *bytes.Buffer, dec *json.Decoder, style uint8) error {
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	switch v := tok.(type) {
	case json.Delim:
		end := byte('}')
		if v == '[' {
			end = ']'
		}
		w.WriteByte(byte(v))
		for n := 0; dec.More(); n++ {
			if n > 0 {
				w.WriteByte(',')
			}
			if v == '{' {
				k, err := dec.Token()
				if err != nil {
					return err
				}
				writeString(w, k.(string), style)
				w.WriteByte(':')
			}
			if err := reencode(w, dec, style); err != nil {
				return err
			}
		}
		if _, err := dec.Token(); err != nil {
			return err
		}
		w.WriteByte(end)
	case string:
		writeString(w, v, style)
	case json.Number:
		w.WriteString(v.String())
	case bool, nil:
		b, _ := json.Marshal(v)
		w.Write(b)
	default:
		return fmt.Errorf("token %T", tok)
	}
	return nil
}

// writeString spells s as a JSON string: style 0 escapes every rune
// (\uXXXX, surrogate pairs above the BMP), style 1 escapes only what JSON
// requires, with '/' as "\/" and control characters in capital hex.
func writeString(w *bytes.Buffer, s string, style uint8) {
	w.WriteByte('"')
	for _, r := range s {
		switch {
		case style%2 == 0 && r > 0xffff:
			r1, r2 := utf16.EncodeRune(r)
			fmt.Fprintf(w, `\u%04x\u%04x`, r1, r2)
		case style%2 == 0:
			fmt.Fprintf(w, `\u%04x`, r)
		case r == '"' || r == '\\':
			w.WriteByte('\\')
			w.WriteRune(r)
		case r == '/':
			w.WriteString(`\/`)
		case r < 0x20:
			fmt.Fprintf(w, `\u%04X`, r)
		default:
			w.WriteRune(r)
		}
	}
	w.WriteByte('"')
}

// FuzzFieldsFraming: two sequences of fields hash alike only when they are
// the same sequence. The input is split into fields at 0xff bytes, each
// field into its name and value at its first 0xfe; a cut splits it in two
// sequences.
func FuzzFieldsFraming(f *testing.F) {
	f.Add([]byte("ab\xfec"), []byte("a\xfebc"))
	f.Add([]byte("a\xfeb\xffc\xfed"), []byte("a\xfeb\x01c\x01d"))
	f.Add([]byte("a\xfeb\xffc\xfed"), []byte("a\xfeb\x01cd"))
	f.Add([]byte("a\x01\xfe"), []byte("a\xfe\x00"))
	f.Add([]byte("a\xfe\xff\xfe"), []byte("a\xfe"))
	f.Add([]byte("same\xfevalue"), []byte("same\xfevalue"))
	f.Fuzz(func(t *testing.T, a, b []byte) {
		fa, fb := splitFields(a), splitFields(b)
		same := slices.Equal(fa, fb)
		if alike := fieldsSum(fa...) == fieldsSum(fb...); alike != same {
			t.Fatalf("%q and %q: same %v, hash alike %v", fa, fb, same, alike)
		}
	})
}

func splitFields(in []byte) []field {
	var out []field
	if len(in) == 0 {
		return nil
	}
	for _, f := range bytes.Split(in, []byte{0xff}) {
		name, value, _ := bytes.Cut(f, []byte{0xfe})
		out = append(out, field{string(name), string(value)})
	}
	return out
}

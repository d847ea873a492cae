package convkey_test

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/internal/convkey"
)

// field is one name and value for Hasher.Field.
type field struct{ name, value string }

// fieldsSum is the digest of fs written with Field.
func fieldsSum(fs ...field) [32]byte {
	h := convkey.New()
	for _, f := range fs {
		h.Field(f.name, []byte(f.value))
	}
	return h.Sum()
}

// Fields are length-prefixed: no two different sequences of fields hash
// alike, however their bytes line up.
func TestFieldFraming(t *testing.T) {
	long := strings.Repeat("n", 100) // names over 64 bytes are written apart
	for _, tc := range []struct {
		name string
		a, b []field
	}{
		{"a byte from the name to the value", []field{{"ab", "c"}}, []field{{"a", "bc"}}},
		{"a field split in two", []field{{"a", "bcd"}}, []field{{"a", "b"}, {"c", "d"}}},
		{"a field's framing as its value", []field{{"a", "b"}, {"c", "d"}}, []field{{"a", "b\x01c\x01d"}}},
		{"a value spelling the next field's name", []field{{"a", "b"}, {"c", "d"}}, []field{{"a", "b\x01cd"}}},
		{"a name spelling its value's length", []field{{"a\x01", ""}}, []field{{"a", "\x00"}}},
		{"an empty field more", []field{{"a", "b"}}, []field{{"a", "b"}, {"", ""}}},
		{"an empty value", []field{{"a", ""}, {"b", "c"}}, []field{{"a", "b"}, {"", "c"}}},
		{"fields in another order", []field{{"a", "1"}, {"b", "2"}}, []field{{"b", "2"}, {"a", "1"}}},
		{"a long name", []field{{long, "x"}}, []field{{long[:99], "nx"}}},
		{"a long name's framing", []field{{long, ""}}, []field{{"", long}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.NotEqual(t, fieldsSum(tc.a...), fieldsSum(tc.b...))
		})
	}
	assert.Equal(t, fieldsSum(field{long, "x"}, field{"a", "b"}), fieldsSum(field{long, "x"}, field{"a", "b"}), "deterministic")
}

// FieldString is Field for a string, whatever its length.
func TestFieldString(t *testing.T) {
	for _, s := range []string{"", "chat", strings.Repeat("0123456789", 30)} {
		for _, name := range []string{"tenant", strings.Repeat("n", 70)} {
			a, b := convkey.New(), convkey.New()
			a.FieldString(name, s)
			b.Field(name, []byte(s))
			assert.Equal(t, b.Sum(), a.Sum(), "%d bytes named %d", len(s), len(name))
		}
	}
}

// Reset empties a Hasher: it then hashes as a new one.
func TestHasherReset(t *testing.T) {
	h := convkey.New()
	h.Field("a", []byte("b"))
	h.Reset()
	h.FieldString("v1", "chat")
	want := convkey.New()
	want.FieldString("v1", "chat")
	assert.Equal(t, want.Sum(), h.Sum())
	n, err := h.Write([]byte("abc"))
	assert.Equal(t, 3, n)
	assert.NoError(t, err)
}

// WriteReply hashes what the decode engine answered as the assistant
// message the next request sends back, as a client resends it: a chain
// continued by the reply is the chain of the next request's history.
func TestWriteReply(t *testing.T) {
	prev := sum(t, userMsg)
	engineCalls := `[{"id":"call_1","type":"function","function":{"name":"ls","arguments":"{\"dir\":\".\"}"}}]`
	for _, tc := range []struct {
		name    string
		content string
		calls   string
		resent  string // the message a client sends back
	}{
		{"text", "a.go b.go", "", `{"role":"assistant","content":"a.go b.go"}`},
		{"text in parts", "a.go b.go", "", `{"role":"assistant","content":[{"type":"text","text":"a.go b.go"}],"refusal":null}`},
		{"escapes", "café \"x\"\n\t\\ 😀", "", `{"role":"assistant","content":"caf\u00e9 \"x\"\n\t\\ \ud83d\ude00"}`},
		{"quoted text", `"main.go"`, "", `{"role":"assistant","content":"\"main.go\""}`},
		{"a lone quote", `"`, "", `{"role":"assistant","content":"\""}`},
		{"empty", "", "", `{"role":"assistant","content":null}`},
		{"tool calls", "", engineCalls, `{"role":"assistant","content":null,"tool_calls":` + engineCalls + `}`},
		{"tool calls in the SDK's order", "", engineCalls,
			`{"role":"assistant","content":"","tool_calls":[{"id":"call_1","function":{"arguments":"{\"dir\":\".\"}","name":"ls"},"type":"function"}]}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := convkey.New()
			h.WriteDigest(prev)
			var calls []byte
			if tc.calls != "" {
				calls = []byte(tc.calls)
			}
			convkey.WriteReply(h, tc.content, calls)
			want, role, err := convkey.NewChainer().Message(prev, []byte(tc.resent), nil)
			require.NoError(t, err)
			require.Equal(t, "assistant", role)
			assert.Equal(t, want, h.Sum())
		})
	}
	// A reply's text is hashed as it is, never decoded: the text "\"x\""
	// is not the text x.
	h := convkey.New()
	h.WriteDigest(prev)
	convkey.WriteReply(h, `"main.go"`, nil)
	decoded, _, err := convkey.NewChainer().Message(prev, []byte(`{"role":"assistant","content":"main.go"}`), nil)
	require.NoError(t, err)
	assert.NotEqual(t, decoded, h.Sum())
}

// DigestKey spells a store key: the prefix, a colon, the digest in hex.
func TestDigestKey(t *testing.T) {
	var d [32]byte
	for i := range d {
		d[i] = byte(i * 7)
	}
	for _, prefix := range []string{"", "a", "0123456789abcdef", strings.Repeat("p", 40)} {
		assert.Equal(t, prefix+":"+hex.EncodeToString(d[:]), convkey.DigestKey(prefix, d))
	}
}

// Compact drops insignificant whitespace, so formatting never changes a
// digest; what is not JSON it keeps as it is.
func TestCompact(t *testing.T) {
	for in, want := range map[string]string{
		"{ \"a\" : [1, 2],\n\t\"b\" : \" x \" }": `{"a":[1,2],"b":" x "}`,
		`"\u0061"`:                               `"\u0061"`,
		`{"a"`:                                   `{"a"`,
	} {
		var buf bytes.Buffer
		assert.Equal(t, want, string(convkey.Compact(&buf, []byte(in))), "%q", in)
	}
	// Compact appends: buf's bytes come back whole.
	var buf bytes.Buffer
	buf.WriteString("x")
	assert.Equal(t, `x[1]`, string(convkey.Compact(&buf, []byte(`[ 1 ]`))))
	assert.True(t, json.Valid(convkey.Compact(new(bytes.Buffer), []byte(" [ {} ] "))))
}

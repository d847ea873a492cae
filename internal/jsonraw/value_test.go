package jsonraw_test

import (
	"encoding/json"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

func TestString(t *testing.T) {
	tests := []struct {
		in   string
		want string
		ok   bool
	}{
		{`"plain"`, "plain", true},
		{`""`, "", true},
		{`"a\"b\\c\/d\b\f\n\r\t"`, "a\"b\\c/d\b\f\n\r\t", true},
		{`"\u00e9\u4e16"`, "é世", true},
		{`"\ud83d\ude00"`, "😀", true},
		{`"\ud83d"`, "\ufffd", true},
		{`"\ud83dx"`, "\ufffdx", true},
		{`"\ud83d\u0041"`, "\ufffdA", true},
		{`"\ude00\ud83d"`, "\ufffd\ufffd", true},
		{"\"\xff\xfe\"", "\ufffd\ufffd", true},
		{"\"é\"", "é", true},
		{`"unterminated`, "", false},
		{`"a" `, "", false},
		{`1`, "", false},
		{``, "", false},
		{`"\q"`, "", false},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, ok := jsonraw.String([]byte(tt.in))
			assert.Equal(t, tt.ok, ok)
			assert.Equal(t, tt.want, got)
			if tt.ok {
				var want string
				require.NoError(t, json.Unmarshal([]byte(tt.in), &want))
				assert.Equal(t, want, got, "agrees with encoding/json")
				b, ok := jsonraw.AppendString([]byte("x"), []byte(tt.in))
				assert.True(t, ok)
				assert.Equal(t, "x"+want, string(b))
				in := []byte(tt.in)
				sb, scratch, ok := jsonraw.StringBytes(in, make([]byte, 0, 1))
				assert.True(t, ok)
				assert.Equal(t, want, string(sb), "StringBytes")
				aliased := len(sb) > 0 && &sb[0] == &in[1]
				plain := !strings.Contains(tt.in, `\`) && utf8.ValidString(tt.in) && len(sb) > 0
				assert.Equal(t, plain, aliased, "aliases the input exactly when nothing needs decoding")
				if !plain && len(sb) > 0 {
					assert.Equal(t, &scratch[0], &sb[0], "decoded into the buffer it returns")
				}
				var pieces []byte
				assert.True(t, jsonraw.StringPieces(in, func(p []byte) { pieces = append(pieces, p...) }))
				assert.Equal(t, want, string(pieces), "StringPieces")
			} else {
				_, _, ok := jsonraw.StringBytes([]byte(tt.in), nil)
				assert.False(t, ok, "StringBytes")
				assert.False(t, jsonraw.StringPieces([]byte(tt.in), func([]byte) { t.Error("called") }), "StringPieces")
			}
		})
	}
}

func TestBoolIntNull(t *testing.T) {
	b, ok := jsonraw.Bool([]byte("true"))
	assert.True(t, b)
	assert.True(t, ok)
	b, ok = jsonraw.Bool([]byte("false"))
	assert.False(t, b)
	assert.True(t, ok)
	_, ok = jsonraw.Bool([]byte(`"true"`))
	assert.False(t, ok)

	assert.True(t, jsonraw.IsNull([]byte("null")))
	assert.False(t, jsonraw.IsNull([]byte(`"null"`)))

	ints := []struct {
		in   string
		want int64
		ok   bool
	}{
		{"0", 0, true},
		{"-0", 0, true},
		{"42", 42, true},
		{"-9223372036854775808", -9223372036854775808, true},
		{"9223372036854775808", 0, false},
		{"1.0", 0, false},
		{"1e3", 0, false},
		{"01", 0, false},
		{"+1", 0, false},
		{"-", 0, false},
		{"", 0, false},
		{`"1"`, 0, false},
	}
	for _, tt := range ints {
		t.Run("int "+tt.in, func(t *testing.T) {
			got, ok := jsonraw.Int([]byte(tt.in))
			assert.Equal(t, tt.ok, ok)
			assert.Equal(t, tt.want, got)
		})
	}
}

func TestAppendQuoteRoundTrip(t *testing.T) {
	for _, s := range []string{"", "abc", "a\"b\\c", "\x00\x1f\n\t", "é世😀", "\u2028\u2029", "<&>"} {
		t.Run(s, func(t *testing.T) {
			q := jsonraw.AppendQuote(nil, s)
			var got string
			require.NoError(t, json.Unmarshal(q, &got), "quoted: %s", q)
			assert.Equal(t, s, got)
		})
	}
	q := jsonraw.AppendQuote(nil, "a\xffb")
	assert.Equal(t, `"a\ufffdb"`, string(q))
}

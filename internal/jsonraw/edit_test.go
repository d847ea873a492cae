package jsonraw_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

func m(k, v string) jsonraw.Member { return jsonraw.Member{Key: k, Value: []byte(v)} }

func TestEdit(t *testing.T) {
	tests := []struct {
		name string
		in   string
		del  []string
		set  []jsonraw.Member
		want string
	}{
		{"no-op", `{"a":1}`, []string{"z"}, nil, `{"a":1}`},
		{"set same value is a no-op", `{"a": 1}`, nil, []jsonraw.Member{m("a", "1")}, `{"a": 1}`},
		{"delete first", `{"a":1,"b":2,"c":3}`, []string{"a"}, nil, `{"b":2,"c":3}`},
		{"delete middle", `{"a":1,"b":2,"c":3}`, []string{"b"}, nil, `{"a":1,"c":3}`},
		{"delete last", `{"a":1,"b":2,"c":3}`, []string{"c"}, nil, `{"a":1,"b":2}`},
		{"delete all duplicates", `{"a":1,"b":2,"a":3}`, []string{"a"}, nil, `{"b":2}`},
		{"delete escaped key", `{"kv\u005ftransfer_params":{"x":1},"b":2}`, []string{"kv_transfer_params"}, nil, `{"b":2}`},
		{"delete everything keeps outer bytes", " {\n \"a\": 1\n} \n", []string{"a"}, nil, " {\n} \n"},
		{"replace keeps position and raw key", `{"m\u0061x_tokens":100,"s":true}`, nil, []jsonraw.Member{m("max_tokens", "1")}, `{"m\u0061x_tokens":1,"s":true}`},
		{"replace removes duplicates keeps first position", `{"a":1,"b":2,"a":3}`, nil, []jsonraw.Member{m("a", `"x"`)}, `{"a":"x","b":2}`},
		{"append", `{"a":1}`, nil, []jsonraw.Member{m("k", `{"do_remote_decode":true}`)}, `{"a":1,"k":{"do_remote_decode":true}}`},
		{"append to empty", `{ }`, nil, []jsonraw.Member{m("k", "1")}, `{"k":1 }`},
		{"append before trailing whitespace", "{\n  \"a\": 1\n}", nil, []jsonraw.Member{m("k", "2")}, "{\n  \"a\": 1,\"k\":2\n}"},
		{"append quotes the key", `{}`, nil, []jsonraw.Member{m("a\"b\n", "1")}, `{"a\"b\n":1}`},
		{"empty value is null", `{"a":1}`, nil, []jsonraw.Member{m("a", "")}, `{"a":null}`},
		{"delete then set appends", `{"a":1,"b":2}`, []string{"a"}, []jsonraw.Member{m("a", "9")}, `{"b":2,"a":9}`},
		{"delete all then append", `{"a":1, "b":2 }`, []string{"a", "b"}, []jsonraw.Member{m("c", "3")}, `{"c":3 }`},
		{"later set wins in place", `{"a":1,"b":2}`, nil, []jsonraw.Member{m("a", "8"), m("a", "9")}, `{"a":9,"b":2}`},
		{"later set wins when appended", `{"b":2}`, nil, []jsonraw.Member{m("a", "8"), m("c", "0"), m("a", "9")}, `{"b":2,"a":9,"c":0}`},
		{
			"P-leg rewrite",
			`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"max_completion_tokens":50,"stream_options":{"include_usage":true},"kv_transfer_params":{"evil":1},"conversation_id":"c"}`,
			[]string{"max_completion_tokens", "min_tokens", "min_completion_tokens", "stream_options", "conversation_id"},
			[]jsonraw.Member{m("stream", "false"), m("max_tokens", "1"), m("kv_transfer_params", `{"do_remote_decode":true}`)},
			`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":false,"kv_transfer_params":{"do_remote_decode":true},"max_tokens":1}`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := []byte(tt.in)
			o, err := jsonraw.Parse(in)
			require.NoError(t, err)
			got := o.Edit(tt.del, tt.set...)
			assert.Equal(t, tt.want, string(got))
			assert.True(t, json.Valid(got))
			assert.Equal(t, tt.in, string(in), "input not modified")
			pieces := o.EditPieces(nil, tt.del, tt.set...)
			assert.Equal(t, tt.want, string(bytes.Join(pieces, nil)), "EditPieces")
			// Kept members are not copied: every piece of two bytes or
			// more that is not a set value or an appended key aliases
			// the input.
			for _, p := range pieces {
				if len(p) > 1 && !isSetValue(p, tt.set) && p[0] != '"' && string(p) != "null" {
					assert.True(t, aliases(in, p), "piece %q is a copy", p)
				}
			}
		})
	}
}

func isSetValue(p []byte, set []jsonraw.Member) bool {
	for _, m := range set {
		if len(m.Value) > 0 && &m.Value[0] == &p[0] {
			return true
		}
	}
	return false
}

func aliases(in, p []byte) bool {
	for i := range in {
		if &in[i] == &p[0] {
			return true
		}
	}
	return false
}

func TestEditZeroObject(t *testing.T) {
	var o jsonraw.Object
	assert.Equal(t, 0, o.Len())
	assert.Equal(t, `{"a":1}`, string(o.Edit(nil, m("a", "1"))))
}

func TestEditUnchangedReturnsSameSlice(t *testing.T) {
	in := []byte(`{"a":1,"b":[2]}`)
	o, err := jsonraw.Parse(in)
	require.NoError(t, err)
	got := o.Edit([]string{"c"}, m("b", "[2]"))
	require.Len(t, got, len(in))
	assert.Same(t, &in[0], &got[0])
}

// EditPieces keeps every run of members it does not change as one piece of
// the document, however many members the run has: an upstream body costs
// a few pieces, not one per member.
func TestEditPiecesOnePiecePerRun(t *testing.T) {
	var b bytes.Buffer
	b.WriteString(`{ "model":"m"`)
	for i := range 1000 {
		fmt.Fprintf(&b, ` ,"k%d" : [%d]`, i, i)
		if i == 500 {
			b.WriteString(`,"drop":1,"set":"old"`)
		}
	}
	b.WriteString(" }")
	o, err := jsonraw.Parse(b.Bytes())
	require.NoError(t, err)
	for _, tc := range []struct {
		name      string
		del       []string
		set       []jsonraw.Member
		maxPieces int
	}{
		{"nothing changes", nil, nil, 1},
		{"drop one", []string{"drop"}, nil, 3},
		{"replace one", nil, []jsonraw.Member{m("set", `"new"`)}, 3},
		{"drop, replace and append", []string{"drop"}, []jsonraw.Member{m("set", `"new"`), m("added", "true")}, 9},
		{"drop the first", []string{"model"}, nil, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pieces := o.EditPieces(nil, tc.del, tc.set...)
			assert.LessOrEqual(t, len(pieces), tc.maxPieces)
			assert.Equal(t, string(o.Edit(tc.del, tc.set...)), string(bytes.Join(pieces, nil)))
		})
	}
}

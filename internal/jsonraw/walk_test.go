package jsonraw_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

func TestElements(t *testing.T) {
	tests := []struct {
		in   string
		want []string
	}{
		{`[]`, nil},
		{` [ ] `, nil},
		{`[1, "a" ,{"b":[2]},[ ],null]`, []string{"1", `"a"`, `{"b":[2]}`, "[ ]", "null"}},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			var got []string
			err := jsonraw.Elements([]byte(tt.in), func(v []byte) error {
				got = append(got, string(v))
				return nil
			})
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
		})
	}
}

func TestElementsErrors(t *testing.T) {
	for _, in := range []string{`{}`, `[1,]`, `[1] x`, ``, `[`} {
		t.Run(in, func(t *testing.T) {
			err := jsonraw.Elements([]byte(in), func([]byte) error { return nil })
			var se *jsonraw.SyntaxError
			assert.ErrorAs(t, err, &se)
		})
	}
	stop := errors.New("stop")
	n := 0
	err := jsonraw.Elements([]byte(`[1,2,3]`), func([]byte) error { n++; return stop })
	assert.ErrorIs(t, err, stop)
	assert.Equal(t, 1, n)
}

func TestMembers(t *testing.T) {
	in := `{"role":"user", "con\u0074ent" : [{"type":"text","text":"hi"}],"role":"x"}`
	var keys, vals []string
	err := jsonraw.Members([]byte(in), func(k string, v []byte) error {
		keys = append(keys, k)
		vals = append(vals, string(v))
		return nil
	})
	require.NoError(t, err)
	assert.Equal(t, []string{"role", "content", "role"}, keys)
	assert.Equal(t, []string{`"user"`, `[{"type":"text","text":"hi"}]`, `"x"`}, vals)

	for _, bad := range []string{`[]`, `{"a"}`, `{"a":1} 2`} {
		err := jsonraw.Members([]byte(bad), func(string, []byte) error { return nil })
		var se *jsonraw.SyntaxError
		assert.ErrorAs(t, err, &se, bad)
	}
}

func TestMembersNoAllocForCommonKeys(t *testing.T) {
	msg := []byte(`{"role":"assistant","content":"x","tool_calls":[]}`)
	fn := func(string, []byte) error { return nil }
	allocs := testing.AllocsPerRun(50, func() {
		_ = jsonraw.Members(msg, fn)
	})
	assert.Zero(t, allocs)
}

func TestLookup(t *testing.T) {
	obj := []byte(`{"index":0,"delta":{"content":"hi"},"finish_reason":null,"ind\u0065x":1}`)
	tests := []struct {
		key  string
		want string
		ok   bool
	}{
		{"index", "1", true},
		{"delta", `{"content":"hi"}`, true},
		{"finish_reason", "null", true},
		{"content", "", false},
	}
	for _, tt := range tests {
		t.Run(tt.key, func(t *testing.T) {
			v, ok := jsonraw.Lookup(obj, tt.key)
			assert.Equal(t, tt.ok, ok)
			assert.Equal(t, tt.want, string(v))
		})
	}
	_, ok := jsonraw.Lookup([]byte(`[1]`), "a")
	assert.False(t, ok)
	_, ok = jsonraw.Lookup([]byte(`{"a":`), "a")
	assert.False(t, ok)
	assert.Zero(t, testing.AllocsPerRun(50, func() { _, _ = jsonraw.Lookup(obj, "delta") }))
}

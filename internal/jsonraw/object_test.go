package jsonraw_test

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

func TestParseMembers(t *testing.T) {
	type kv struct{ k, v string }
	tests := []struct {
		name string
		in   string
		want []kv
	}{
		{"empty", `{}`, nil},
		{"empty with space", " \t\r\n{ \n } \n", nil},
		{"one", `{"a":1}`, []kv{{"a", "1"}}},
		{"whitespace everywhere", " {\n \"a\" \t: \r\n 1.50e+3 ,\n\"b\":[ 1 , 2 ] } ", []kv{{"a", "1.50e+3"}, {"b", "[ 1 , 2 ]"}}},
		{"nested", `{"m":[{"role":"user","content":"hi"}],"o":{"x":{"y":null}}}`, []kv{{"m", `[{"role":"user","content":"hi"}]`}, {"o", `{"x":{"y":null}}`}}},
		{"escaped key", `{"kv\u005ftransfer_params":{},"a\"b":true}`, []kv{{"kv_transfer_params", "{}"}, {`a"b`, "true"}}},
		{"duplicates kept in order", `{"a":1,"b":2,"a":3}`, []kv{{"a", "1"}, {"b", "2"}, {"a", "3"}}},
		{"literals", `{"t":true,"f":false,"n":null,"s":"x\ny"}`, []kv{{"t", "true"}, {"f", "false"}, {"n", "null"}, {"s", `"x\ny"`}}},
		{"numbers verbatim", `{"a":-0,"b":12345678901234567890123,"c":1E-7}`, []kv{{"a", "-0"}, {"b", "12345678901234567890123"}, {"c", "1E-7"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o, err := jsonraw.Parse([]byte(tt.in))
			require.NoError(t, err)
			require.Equal(t, len(tt.want), o.Len())
			for i, w := range tt.want {
				k, v := o.Member(i)
				assert.Equal(t, w.k, k, "key %d", i)
				assert.Equal(t, w.v, string(v), "value %d", i)
			}
		})
	}
}

func TestGetLastWins(t *testing.T) {
	o, err := jsonraw.Parse([]byte(`{"a":1,"b":2,"a":3,"\u0061":4,"c":null}`))
	require.NoError(t, err)

	v, ok := o.Get("a")
	assert.True(t, ok)
	assert.Equal(t, "4", string(v))

	v, ok = o.Get("c")
	assert.True(t, ok)
	assert.True(t, jsonraw.IsNull(v))

	_, ok = o.Get("z")
	assert.False(t, ok)
	assert.True(t, o.Has("b"))
	assert.False(t, o.Has("B"), "keys are case-sensitive")

	var want map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(o.Bytes(), &want))
	assert.Equal(t, string(want["a"]), "4", "agrees with encoding/json")
}

func TestParseErrors(t *testing.T) {
	tests := []struct {
		name   string
		in     string
		offset int
	}{
		{"empty input", "", 0},
		{"only space", "  ", 2},
		{"trailing data", `{} {}`, 3},
		{"trailing comma", `{"a":1,}`, 7},
		{"missing colon", `{"a" 1}`, 5},
		{"single quotes", `{'a':1}`, 1},
		{"unquoted key", `{a:1}`, 1},
		{"unterminated", `{"a":1`, 6},
		{"unterminated string", `{"a":"x`, 7},
		{"control char in string", "{\"a\":\"x\ty\"}", 7},
		{"bad escape", `{"a":"\x"}`, 7},
		{"short unicode escape", `{"a":"\u12"}`, 10},
		{"leading zero", `{"a":01}`, 6},
		{"bare minus", `{"a":-}`, 6},
		{"bad fraction", `{"a":1.}`, 7},
		{"bad exponent", `{"a":1e}`, 7},
		{"NaN", `{"a":NaN}`, 5},
		{"bad literal", `{"a":tru}`, 8},
		{"nested error", `{"a":[1,2,]}`, 10},
		{"non-object malformed", `[1,`, 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := jsonraw.Parse([]byte(tt.in))
			var se *jsonraw.SyntaxError
			require.ErrorAs(t, err, &se)
			assert.Equal(t, tt.offset, se.Offset, "error: %v", err)
			assert.False(t, json.Valid([]byte(tt.in)), "encoding/json agrees it is invalid")
		})
	}
}

func TestParseNotObject(t *testing.T) {
	for _, in := range []string{`[]`, `"x"`, `1`, ` null `, `true`} {
		t.Run(in, func(t *testing.T) {
			_, err := jsonraw.Parse([]byte(in))
			assert.True(t, errors.Is(err, jsonraw.ErrNotObject), "got %v", err)
		})
	}
}

func TestParseDepthLimit(t *testing.T) {
	deep := func(n int) []byte {
		return []byte(`{"a":` + strings.Repeat("[", n) + strings.Repeat("]", n) + `}`)
	}
	ok := deep(9999) // 9999 arrays + the object = encoding/json's limit of 10000
	_, err := jsonraw.Parse(ok)
	assert.NoError(t, err)
	assert.True(t, json.Valid(ok))

	tooDeep := deep(10000)
	_, err = jsonraw.Parse(tooDeep)
	assert.Error(t, err)
	assert.False(t, json.Valid(tooDeep))
}

func TestParseInvalidUTF8LikeEncodingJSON(t *testing.T) {
	in := []byte("{\"k\xff\":\"v\xfe\"}")
	require.True(t, json.Valid(in))
	o, err := jsonraw.Parse(in)
	require.NoError(t, err)
	k, v := o.Member(0)
	assert.Equal(t, "k\ufffd", k, "invalid UTF-8 in keys decodes to U+FFFD")
	s, ok := jsonraw.String(v)
	assert.True(t, ok)
	var want string
	require.NoError(t, json.Unmarshal(v, &want))
	assert.Equal(t, want, s)
}

func TestResetReusesStorage(t *testing.T) {
	var o jsonraw.Object
	docs := [][]byte{[]byte(`{"a":1,"b":2}`), []byte(`{"c":3}`)}
	require.NoError(t, o.Reset(docs[0]))
	allocs := testing.AllocsPerRun(50, func() {
		if err := o.Reset(docs[1]); err != nil {
			t.Fatal(err)
		}
	})
	assert.Zero(t, allocs)
	assert.Equal(t, 1, o.Len())
	v, _ := o.Get("c")
	assert.Equal(t, "3", string(v))

	assert.Error(t, o.Reset([]byte(`{"a":`)))
	assert.Equal(t, 0, o.Len(), "left empty on error")
	assert.ErrorIs(t, o.Reset([]byte(`[]`)), jsonraw.ErrNotObject)
}

// TestParseIntArrays checks the integer-run fast path of the scanner
// against encoding/json.
func TestParseIntArrays(t *testing.T) {
	for _, arr := range []string{
		"[1,2,3]", "[0,10,200]", "[1,2,", "[1,,2]", "[01,2]", "[1,02]", "[0,0]", "[1,-2,3]", "[1,2.5,3]",
		"[1,2e3,4]", "[1, 2,3]", "[1 ,2]", "[1,2 ]", "[1,2,3,]", "[1,2,3", "[1,2]]", "[9,99,999,9999]", "[1,2x]", "[1,2,{}]",
	} {
		in := []byte(`{"ids":` + arr + `}`)
		_, err := jsonraw.Parse(in)
		assert.Equal(t, json.Valid(in), err == nil, "%s: %v", arr, err)
	}
}

func TestDuplicate(t *testing.T) {
	for doc, want := range map[string]string{
		`{"a":1,"b":2}`:                 "",
		`{"a":1,"b":2,"a":3}`:           "a",
		`{"port":1,"\u0070ort":2}`:      "port",
		`{"\u0070ort":1,"port":2}`:      "port",
		`{"\u0070ort":1,"p\u006frt":2}`: "port",
		`{}`:                            "",
		`{"é":1,"\u00e9":2}`:            "é",
	} {
		o, err := jsonraw.Parse([]byte(doc))
		if err != nil {
			t.Fatal(err)
		}
		got, dup := o.Duplicate()
		if dup != (want != "") || got != want {
			t.Errorf("%s: Duplicate() = %q, %v; want %q", doc, got, dup, want)
		}
	}
	o, err := jsonraw.Parse([]byte(`{"remote_port":1,"remote_host":"h","remote_engine_id":"e","tp_size":1}`))
	if err != nil {
		t.Fatal(err)
	}
	if n := testing.AllocsPerRun(100, func() { o.Duplicate() }); n != 0 {
		t.Errorf("Duplicate allocates %v times", n)
	}
}

// ParseLimited bounds the members of every object, at any depth, and
// says so with a *MembersError; 0 is no bound.
func TestParseLimited(t *testing.T) {
	for _, tc := range []struct {
		name  string
		doc   string
		limit int
		err   bool
	}{
		{"within", `{"a":1,"b":{"c":2,"d":3}}`, 2, false},
		{"top level above", `{"a":1,"b":2,"c":3}`, 2, true},
		{"duplicates count", `{"a":1,"a":2,"a":3}`, 2, true},
		{"nested above", `{"a":{"b":1,"c":2,"d":3}}`, 2, true},
		{"in an array", `{"a":[1,{"b":1,"c":2,"d":3}]}`, 2, true},
		{"deep", `{"a":[[[{"x":{"b":1,"c":2,"d":3}}]]]}`, 2, true},
		{"array elements do not count", `{"a":[1,2,3,4,5]}`, 1, false},
		{"no bound", `{"a":1,"b":2,"c":3}`, 0, false},
		{"not an object", `[{"a":1,"b":2,"c":3}]`, 2, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := jsonraw.ParseLimited([]byte(tc.doc), tc.limit)
			if !tc.err {
				require.NoError(t, err)
				return
			}
			require.Error(t, err)
			if tc.name != "not an object" {
				var me *jsonraw.MembersError
				require.ErrorAs(t, err, &me)
				assert.ErrorIs(t, err, jsonraw.ErrTooManyMembers)
				assert.Equal(t, tc.limit, me.Limit)
				assert.Contains(t, err.Error(), "more than 2 members")
			}
		})
	}
}

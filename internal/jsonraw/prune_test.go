package jsonraw_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// cutA cuts members named "a" and refuses those named "r".
func cutA(key []byte) jsonraw.Verdict {
	switch string(key) {
	case "a":
		return jsonraw.Cut
	case "r":
		return jsonraw.Refuse
	}
	return jsonraw.Keep
}

func TestPrune(t *testing.T) {
	tests := []struct {
		in, want string // want "" : unchanged
	}{
		{`{"b":1}`, ""},
		{`{"a":1}`, `{}`},
		{`{ "a" : 1 }`, `{  }`},
		{`{"a":1,"b":2}`, `{"b":2}`},
		{`{"b":2,"a":1}`, `{"b":2}`},
		{`{"b":2, "a":1 ,"c":3}`, `{"b":2 ,"c":3}`},
		{`{"a":1,"a":2,"b":3,"a":4}`, `{"b":3}`},
		{`{"a":1,"a":2}`, `{}`},
		{`{"b":{"c":[{"a":{"r":1}},{"d":1,"a":2}]}}`, `{"b":{"c":[{},{"d":1}]}}`},
		{`[{"\u0061":1},{"x":"\u0061"}]`, `[{},{"x":"\u0061"}]`},
		{`{"\ud83d\ude00":1,"a":1e999}`, `{"\ud83d\ude00":1}`},
		{"{\"a\xff\":1,\"\\u0061\":2}", "{\"a\xff\":1}"},
		{`"a"`, ""},
		{`[1,2,3,{"b":[[],{}]}]`, ""},
		{`{"b":"{\"a\":1}"}`, ""},
	}
	for _, tt := range tests {
		out, changed, err := jsonraw.Prune(nil, []byte(tt.in), cutA)
		if err != nil {
			t.Fatalf("%s: %v", tt.in, err)
		}
		want := tt.want
		if want == "" {
			want = tt.in
		}
		if string(out) != want || changed != (tt.want != "") {
			t.Errorf("Prune(%s) = %s, %v; want %s", tt.in, out, changed, want)
		}
	}
}

func TestPruneErrors(t *testing.T) {
	for _, in := range []string{`{"a":1`, `{"a":1,}`, `{"b":{"a":x}}`, `{"a":1} 1`, ``, `[`, "{\"b\":\"\x01\"}"} {
		_, _, err := jsonraw.Prune(nil, []byte(in), cutA)
		var se *jsonraw.SyntaxError
		if !errors.As(err, &se) {
			t.Errorf("Prune(%q) = %v, want a syntax error", in, err)
		}
	}
	for _, in := range []string{`{"r":1}`, `[{"b":{"\u0072":1}}]`, `{"a":{"r":1},"r":2}`} {
		_, _, err := jsonraw.Prune(nil, []byte(in), cutA)
		if !errors.Is(err, jsonraw.ErrRefused) {
			t.Errorf("Prune(%s) = %v, want ErrRefused", in, err)
		}
	}
	// A refused member inside a cut one is never looked at.
	if out, _, err := jsonraw.Prune(nil, []byte(`{"a":{"r":1}}`), cutA); err != nil || string(out) != `{}` {
		t.Errorf("got %s, %v", out, err)
	}
}

func TestPruneAppendsToDst(t *testing.T) {
	dst := []byte("x:")
	out, changed, err := jsonraw.Prune(dst, []byte(`{"a":1,"b":2}`), cutA)
	if err != nil || !changed || string(out) != `x:{"b":2}` {
		t.Fatalf("got %s %v %v", out, changed, err)
	}
}

// tokens returns the JSON tokens of data as encoding/json reads them
// (numbers as written), without the subtrees of members named skip.
func tokens(t *testing.T, data []byte, skip string) []string {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var out []string
	type frame struct{ object, wantKey bool }
	var stack []frame
	// valueDone records that a value ended: in an object, a name is next.
	valueDone := func() {
		if n := len(stack); n > 0 && stack[n-1].object {
			stack[n-1].wantKey = true
		}
	}
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatalf("encoding/json: %v on %q", err, data)
		}
		if d, ok := tok.(json.Delim); ok && (d == '}' || d == ']') {
			stack = stack[:len(stack)-1]
			out = append(out, d.String())
			valueDone()
			continue
		}
		if n := len(stack); n > 0 && stack[n-1].wantKey {
			name := tok.(string)
			stack[n-1].wantKey = false
			if name == skip {
				var v json.RawMessage
				if err := dec.Decode(&v); err != nil {
					t.Fatalf("encoding/json: %v", err)
				}
				valueDone()
				continue
			}
			out = append(out, "key:"+name)
			continue
		}
		switch v := tok.(type) {
		case json.Delim:
			stack = append(stack, frame{object: v == '{', wantKey: v == '{'})
			out = append(out, v.String())
			continue
		case string:
			out = append(out, "str:"+v)
		case json.Number:
			out = append(out, "num:"+v.String())
		default:
			b, _ := json.Marshal(v)
			out = append(out, string(b))
		}
		valueDone()
	}
}

// FuzzPrune checks Prune against encoding/json: it accepts exactly the
// valid documents (unless it refuses one), and what it returns reads, token
// by token, as the input without the members named "a" at any depth.
func FuzzPrune(f *testing.F) {
	for _, s := range []string{
		`{"a":1}`, `{"b":[{"a":{"c":1}},{"a":2,"d":3}],"a":4}`, `[{"\u0061":1},{"\u0061":{"r":1}}]`,
		` { "x" : 1 , "a" : [ ] } `, `{"a":1,"a":2,"b":"a"}`, `{"r":1}`, `[[[[{"a":1e999}]]]]`,
		"{\"\xff\":{\"a\":\"\xfe\"}}", `{"b":{"a":1},}`, `"a"`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		out, changed, err := jsonraw.Prune(nil, data, cutA)
		valid := json.Valid(data)
		if err != nil {
			if errors.Is(err, jsonraw.ErrRefused) {
				if !valid && !strings.Contains(string(data), "r") && !strings.Contains(string(data), `\u`) {
					t.Fatalf("refused without an r: %q", data)
				}
				return
			}
			if valid {
				t.Fatalf("Prune rejects valid %q: %v", data, err)
			}
			return
		}
		if !valid {
			t.Fatalf("Prune accepts invalid %q", data)
		}
		if !changed && !bytes.Equal(out, data) {
			t.Fatalf("unchanged but different: %q -> %q", data, out)
		}
		if !json.Valid(out) {
			t.Fatalf("Prune(%q) = %q is not valid JSON", data, out)
		}
		want := tokens(t, data, "a")
		got := tokens(t, out, "\x00never")
		if strings.Join(got, "\x01") != strings.Join(want, "\x01") {
			t.Fatalf("Prune(%q) = %q:\n got %q\nwant %q", data, out, got, want)
		}
		if changed == (len(tokens(t, data, "\x00never")) == len(want)) {
			t.Fatalf("changed = %v for %q", changed, data)
		}
	})
}

// FuzzPruneValid: on valid JSON, PruneValid gives what Prune gives; on
// anything else it never panics.
func FuzzPruneValid(f *testing.F) {
	for _, s := range []string{
		`{"a":1}`, `{"b":[{"a":{"c":1}},{"a":2,"d":3}],"a":4}`, `[{"\u0061":1},{"\u0061":{"r":1}}]`,
		` { "x" : 1 , "a" : [ [1,2] , [ ] ] } `, `{"a":[[1,2],["]"]],"b":[1,{"a":1}]}`, `{"r":1}`, `[[[[{"a":1e999}]]]]`,
		`{"k":{"a":[[10000,10001],[3]],"e":"x"},"z":[true,null,1.5]}`, `{"a":[1,2`, `[1,"]"]`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		out, changed, err := jsonraw.PruneValid(nil, data, cutA)
		if !json.Valid(data) {
			return
		}
		want, wantChanged, wantErr := jsonraw.Prune(nil, data, cutA)
		if (err == nil) != (wantErr == nil) || errors.Is(err, jsonraw.ErrRefused) != errors.Is(wantErr, jsonraw.ErrRefused) {
			t.Fatalf("%q: PruneValid err %v, Prune err %v", data, err, wantErr)
		}
		if changed != wantChanged || !bytes.Equal(out, want) {
			t.Fatalf("%q: PruneValid %q %v, Prune %q %v", data, out, changed, want, wantChanged)
		}
	})
}

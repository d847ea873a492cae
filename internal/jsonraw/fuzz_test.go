package jsonraw_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"testing"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

func FuzzParse(f *testing.F) {
	for _, s := range []string{
		`{}`, `{"a":1}`, ` {"a" : [1,{"b":null}], "a":"x\u0041"} `, `[]`, `"s"`, `{"a":1,}`,
		`[1,"a\\",{"b\"":[]}]`, `["\\\""]`,
		`{"kv\u005ftransfer_params":{"remote_block_ids":[[1,2]]}}`, "{\"\xff\":1}", `{"a":1e+5,"b":-0.5E-3}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		// The trusting walkers must never panic, whatever the input.
		_ = jsonraw.Elements(data, func([]byte) error { return nil })
		_ = jsonraw.Members(data, func(string, []byte) error { return nil })

		valid := json.Valid(data)
		checkElements(t, data, valid)
		if got := jsonraw.Valid(data); got != valid {
			t.Fatalf("Valid = %v, json.Valid = %v", got, valid)
		}
		trimmed := bytes.TrimLeft(data, " \t\r\n")
		isObj := valid && len(trimmed) > 0 && trimmed[0] == '{'
		o, err := jsonraw.Parse(data)
		if (err == nil) != isObj {
			t.Fatalf("Parse err = %v, want object %v", err, isObj)
		}
		checkLimited(t, data, valid, isObj)
		if err != nil {
			var se *jsonraw.SyntaxError
			if valid != !errors.As(err, &se) || (valid && !errors.Is(err, jsonraw.ErrNotObject)) {
				t.Fatalf("wrong error kind %v for valid=%v", err, valid)
			}
			return
		}
		var want map[string]json.RawMessage
		if err := json.Unmarshal(data, &want); err != nil {
			t.Fatalf("encoding/json rejects accepted object: %v", err)
		}
		seen := map[string]bool{}
		for i := 0; i < o.Len(); i++ {
			k, _ := o.Member(i)
			seen[k] = true
		}
		if len(seen) != len(want) {
			t.Fatalf("%d distinct keys, encoding/json has %d", len(seen), len(want))
		}
		for k, w := range want {
			v, ok := o.Get(k)
			if !ok || !bytes.Equal(v, w) {
				t.Fatalf("Get(%q) = %q, %v; want %q", k, v, ok, w)
			}
		}
		n := 0
		if err := jsonraw.Members(data, func(k string, v []byte) error {
			mk, mv := o.Member(n)
			if k != mk || !bytes.Equal(v, mv) {
				t.Fatalf("Members disagrees with Member at %d", n)
			}
			n++
			return nil
		}); err != nil || n != o.Len() {
			t.Fatalf("Members: %v after %d of %d", err, n, o.Len())
		}
	})
}

func FuzzEdit(f *testing.F) {
	f.Add([]byte(`{"a":1,"b":2,"a":3}`), "a", "b", []byte(`[1]`))
	f.Add([]byte(` { } `), "", "k", []byte(`"v"`))
	f.Add([]byte("{\n \"x\" : 1 ,\n \"kv\\u005ftransfer_params\":{}\n}"), "kv_transfer_params", "stream", []byte(`false`))
	f.Add([]byte(`{"a":1}`), "a", "a", []byte(` 2 `))
	f.Fuzz(func(t *testing.T, data []byte, del, key string, val []byte) {
		o, err := jsonraw.Parse(data)
		if err != nil {
			return
		}
		if !json.Valid(val) {
			val = []byte("null")
		}
		// Keys are documented to be valid UTF-8 (decoded keys always are).
		del, key = string([]rune(del)), string([]rune(key))
		out := o.Edit([]string{del}, jsonraw.Member{Key: key, Value: val})
		if joined := bytes.Join(o.EditPieces(nil, []string{del}, jsonraw.Member{Key: key, Value: val}), nil); !bytes.Equal(joined, out) {
			t.Fatalf("EditPieces joined = %q, Edit %q", joined, out)
		}
		// AppendEdit: the same bytes after what dst held, and changed
		// exactly when Edit did not return the document itself.
		appended, changed := o.AppendEdit([]byte("pre"), []string{del}, jsonraw.Member{Key: key, Value: val})
		if !bytes.Equal(appended, append([]byte("pre"), out...)) {
			t.Fatalf("AppendEdit = %q, want %q after pre", appended, out)
		}
		if same := len(out) > 0 && len(data) > 0 && &out[0] == &data[0]; changed == same {
			t.Fatalf("AppendEdit changed = %v, Edit returned the document itself: %v", changed, same)
		}
		got, err := jsonraw.Parse(out)
		if err != nil || !json.Valid(out) {
			t.Fatalf("Edit output invalid (%v): %q", err, out)
		}
		// Expected member sequence.
		type kv struct {
			k string
			v []byte
		}
		var want []kv
		placed := false
		for i := 0; i < o.Len(); i++ {
			k, v := o.Member(i)
			switch {
			case k == del:
			case k == key && !placed:
				want = append(want, kv{k, val})
				placed = true
			case k == key:
			default:
				want = append(want, kv{k, v})
			}
		}
		if !placed {
			want = append(want, kv{key, val})
		}
		if got.Len() != len(want) {
			t.Fatalf("got %d members, want %d: %q", got.Len(), len(want), out)
		}
		for i, w := range want {
			k, v := got.Member(i)
			if k != w.k || !bytes.Equal(v, bytes.Trim(w.v, " \t\r\n")) {
				t.Fatalf("member %d = %q:%q, want %q:%q", i, k, v, w.k, w.v)
			}
		}
		var m map[string]json.RawMessage
		if err := json.Unmarshal(out, &m); err != nil {
			t.Fatalf("encoding/json: %v", err)
		}
	})
}

func checkElements(t *testing.T, data []byte, valid bool) {
	var want []json.RawMessage
	// null decodes into a nil slice without error: it is no array.
	if !valid || json.Unmarshal(data, &want) != nil || want == nil {
		return
	}
	i := 0
	err := jsonraw.Elements(data, func(v []byte) error {
		if i >= len(want) || !bytes.Equal(v, want[i]) {
			t.Fatalf("element %d = %q", i, v)
		}
		i++
		return nil
	})
	if err != nil || i != len(want) {
		t.Fatalf("Elements: %v after %d of %d", err, i, len(want))
	}
}

// FuzzStringPieces checks that StringPieces and StringBytes decode every
// input as String does, and StringPiecesTrusted every well-formed one (and
// never panics on the others).
func FuzzStringPieces(f *testing.F) {
	for _, s := range []string{`"plain"`, `"a\"b\\c\/d\b\f\n\r\t"`, `"\ud83d\ude00"`, `"\ud83dx"`, "\"\xff\xfe\"", `"\q"`, `"x`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, v []byte) {
		want, ok := jsonraw.String(v)
		var got []byte
		if jsonraw.StringPieces(v, func(p []byte) { got = append(got, p...) }) != ok {
			t.Fatalf("StringPieces(%q): ok differs from String's %v", v, ok)
		}
		if ok && string(got) != want {
			t.Fatalf("StringPieces(%q) = %q, String %q", v, got, want)
		}
		var trusted []byte
		tok := jsonraw.StringPiecesTrusted(v, func(p []byte) { trusted = append(trusted, p...) })
		if ok && (!tok || string(trusted) != want) {
			t.Fatalf("StringPiecesTrusted(%q) = %q %v, String %q", v, trusted, tok, want)
		}
		b, _, ok2 := jsonraw.StringBytes(v, nil)
		if ok2 != ok || (ok && string(b) != want) {
			t.Fatalf("StringBytes(%q) = %q %v, String %q %v", v, b, ok2, want, ok)
		}
	})
}

// checkLimited checks ParseLimited against the most members any object of
// data has, counted by encoding/json, for a few limits around it.
func checkLimited(t *testing.T, data []byte, valid, isObj bool) {
	t.Helper()
	most := -1
	if valid {
		most = mostMembers(t, data)
	}
	for _, limit := range []int{0, 1, 2, 3, most, most + 1} {
		_, err := jsonraw.ParseLimited(data, limit)
		switch {
		case !valid || !isObj:
			if err == nil {
				t.Fatalf("ParseLimited(%d) accepts what Parse refuses", limit)
			}
		case limit > 0 && most > limit:
			var me *jsonraw.MembersError
			if !errors.Is(err, jsonraw.ErrTooManyMembers) || !errors.As(err, &me) || me.Limit != limit {
				t.Fatalf("ParseLimited(%d) with an object of %d members: %v", limit, most, err)
			}
		case err != nil:
			t.Fatalf("ParseLimited(%d), at most %d members: %v", limit, most, err)
		}
	}
}

// mostMembers returns the most members of any object in the valid
// document data (0 without objects).
func mostMembers(t *testing.T, data []byte) int {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	type frame struct {
		object  bool
		members int
		key     bool // the next token of an object is a key
	}
	var stack []frame
	most := 0
	for {
		tok, err := dec.Token()
		if err != nil {
			return most
		}
		if n := len(stack); n > 0 && stack[n-1].object {
			top := &stack[n-1]
			if d, ok := tok.(json.Delim); ok && d == '}' {
				most = max(most, top.members)
				stack = stack[:n-1]
				continue
			}
			if top.key {
				top.members++
				top.key = false
				continue
			}
			top.key = true
		}
		switch tok {
		case json.Delim('{'):
			stack = append(stack, frame{object: true, key: true})
		case json.Delim('['):
			stack = append(stack, frame{})
		case json.Delim(']'):
			stack = stack[:len(stack)-1]
		}
	}
}

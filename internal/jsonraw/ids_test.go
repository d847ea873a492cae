package jsonraw_test

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// refUint32s is the oracle for AppendUint32s on a whole document: an
// array of integers in [0, 2^32) with plain digits, by encoding/json.
func refUint32s(b []byte) ([]uint32, bool) {
	// Raw elements first: encoding/json also decodes a string holding a
	// number ("0") into a json.Number, and a token id is never a string.
	var raw []json.RawMessage
	if !json.Valid(b) || json.Unmarshal(b, &raw) != nil || raw == nil {
		return nil, false
	}
	out := make([]uint32, 0, len(raw))
	for _, r := range raw {
		if len(r) == 0 || r[0] < '0' || r[0] > '9' {
			return nil, false
		}
		n := json.Number(r)
		s := string(n)
		if strings.ContainsAny(s, ".eE-") || len(s) > 10 {
			return nil, false
		}
		v, err := n.Int64()
		if err != nil || v > 1<<32-1 {
			return nil, false
		}
		out = append(out, uint32(v))
	}
	return out, true
}

func TestAppendUint32s(t *testing.T) {
	for _, c := range []struct {
		in   string
		want []uint32
		end  int
		ok   bool
	}{
		{`[]`, []uint32{}, 2, true},
		{` [ 1 , 22,333 ]x`, []uint32{1, 22, 333}, 15, true},
		{`[0,9,10,1234567,12345678,123456789,4294967295]`, []uint32{0, 9, 10, 1234567, 12345678, 123456789, 4294967295}, 46, true},
		{`[4294967296]`, nil, 0, false},
		{`[12345678901]`, nil, 0, false},
		{`[00]`, nil, 0, false},
		{`[0012345,1]`, nil, 0, false},
		{`[1,]`, nil, 0, false},
		{`[1`, nil, 0, false},
		{`[1.5]`, nil, 0, false},
		{`[-1]`, nil, 0, false},
		{`["1"]`, nil, 0, false},
		{`{}`, nil, 0, false},
	} {
		got, end, ok := jsonraw.AppendUint32s([]uint32{}, []byte(c.in), 0)
		assert.Equal(t, c.ok, ok, c.in)
		if c.ok {
			assert.Equal(t, c.want, got, c.in)
			assert.Equal(t, c.end, end, c.in)
		} else {
			assert.Empty(t, got, c.in)
		}
	}
}

// TestAppendUint32sLong runs long arrays, the 64-byte block path's input,
// against encoding/json: valid ones with ids of every length and spacing,
// and each with one byte changed to a character that breaks it or not.
func TestAppendUint32sLong(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for range 300 {
		var b []byte
		b = append(b, '[')
		for j := range 10 + rng.IntN(60) {
			if j > 0 {
				b = append(b, ',')
				if rng.IntN(10) == 0 {
					b = append(b, ' ')
				}
			}
			b = strconv.AppendUint(b, uint64(rng.Uint32())>>(rng.IntN(33)), 10)
		}
		b = append(b, ']')
		variants := [][]byte{b}
		for range 8 {
			v := bytes.Clone(b)
			const breakers = ",0 ]x\x80-9"
			v[1+rng.IntN(len(v)-2)] = breakers[rng.IntN(len(breakers))]
			variants = append(variants, v)
		}
		for _, v := range variants {
			want, wantOK := refUint32s(v)
			got, end, ok := jsonraw.AppendUint32s(nil, v, 0)
			ok = ok && end == len(v)
			require.Equal(t, wantOK, ok, "%s", v)
			if ok {
				require.Equal(t, want, got, "%s", v)
			}
		}
	}
}

func TestResetIDs(t *testing.T) {
	var o jsonraw.Object
	doc := []byte(`{"a":1,"prompt_token_ids":[5,6,7],"b":[1]}`)
	ids, m, err := o.ResetIDs(doc, "prompt_token_ids", nil)
	require.NoError(t, err)
	assert.Equal(t, 1, m)
	assert.Equal(t, []uint32{5, 6, 7}, ids)
	v, _ := o.Get("b")
	assert.Equal(t, `[1]`, string(v))

	// Not converted: a duplicate, an escaped key, a value of another shape.
	for _, d := range []string{
		`{"prompt_token_ids":[1],"prompt_token_ids":[2]}`,
		`{"prompt\u005ftoken_ids":[1]}`,
		`{"prompt\u005ftoken_ids":[1],"prompt_token_ids":[2]}`,
		`{"prompt_token_ids":[2],"prompt\u005ftoken_ids":[1]}`,
		`{"prompt_token_ids":[1.0]}`,
		`{"prompt_token_ids":null}`,
		`{"x":{"prompt_token_ids":[1]}}`,
	} {
		_, m, err := o.ResetIDs([]byte(d), "prompt_token_ids", nil)
		require.NoError(t, err, d)
		assert.Equal(t, -1, m, d)
	}
	// Malformed: the same error as Reset's.
	for _, d := range []string{`{"prompt_token_ids":[1,2}`, `{"prompt_token_ids":[1,2]`, `{"prompt_token_ids":[01]}`, `{"prompt_token_ids":[1]} x`, `[1]`} {
		_, m, err := o.ResetIDs([]byte(d), "prompt_token_ids", nil)
		var p jsonraw.Object
		want := p.Reset([]byte(d))
		require.Error(t, err, d)
		assert.Equal(t, want.Error(), err.Error(), d)
		assert.Equal(t, -1, m, d)
	}
}

// FuzzResetIDs checks ResetIDs against Reset (same verdict, error and
// members) and the ids it converts against encoding/json.
func FuzzResetIDs(f *testing.F) {
	for _, s := range []string{
		`{"k":[1,2,3]}`, `{"a":"x","k":[ 1 , 22 ,333]}`, `{"k":[1,2}`, `{"k":[01]}`, `{"k":[4294967296]}`,
		`{"k":[1],"k":[2]}`, `{"k\u0000":[1]}`, `{"k":[1e3]}`, `{"k":[]}`, `{"k":[123456789,1234567890]}`, `[1]`,
		`{"k":[1,22,333,4444,55555,666666,7777777,88888888,999999999,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20]}`,
		`{"k":[1,22,333,4444,55555,666666,7777777,,88888888,999999999,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20]}`,
		`{"k":[1,22,333,4444,55555,666666,07777777,88888888,999999999,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20]}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var a, b jsonraw.Object
		ids, m, err := a.ResetIDs(data, "k", nil)
		want := b.Reset(data)
		if (err == nil) != (want == nil) || (err != nil && err.Error() != want.Error()) {
			t.Fatalf("ResetIDs err %v, Reset err %v", err, want)
		}
		if err != nil {
			if m != -1 {
				t.Fatalf("member %d on error", m)
			}
			return
		}
		sameMembers(t, a, b)
		if m < 0 {
			// Without escapes or nested objects, the one spelling of the
			// key holding an id array must have been converted.
			if bytes.Count(data, []byte(`"k"`)) == 1 && bytes.Count(data, []byte{'{'}) == 1 && !bytes.Contains(data, []byte(`\`)) {
				if v, ok := a.Get("k"); ok {
					if _, ok := refUint32s(v); ok {
						t.Fatalf("an id array was not converted: %q", data)
					}
				}
			}
			return
		}
		k, v := a.Member(m)
		if k != "k" {
			t.Fatalf("member %d is %q", m, k)
		}
		ref, ok := refUint32s(v)
		if !ok || len(ref) != len(ids) {
			t.Fatalf("converted %v, encoding/json %v (%v)", ids, ref, ok)
		}
		for i := range ref {
			if ref[i] != ids[i] {
				t.Fatalf("converted %v, encoding/json %v", ids, ref)
			}
		}
	})
}

func TestResetIDsKnown(t *testing.T) {
	known := []byte(`[5,6,7]`)
	for _, c := range []struct {
		doc    string
		member int
		same   bool
		ids    []uint32 // converted when not the same
	}{
		{`{"a":1,"k":[5,6,7],"b":[1]}`, 1, true, nil},
		{`{"k": [5,6,7] }`, 0, true, nil},
		{`{"k":[5,6,8]}`, 0, false, []uint32{5, 6, 8}},         // one id differs
		{`{"k":[5, 6,7]}`, 0, false, []uint32{5, 6, 7}},        // spacing differs
		{`{"k":[5,6,7,8]}`, 0, false, []uint32{5, 6, 7, 8}},    // longer
		{`{"k":[5,6]}`, 0, false, []uint32{5, 6}},              // shorter
		{`{"x":[5,6,7],"k":[1]}`, 1, false, []uint32{1}},       // known's bytes under another key
		{`{"x":{"k":[5,6,7]},"k":[1]}`, 1, false, []uint32{1}}, // nested, not top level
		{`{"k":[5,6,7],"k":[5,6,7]}`, -1, false, nil},          // a duplicate
		{`{"k\u0000":[5,6,7]}`, -1, false, nil},                // another key
		{`{"k":[5,6,7],"\u006b":[1]}`, -1, false, nil},         // the key again, escaped
	} {
		var o jsonraw.Object
		buf := make([]uint32, 0, 8)
		ids, m, same, err := o.ResetIDsKnown([]byte(c.doc), "k", buf, known)
		require.NoError(t, err, c.doc)
		assert.Equal(t, c.member, m, c.doc)
		assert.Equal(t, c.same, same, c.doc)
		if c.same {
			assert.Empty(t, ids, c.doc) // the caller's ids are known's
		} else if m >= 0 {
			assert.Equal(t, c.ids, ids, c.doc)
		}
		var p jsonraw.Object
		require.NoError(t, p.Reset([]byte(c.doc)))
		require.Equal(t, p.Len(), o.Len(), c.doc)
		for i := range p.Len() {
			kp, vp := p.Member(i)
			ko, vo := o.Member(i)
			assert.Equal(t, kp, ko, c.doc)
			assert.Equal(t, string(vp), string(vo), c.doc)
		}
	}
	// Truncated or broken after known's bytes: the same error as Reset's.
	for _, d := range []string{`{"k":[5,6,7]`, `{"k":[5,6,7]]}`, `{"k":[5,6,7],}`, `{"k":[5,6,7] x}`, `{"k":[5,6,`, `{"k":[5,6,7]}x`} {
		var o, p jsonraw.Object
		_, m, same, err := o.ResetIDsKnown([]byte(d), "k", nil, known)
		want := p.Reset([]byte(d))
		require.Error(t, err, d)
		assert.Equal(t, want.Error(), err.Error(), d)
		assert.Equal(t, -1, m, d)
		assert.False(t, same, d)
	}
	// A known text that is not an array's is not used.
	var o jsonraw.Object
	ids, m, same, err := o.ResetIDsKnown([]byte(`{"k":[5,6,7]}`), "k", nil, []byte(`[5,6,7`))
	require.NoError(t, err)
	assert.Equal(t, 0, m)
	assert.False(t, same)
	assert.Equal(t, []uint32{5, 6, 7}, ids)
}

// FuzzResetIDsKnown checks ResetIDsKnown against Reset (same verdict,
// error and members) and against ResetIDs: the same member, and when it
// takes the value as known's, the ids ResetIDs converts from it are
// known's. known is an id array as a render answer spells it, taken from
// the fuzzer's ids; the document is arbitrary (seeded with known's text
// in place, altered in one id, in spacing, truncated).
func FuzzResetIDsKnown(f *testing.F) {
	for _, s := range []struct{ doc, known string }{
		{`{"a":"x","k":[1,2,3],"b":1}`, `[1,2,3]`},
		{`{"k":[1,2,4]}`, `[1,2,3]`},
		{`{"k":[1, 2,3]}`, `[1,2,3]`},
		{`{"k":[1,2,3`, `[1,2,3]`},
		{`{"k":[1,2,3]`, `[1,2,3]`},
		{`{"k":[1,2,3]]}`, `[1,2,3]`},
		{`{"k":[1,2,3],"k":[1,2,3]}`, `[1,2,3]`},
		{`{"k":[1,2,3,4]}`, `[1,2,3]`},
		{`{"k":[]}`, `[]`},
		{`{"k":[1,22,333,4444,55555,666666,7777777,88888888,999999999,1,2,3,4,5,6,7,8,9,10]}`, `[1,22,333,4444,55555,666666,7777777,88888888,999999999,1,2,3,4,5,6,7,8,9,10]`},
	} {
		f.Add([]byte(s.doc), []byte(s.known))
	}
	f.Fuzz(func(t *testing.T, data, knownIn []byte) {
		// known must be an id array AppendUint32s accepts in full: the
		// fuzzer's bytes when they are one, else none.
		knownIDs, end, ok := jsonraw.AppendUint32s(nil, knownIn, 0)
		var known []byte
		if ok && end == len(knownIn) && len(knownIn) > 0 && knownIn[0] == '[' {
			known = knownIn
		}
		var a, b, c jsonraw.Object
		ids, m, same, err := a.ResetIDsKnown(data, "k", nil, known)
		refIDs, refM, refErr := c.ResetIDs(data, "k", nil)
		want := b.Reset(data)
		if (err == nil) != (want == nil) || (err != nil && err.Error() != want.Error()) {
			t.Fatalf("ResetIDsKnown err %v, Reset err %v", err, want)
		}
		if (refErr == nil) != (err == nil) {
			t.Fatalf("ResetIDsKnown err %v, ResetIDs err %v", err, refErr)
		}
		if err != nil {
			if m != -1 || same {
				t.Fatalf("member %d, same %v on error", m, same)
			}
			return
		}
		sameMembers(t, a, b)
		if m != refM {
			t.Fatalf("member %d, ResetIDs %d", m, refM)
		}
		if m < 0 {
			if same {
				t.Fatal("same without a member")
			}
			return
		}
		if !same {
			if len(ids) != len(refIDs) {
				t.Fatalf("converted %v, ResetIDs %v", ids, refIDs)
			}
			for i := range ids {
				if ids[i] != refIDs[i] {
					t.Fatalf("converted %v, ResetIDs %v", ids, refIDs)
				}
			}
			if known != nil {
				if _, v := a.Member(m); bytes.Equal(v, known) {
					t.Fatalf("known's bytes not taken as known: %q", v)
				}
			}
			return
		}
		if known == nil {
			t.Fatal("same without known")
		}
		_, v := a.Member(m)
		if !bytes.Equal(v, known) {
			t.Fatalf("value %q taken as known %q", v, known)
		}
		if len(ids) != 0 || len(refIDs) != len(knownIDs) {
			t.Fatalf("ids %v; ResetIDs %v, known %v", ids, refIDs, knownIDs)
		}
		for i := range refIDs {
			if refIDs[i] != knownIDs[i] {
				t.Fatalf("ResetIDs %v, known %v", refIDs, knownIDs)
			}
		}
	})
}

// sameMembers fails t unless a and b hold the same members, in order.
func sameMembers(t *testing.T, a, b jsonraw.Object) {
	t.Helper()
	if a.Len() != b.Len() {
		t.Fatalf("%d members, Reset %d", a.Len(), b.Len())
	}
	for i := range a.Len() {
		ka, va := a.Member(i)
		kb, vb := b.Member(i)
		if ka != kb || !bytes.Equal(va, vb) {
			t.Fatalf("member %d differs", i)
		}
	}
}

package jsonraw_test

import (
	"bytes"
	"encoding/json"
	"math"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

func TestIntLists(t *testing.T) {
	long := strings.Repeat("12345,", 300) + "7"
	for _, c := range []struct {
		v     string
		limit uint64
		want  jsonraw.Lists
		ok    bool
	}{
		{`[]`, 9, jsonraw.Lists{}, true},
		{`[ ]`, 9, jsonraw.Lists{}, true},
		{`[[]]`, 9, jsonraw.Lists{Nested: true, Lists: 1}, true},
		{`[[1,2,3],[4]]`, 9, jsonraw.Lists{Nested: true, Lists: 2, Longest: 3}, true},
		{`[ [ 1 , 2 ] ,[3,4,5]	]`, 9, jsonraw.Lists{Nested: true, Lists: 2, Longest: 3}, true},
		{`[5,6,7]`, 9, jsonraw.Lists{Longest: 3}, true},
		{`[[` + long + `]]`, math.MaxInt32, jsonraw.Lists{Nested: true, Lists: 1, Longest: 301}, true},
		{`[[` + long + `],[` + long + `,8]]`, math.MaxInt32, jsonraw.Lists{Nested: true, Lists: 2, Longest: 302}, true},
		{`[[0,10,2147483647]]`, math.MaxInt32, jsonraw.Lists{Nested: true, Lists: 1, Longest: 3}, true},
		{`[[1234567,12345678,0,0,0]]`, math.MaxInt32, jsonraw.Lists{Nested: true, Lists: 1, Longest: 5}, true},
		{`[[2147483648]]`, math.MaxInt32, jsonraw.Lists{}, false},
		{`[[1,2,3,10]]`, 9, jsonraw.Lists{}, false},
		{`[[1],2]`, 9, jsonraw.Lists{}, false},
		{`[1,[2]]`, 9, jsonraw.Lists{}, false},
		{`[[-1]]`, 9, jsonraw.Lists{}, false},
		{`[[1.5]]`, 9, jsonraw.Lists{}, false},
		{`[[1e3]]`, 9999, jsonraw.Lists{}, false},
		{`[[01]]`, 9, jsonraw.Lists{}, false},
		{`[[1,02,3,4,5,6,7]]`, math.MaxInt32, jsonraw.Lists{}, false},
		{`[[1,,2,3,4,5,6,7]]`, math.MaxInt32, jsonraw.Lists{}, false},
		{`[[1,2,3,4,5,6,7,]]`, math.MaxInt32, jsonraw.Lists{}, false},
		{`[["1"]]`, 9, jsonraw.Lists{}, false},
		{`[[1]] `, 9, jsonraw.Lists{}, false},
		{`[[1]`, 9, jsonraw.Lists{}, false},
		{`[[[1]]]`, 9, jsonraw.Lists{}, false},
		{`null`, 9, jsonraw.Lists{}, false},
		{`[[99999999999999999999]]`, math.MaxInt32, jsonraw.Lists{}, false},
	} {
		got, ok := jsonraw.IntLists([]byte(c.v), c.limit)
		assert.Equal(t, c.ok, ok, "%.60s", c.v)
		if ok {
			assert.Equal(t, c.want, got, "%.60s", c.v)
		}
	}
}

// FuzzIntLists compares IntLists with encoding/json: a value it accepts is
// valid JSON that decodes to arrays of integers, each spelled with digits
// only and at most limit, in one shape (arrays of arrays, or of integers),
// with the shape it reports; a value it refuses is not.
func FuzzIntLists(f *testing.F) {
	for _, s := range []string{`[]`, `[[1,2,3],[4]]`, `[ [ 1 , 2 ] ]`, `[5,6,7]`, `[[01]]`, `[[1],2]`, `[[1.5]]`,
		`[[10000,10001,10002,10003,10004,10005,10006,10007,10008]]`, `[[1234567,12345678,123456789,1234567890,4294967296]]`,
		`[[0,0,0,0,0,0,0,0,0,0,0,0],[0,00]]`, `[[1,2,3,4,5,6,7,8,9],[1,2,3,4,5,6,7,8,9, 10]]`} {
		f.Add([]byte(s), uint32(math.MaxInt32))
		f.Add([]byte(s), uint32(9))
	}
	literal := regexp.MustCompile(`^(0|[1-9][0-9]*)$`)
	f.Fuzz(func(t *testing.T, v []byte, lim uint32) {
		limit := uint64(lim)
		got, ok := jsonraw.IntLists(v, limit)
		want, wantOK := intListsOracle(v, limit, literal)
		if ok != wantOK || (ok && got != want) {
			t.Fatalf("IntLists(%q, %d) = %+v, %v; want %+v, %v", v, limit, got, ok, want, wantOK)
		}
	})
}

func intListsOracle(v []byte, limit uint64, literal *regexp.Regexp) (jsonraw.Lists, bool) {
	var sh jsonraw.Lists
	if !json.Valid(v) || len(v) == 0 || v[0] != '[' || v[len(v)-1] != ']' {
		return sh, false
	}
	isInt := func(e json.RawMessage) bool {
		s := string(bytes.TrimSpace(e))
		if !literal.MatchString(s) {
			return false
		}
		n, err := strconv.ParseUint(s, 10, 64)
		return err == nil && n <= limit
	}
	var outer []json.RawMessage
	if json.Unmarshal(v, &outer) != nil {
		return sh, false
	}
	for k, e := range outer {
		e = bytes.TrimSpace(e)
		nested := len(e) > 0 && e[0] == '['
		if k > 0 && nested != sh.Nested {
			return sh, false
		}
		sh.Nested = nested
		if !nested {
			if !isInt(e) {
				return sh, false
			}
			sh.Longest++
			continue
		}
		var inner []json.RawMessage
		if json.Unmarshal(e, &inner) != nil {
			return sh, false
		}
		for _, x := range inner {
			if !isInt(x) {
				return sh, false
			}
		}
		sh.Lists++
		sh.Longest = max(sh.Longest, len(inner))
	}
	return sh, true
}

// BenchmarkIntLists reads the block ids of a 100k-token handle: 6,250
// five-digit ids in one list, in the tight loop over runs of short
// integers (runs) and, with a limit below the one that takes, element by
// element (elements).
func BenchmarkIntLists(b *testing.B) {
	ids := make([]string, 6250)
	for i := range ids {
		ids[i] = strconv.Itoa(10000 + 7*i)
	}
	v := []byte(`[[` + strings.Join(ids, ",") + `]]`)
	for _, c := range []struct {
		name  string
		limit uint64
	}{{"runs", math.MaxInt32}, {"elements", 9_999_998}} {
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(int64(len(v)))
			for b.Loop() {
				if sh, ok := jsonraw.IntLists(v, c.limit); !ok || sh.Longest != len(ids) {
					b.Fatal(sh, ok)
				}
			}
		})
	}
}

func TestResetLists(t *testing.T) {
	for _, c := range []struct {
		doc    string
		member int
		want   jsonraw.Lists
	}{
		{`{"a":1,"k":[[1,2,3],[4]],"b":[1]}`, 1, jsonraw.Lists{Nested: true, Lists: 2, Longest: 3}},
		{`{"k":[5,6]}`, 0, jsonraw.Lists{Longest: 2}},
		{`{"k":[[1],-2]}`, -1, jsonraw.Lists{}},
		{`{"k":null}`, -1, jsonraw.Lists{}},
		{`{"k":[[1]],"k":[[2]]}`, -1, jsonraw.Lists{}},
		{`{"k":[[1]],"\u006b":[[2]]}`, -1, jsonraw.Lists{}},
		{`{"\u006b":[[1]]}`, -1, jsonraw.Lists{}},
		{`{"x":{"k":[[1]]}}`, -1, jsonraw.Lists{}},
	} {
		var o jsonraw.Object
		sh, m, err := o.ResetLists([]byte(c.doc), "k", math.MaxInt32)
		require.NoError(t, err, c.doc)
		assert.Equal(t, c.member, m, c.doc)
		assert.Equal(t, c.want, sh, c.doc)
	}
	var o jsonraw.Object
	_, m, err := o.ResetLists([]byte(`{"k":[[1,2]`), "k", 9)
	assert.Error(t, err)
	assert.Equal(t, -1, m)
}

// FuzzResetLists: ResetLists accepts and refuses what Reset does, with the
// same error and members, and reports the shape IntLists reads from the
// one literal spelling of the key.
func FuzzResetLists(f *testing.F) {
	for _, s := range []string{
		`{"k":[[1,2,3]]}`, `{"a":"x","k":[ [1 , 22] ,[333]]}`, `{"k":[[1,2]}`, `{"k":[[01]]}`, `{"k":[[2147483648]]}`,
		`{"k":[[1]],"k":[[2]]}`, `{"k\u0000":[1]}`, `{"k":[[1e3]]}`, `{"k":[]}`, `{"k":[1,2]}`, `[1]`, `{"k":[[1],2]}`,
		`{"k":[[10000,10001,10002,10003,10004,10005,10006,10007],[1,2]],"n":3}`,
	} {
		f.Add([]byte(s))
	}
	literal := regexp.MustCompile(`^(0|[1-9][0-9]*)$`)
	f.Fuzz(func(t *testing.T, data []byte) {
		var a, b jsonraw.Object
		sh, m, err := a.ResetLists(data, "k", math.MaxInt32)
		want := b.Reset(data)
		if (err == nil) != (want == nil) || (err != nil && err.Error() != want.Error()) {
			t.Fatalf("ResetLists err %v, Reset err %v", err, want)
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
			// key holding such a value must have been read.
			if bytes.Count(data, []byte(`"k"`)) == 1 && bytes.Count(data, []byte{'{'}) == 1 && !bytes.Contains(data, []byte(`\`)) {
				if v, ok := a.Get("k"); ok {
					if _, ok := intListsOracle(v, math.MaxInt32, literal); ok {
						t.Fatalf("lists not read: %q", data)
					}
				}
			}
			return
		}
		k, v := a.Member(m)
		if k != "k" {
			t.Fatalf("member %d is %q", m, k)
		}
		ref, ok := intListsOracle(v, math.MaxInt32, literal)
		if !ok || ref != sh {
			t.Fatalf("read %+v, encoding/json %+v (%v)", sh, ref, ok)
		}
		// Given as known, the same value is taken with the same result;
		// a known at another place, or above the limit, changes nothing.
		start, end := a.ValueSpan(m)
		for _, kn := range []jsonraw.Known{
			{Start: start, End: end, Lists: sh, Max: math.MaxInt32},
			{Start: start + 1, End: end, Lists: jsonraw.Lists{Lists: 99}},
			{Start: start, End: end, Lists: jsonraw.Lists{Lists: 99}, Max: math.MaxInt32 + 1},
		} {
			var c jsonraw.Object
			ksh, km, err := c.ResetListsKnown(data, "k", math.MaxInt32, kn)
			if err != nil || km != m || ksh != sh {
				t.Fatalf("with %+v: %+v, %d, %v; want %+v, %d", kn, ksh, km, err, sh, m)
			}
			sameMembers(t, c, a)
		}
	})
}

func TestResetListsIn(t *testing.T) {
	for _, c := range []struct {
		doc    string
		parent int
		list   string
	}{
		{`{"id":1,"kv":{"a":"x","k":[[1,2,3]],"b":2},"z":[1]}`, 1, `[[1,2,3]]`},
		{`{"kv":{"k":[5,6]}}`, 0, `[5,6]`},
		{`{"k":[[1]],"kv":{"x":1}}`, -1, ``},
		{`{"kv":{"k":[[1]],"k":[[2]]}}`, -1, ``},
		{`{"kv":{"k":[[1]]},"kv":{"k":[[2]]}}`, -1, ``},
		{`{"kv":{"k":[[1]]},"kv":{}}`, 0, `[[1]]`},
		{`{"kv":{"o":{"k":[[1]]}}}`, -1, ``},
		{`{"kv":[{"k":[[1]]}]}`, -1, ``},
		{`{"kv":{"k":[[-1]]}}`, -1, ``},
		{`{"\u006bv":{"k":[[1]]}}`, -1, ``},
	} {
		var o jsonraw.Object
		k, pm, err := o.ResetListsIn([]byte(c.doc), "kv", "k", math.MaxInt32)
		require.NoError(t, err, c.doc)
		assert.Equal(t, c.parent, pm, c.doc)
		if pm >= 0 {
			assert.Equal(t, c.list, c.doc[k.Start:k.End], c.doc)
			sh, _ := jsonraw.IntLists([]byte(c.list), math.MaxInt32)
			assert.Equal(t, sh, k.Lists, c.doc)
			assert.Equal(t, uint64(math.MaxInt32), k.Max)
		} else {
			assert.Zero(t, k, c.doc)
		}
	}
	var o jsonraw.Object
	o2, _ := jsonraw.Parse([]byte(`{"kv":{},"a":1,"kv":{"k":[]}}`))
	assert.Equal(t, 2, o2.Index("kv"))
	assert.Equal(t, -1, o2.Index("b"))
	_, pm, err := o.ResetListsIn([]byte(`{"kv":{"k":[[1,2]}`), "kv", "k", 9)
	assert.Error(t, err)
	assert.Equal(t, -1, pm)
}

// FuzzResetListsIn: ResetListsIn accepts and refuses what Reset does,
// with the same error and members; a list it reports is, byte for byte,
// the member key of the value of the parent member it names, with the
// shape IntLists reads; and the one literal spelling of both keys holding
// such a list is always read.
func FuzzResetListsIn(f *testing.F) {
	for _, s := range []string{
		`{"p":{"k":[[1,2,3]]}}`, `{"a":"x","p":{"x":1,"k":[ [1 , 22] ,[333]]},"k":[[9]]}`, `{"p":{"k":[[1,2]}}`,
		`{"p":{"k":[[01]]}}`, `{"p":{"k":[[1]],"k":[[2]]}}`, `{"p":{"k":[1,2]},"p":{}}`, `[1]`, `{"p":[{"k":[[1]]}]}`,
		`{"p":{"k":[[1]],"\u006b":[[2]]}}`,
	} {
		f.Add([]byte(s))
	}
	literal := regexp.MustCompile(`^(0|[1-9][0-9]*)$`)
	f.Fuzz(func(t *testing.T, data []byte) {
		var a, b jsonraw.Object
		k, pm, err := a.ResetListsIn(data, "p", "k", math.MaxInt32)
		want := b.Reset(data)
		if (err == nil) != (want == nil) || (err != nil && err.Error() != want.Error()) {
			t.Fatalf("ResetListsIn err %v, Reset err %v", err, want)
		}
		if err != nil {
			return
		}
		sameMembers(t, a, b)
		if pm < 0 {
			if k != (jsonraw.Known{}) {
				t.Fatalf("a Known without a member: %+v", k)
			}
			if bytes.Count(data, []byte(`"p"`)) == 1 && bytes.Count(data, []byte(`"k"`)) == 1 && bytes.Count(data, []byte{'{'}) == 2 && !bytes.Contains(data, []byte(`\`)) {
				if pv, ok := a.Get("p"); ok {
					if po, err := jsonraw.Parse(pv); err == nil {
						if v, ok := po.Get("k"); ok {
							if _, ok := intListsOracle(v, math.MaxInt32, literal); ok {
								t.Fatalf("list not read: %q", data)
							}
						}
					}
				}
			}
			return
		}
		key, pv := a.Member(pm)
		po, err := jsonraw.Parse(pv)
		if key != "p" || err != nil {
			t.Fatalf("member %d is %q (%v)", pm, key, err)
		}
		v, _ := po.Get("k")
		if dup, twice := po.Duplicate(); twice && dup == "k" {
			return // the literal spelling's list, not necessarily the last
		}
		if string(v) != string(data[k.Start:k.End]) {
			t.Fatalf("Known %q, the member holds %q", data[k.Start:k.End], v)
		}
		ref, ok := intListsOracle(v, math.MaxInt32, literal)
		if !ok || ref != k.Lists {
			t.Fatalf("read %+v, encoding/json %+v (%v)", k.Lists, ref, ok)
		}
	})
}

package entry

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/internal/toytok"
	"github.com/bidikv/bidikv/kvroute/internal/bufpool"
	"github.com/bidikv/bidikv/kvroute/internal/fingerprint"
)

// TestEntryCompactHandle stores handles through encode and decodeEntry:
// every handle comes back byte for byte; those with a compact integer
// block list are stored in fewer bytes, the others verbatim.
func TestEntryCompactHandle(t *testing.T) {
	var many strings.Builder
	for i := range 1600 {
		if i > 0 {
			many.WriteByte(',')
		}
		fmt.Fprint(&many, 20000+i*3%7+i)
	}
	tests := []struct {
		name    string
		Handle  string
		compact bool
	}{
		{"nested", `{"do_remote_prefill":false,"remote_block_ids":[[11,12,13,14],[7,3]],"remote_engine_id":"d","remote_num_tokens":60}`, true},
		{"large", `{"remote_block_ids":[[` + many.String() + `]],"remote_num_tokens":25600}`, true},
		{"flat", `{"remote_block_ids":[5,6,7],"x":1}`, true},
		{"empty", `{"remote_block_ids":[],"x":1}`, true},
		{"spaces kept verbatim", `{"remote_block_ids": [[1, 2, 3]]}`, false},
		{"not integers", `{"remote_block_ids":[[1.5]]}`, false},
		{"negative", `{"remote_block_ids":[[-1]]}`, false},
		{"exponent", `{"remote_block_ids":[[1e3]]}`, false},
		{"null", `{"remote_block_ids":null}`, false},
		{"none", `{"remote_engine_id":"d"}`, false},
		{"same list earlier", `{"a":[[1,2]],"remote_block_ids":[[1,2]]}`, true},
		{"ids of 2^32 and above", `{"remote_block_ids":[[4294967295,4294967296,5,9007199254740993]]}`, true},
		{"longer than the stack scratch", `{"remote_block_ids":[[` + many.String() + `,` + many.String() + `]]}`, true},
		{"leading zero", `{"remote_block_ids":[[1,02]]}`, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := Entry{Created: time.Unix(100, 5), Endpoint: "http://d", Tokens: 60, Check: []byte("c"), ContentOK: true,
				FP: fingerprint.Fingerprint{1, 2, 3, 4, 5, 6, 7, 8}, Handle: []byte(tt.Handle)}
			Raw := e.Encode(nil, nil)
			// Built in pooled buffers (the router's path), used twice so
			// that the second reuses the first's: the same bytes.
			var bufs bufpool.Bytes
			for range 2 {
				pooled := e.Encode(bufs.Get(e.EncodedSize()), &bufs)
				require.Equal(t, Raw, pooled)
				bufs.Put(pooled)
			}
			verbatim := len(Raw) >= len(tt.Handle) && strings.HasSuffix(string(Raw), tt.Handle)
			assert.Equal(t, !tt.compact, verbatim, "stored verbatim")
			if tt.name == "large" {
				assert.Less(t, len(Raw), len(tt.Handle)/4, "a fifth of the JSON at most, about")
			}
			got, err := Decode(Raw, nil)
			require.NoError(t, err)
			assert.Equal(t, tt.Handle, string(got.Handle))
			for range 2 { // expanded into a pooled buffer, then into the same one again
				pooled, err := Decode(Raw, &bufs)
				require.NoError(t, err)
				assert.Equal(t, tt.Handle, string(pooled.Handle))
				assert.Equal(t, tt.compact, pooled.Expanded)
				if pooled.Expanded {
					bufs.Put(pooled.Handle)
				}
			}
			assert.Equal(t, e.Tokens, got.Tokens)
			assert.Equal(t, e.Endpoint, got.Endpoint)
			assert.Equal(t, e.FP, got.FP)
			assert.True(t, got.ContentOK)
			assert.True(t, e.Created.Equal(got.Created))
		})
	}
	// A corrupt compact entry is a bad entry, not a wrong handle.
	e := Entry{Created: time.Unix(1, 0), Endpoint: "d", Handle: []byte(`{"remote_block_ids":[[1,2,3]]}`)}
	Raw := e.Encode(nil, nil)
	for cut := len(Raw) - 1; cut > len(Raw)-8; cut-- {
		_, err := Decode(Raw[:cut], nil)
		assert.Error(t, err, "cut at %d", cut)
	}
}

// TestEntryHoldFields: version 4 keeps what the decode memory budget needs
// of a hold; an entry of version 3 (a router before it) still decodes,
// with those fields unknown.
func TestEntryHoldFields(t *testing.T) {
	e := Entry{Created: time.Unix(100, 5), Endpoint: "http://d", Tokens: 60, Check: []byte("c"), ContentOK: true,
		FP: fingerprint.Fingerprint{1, 2, 3, 4, 5, 6, 7, 8}, Handle: []byte(`{"remote_block_ids":[[1,2,3,4]],"remote_num_tokens":60}`),
		Turn: 7, ToolCalls: true, Model: "Qwen/Qwen3-32B", API: 2}
	raw := e.Encode(nil, nil)
	got, err := Decode(raw, nil)
	require.NoError(t, err)
	assert.Equal(t, 7, got.Turn)
	assert.True(t, got.ToolCalls)
	assert.True(t, got.ContentOK)
	assert.Equal(t, "Qwen/Qwen3-32B", got.Model)
	assert.Equal(t, byte(2), got.API)
	assert.Equal(t, string(e.Handle), string(got.Handle))

	// Version 3: the same layout without the hold's fields.
	v3 := []byte{entryVersion3}
	v3 = binary.AppendVarint(v3, e.Created.UnixNano())
	v3 = binary.AppendUvarint(v3, uint64(e.Tokens))
	v3 = appendBytes(v3, []byte(e.Endpoint))
	v3 = appendBytes(v3, e.Check)
	v3 = append(v3, flagContentOK|flagToolCalls) // a bit version 3 never set: ignored
	v3 = appendBytes(v3, e.FP)
	v3 = append(v3, e.Handle...)
	got, err = Decode(v3, nil)
	require.NoError(t, err)
	assert.Zero(t, got.Turn)
	assert.False(t, got.ToolCalls)
	assert.Empty(t, got.Model)
	assert.Equal(t, string(e.Handle), string(got.Handle))
	assert.Equal(t, 60, got.Tokens)

	_, err = Decode(append([]byte{entryVersion + 1}, raw[1:]...), nil)
	assert.ErrorIs(t, err, ErrBad, "a later version is refused, not misread")
}

// BenchmarkCompactHandle compacts real-size handles (toytok's, one id
// per 16 tokens): parse is compactHandle, which finds the list itself,
// known compactKnown, given where it is (Check's Info.Blocks).
func BenchmarkCompactHandle(b *testing.B) {
	for _, tokens := range []int{25000, 100000} {
		h := toytok.Handle(3, tokens, 16)
		var obj jsonraw.Object
		sh, m, err := obj.ResetLists(h, "remote_block_ids", math.MaxInt32)
		require.NoError(b, err)
		start, end := obj.ValueSpan(m)
		known := jsonraw.Known{Start: start, End: end, Lists: sh, Max: math.MaxInt32}
		dst := make([]byte, 0, len(h)+64) // as Encode's pooled buffer
		for _, c := range []struct {
			name    string
			compact func() bool
		}{
			{"parse", func() bool { _, ok := compactHandle(dst[:0], h, nil); return ok }},
			{"known", func() bool { _, ok := compactKnown(dst[:0], h, known); return ok }},
		} {
			b.Run(fmt.Sprintf("%s/%dk", c.name, tokens/1000), func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					if !c.compact() {
						b.Fatal("not compacted")
					}
				}
			})
		}
	}
}

// FuzzCompactHandle checks compactHandle's length test against the check
// by expansion: the same verdict and bytes for any handle text, and a
// compacted handle expands to exactly the text.
func FuzzCompactHandle(f *testing.F) {
	for _, s := range []string{
		`{"do_remote_prefill":false,"remote_block_ids":[[11,12,13,14],[7,3]],"remote_engine_id":"d","remote_num_tokens":60}`,
		`{"remote_block_ids":[5,6,7],"x":1}`, `{"remote_block_ids":[],"x":1}`, `{"remote_block_ids":[[]]}`,
		`{"remote_block_ids": [[1, 2, 3]]}`, `{"remote_block_ids":[[1,2],[3] ]}`, `{"remote_block_ids":[ [1,2]]}`,
		`{"remote_block_ids":[[1.5]]}`, `{"remote_block_ids":[[-1]]}`, `{"remote_block_ids":[[1,02]]}`,
		`{"remote_block_ids":[[4294967295,4294967296,5,9007199254740993]]}`, `{"remote_block_ids":[[0,10,9999999999]]}`,
		`{"a":[[1,2]],"remote_block_ids":[[1,2]]}`, `{"remote_block_ids":[[1,2]\n]}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, h []byte) {
		var bufs bufpool.Bytes
		got, ok := compactHandleCheck([]byte{7}, h, &bufs, false)
		want, wantOK := compactHandleCheck([]byte{7}, h, nil, true)
		if ok != wantOK || !bytes.Equal(got, want) {
			t.Fatalf("%q: compacted %v (%q), by expansion %v (%q)", h, ok, got, wantOK, want)
		}
		if !ok {
			return
		}
		back, err := appendExpanded(nil, got[1:])
		if err != nil || !bytes.Equal(back, h) {
			t.Fatalf("%q expands to %q (%v)", h, back, err)
		}
	})
}

// FuzzCompactKnown: given where a checked handle's block list is
// (kvhandle.Check's Info.Blocks), compaction reads it once and writes
// what expands to the handle (the general path's bytes when that takes the
// same list), or leaves it to that path; and Decode reports where the
// list it expands is, with its shape and largest id.
func FuzzCompactKnown(f *testing.F) {
	for _, s := range []string{
		`{"do_remote_prefill":false,"remote_block_ids":[[11,12,13,14],[7,3]],"remote_engine_id":"d","remote_num_tokens":60}`,
		`{"remote_block_ids":[5,6,7],"x":1}`, `{"remote_block_ids":[],"x":1}`, `{"remote_block_ids":[[]]}`, `{"remote_block_ids":[[],[]]}`,
		`{"remote_block_ids": [[1, 2, 3]]}`, `{"remote_block_ids":[[1,2],[3] ]}`, `{"remote_block_ids":[ [1,2]]}`,
		`{"remote_block_ids":[[0,10,2147483647]],"b":[[1]]}`, `{"a":[[1,2]],"remote_block_ids":[[1,2]]}`,
		string(toytok.GroupHandle(5, 3000, 16, 2, false)),
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, h []byte) {
		var obj jsonraw.Object
		sh, m, err := obj.ResetLists(h, "remote_block_ids", math.MaxInt32)
		if err != nil || m < 0 {
			return
		}
		start, end := obj.ValueSpan(m)
		known := jsonraw.Known{Start: start, End: end, Lists: sh, Max: math.MaxInt32}
		got, ok := compactKnown([]byte{7}, h, known)
		want, wantOK := compactHandleCheck([]byte{7}, h, nil, true)
		if ok {
			// The general path may take an earlier copy of the list's
			// text: both expand to h.
			back, err := appendExpanded(nil, got[1:])
			if !wantOK || err != nil || !bytes.Equal(back, h) || (bytes.Index(h, h[start:end]) == start && !bytes.Equal(got, want)) {
				t.Fatalf("%q: compacted %q (expands to %q, %v), the general path %v %q", h, got, back, err, wantOK, want)
			}
		}
		if !ok && !bytes.Equal(got, []byte{7}) {
			t.Fatalf("%q: dst changed when not compacted: %q", h, got)
		}
		if wantOK && !ok && !bytes.ContainsAny(h[start:end], " \t\r\n") {
			t.Fatalf("%q: left to the general path, which compacts it", h)
		}
		e := Entry{Created: time.Unix(1, 0), Endpoint: "d", Handle: h, Blocks: known}
		d, err := Decode(e.Encode(nil, nil), nil)
		if err != nil || !bytes.Equal(d.Handle, h) {
			t.Fatalf("%q: decoded %q, %v", h, d.Handle, err)
		}
		if k := d.Blocks; k.End > 0 {
			ksh, ok := jsonraw.IntLists(d.Handle[k.Start:k.End], math.MaxUint32)
			if !ok || ksh != k.Lists || k.Start != start || k.End != end {
				t.Fatalf("%q: Decode's Blocks %+v, the list %q reads %+v %v", h, k, d.Handle[k.Start:k.End], ksh, ok)
			}
			if k2, ok := jsonraw.IntLists(d.Handle[k.Start:k.End], k.Max); !ok || k2 != k.Lists {
				t.Fatalf("%q: an id above Max %d", h, k.Max)
			}
		} else if wantOK {
			t.Fatalf("%q: compacted, and Decode does not know its list", h)
		}
	})
}

// BenchmarkDecode decodes the entry of a real-size handle (toytok's, one
// id per 16 tokens), expanding its block list into a pooled buffer.
func BenchmarkDecode(b *testing.B) {
	for _, tokens := range []int{25000, 100000} {
		h := toytok.Handle(3, tokens, 16)
		raw := Entry{Created: time.Unix(1, 0), Endpoint: "http://d", Tokens: tokens, Handle: h}.Encode(nil, nil)
		var bufs bufpool.Bytes
		b.Run(fmt.Sprintf("%dk", tokens/1000), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				e, err := Decode(raw, &bufs)
				if err != nil || len(e.Handle) != len(h) {
					b.Fatal(err)
				}
				bufs.Put(e.Handle)
			}
		})
	}
}

func TestAppendDecimal(t *testing.T) {
	for _, v := range []uint64{0, 7, 9, 10, 42, 99, 100, 101, 999, 1000, 65535, 99999, 100000, 1234567, 99999999, 100000000, 999999999, 1000000000, 2147483647, math.MaxUint32, math.MaxUint64} {
		assert.Equal(t, "x"+strconv.FormatUint(v, 10), string(appendDecimal(append(make([]byte, 0, 32), 'x'), v)))
	}
}

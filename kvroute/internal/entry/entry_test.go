package entry

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

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

// BenchmarkCompactHandle is compactHandle on a 26k-token handle: 1,637
// block ids in one group.
func BenchmarkCompactHandle(b *testing.B) {
	h := []byte(`{"do_remote_prefill":true,"remote_engine_id":"d","remote_block_ids":[[`)
	for i := range 1637 {
		if i > 0 {
			h = append(h, ',')
		}
		h = fmt.Appendf(h, "%d", 1000+i*3)
	}
	h = append(h, `]],"remote_host":"127.0.0.1","remote_port":1,"remote_num_tokens":26176}`...)
	b.ReportAllocs()
	for b.Loop() {
		if _, ok := compactHandle(nil, h, nil); !ok {
			b.Fatal("not compacted")
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

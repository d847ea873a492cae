package kvhandle

import (
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/internal/toytok"
)

const defaultBlockSize = 16

func itoa(n int) string { return strconv.Itoa(n) }

func TestCutHandle(t *testing.T) {
	handle := func(r int, groups ...string) []byte {
		return []byte(`{"do_remote_decode":true,"remote_block_ids":[` + strings.Join(groups, ",") +
			`],"remote_engine_id":"e","remote_request_id":"q","remote_host":"h","remote_port":1,"remote_num_tokens":` +
			itoa(r) + `,"dcp_size":1,"x":{"k":[1.50]}}`)
	}
	t.Run("two groups cut from the front", func(t *testing.T) {
		out, err := Cut(handle(40, "[10,11,12]", "[20,21,22]"), 32, 16)
		require.NoError(t, err)
		obj, err := jsonraw.Parse(out)
		require.NoError(t, err)
		v, _ := obj.Get("remote_block_ids")
		assert.Equal(t, "[[10,11],[20,21]]", string(v))
		v, _ = obj.Get("remote_num_tokens")
		assert.Equal(t, "32", string(v))
		v, _ = obj.Get("x")
		assert.Equal(t, `{"k":[1.50]}`, string(v), "other members verbatim")
	})
	t.Run("flat list of old engines", func(t *testing.T) {
		out, err := Cut(handle(40, "10,11,12"), 16, 16)
		require.NoError(t, err)
		obj, _ := jsonraw.Parse(out)
		v, _ := obj.Get("remote_block_ids")
		assert.Equal(t, "[10]", string(v))
	})
	refusals := []struct {
		name string
		raw  []byte
		want error
	}{
		{"groups of unequal length (sliding window)", handle(40, "[10,11,12]", "[20]"), ErrPartialGroups},
		{"block count does not fit the block size", handle(40, "[10,11]"), ErrPartialBlocks},
		{"dcp", []byte(`{"remote_block_ids":[[1,2,3]],"remote_num_tokens":40,"dcp_size":2}`), ErrPartialDCP},
	}
	for _, c := range refusals {
		t.Run(c.name, func(t *testing.T) {
			_, err := Cut(c.raw, 32, 16)
			assert.ErrorIs(t, err, c.want)
		})
	}
}

// BenchmarkCutHandle cuts a D handle of 1,500 block ids (24,000 tokens)
// to its first 1,000 blocks (16,000 tokens), as a partial hit does.
func BenchmarkCutHandle(b *testing.B) {
	const blocks, keep = 1500, 1000
	ids := make([]string, blocks)
	for i := range ids {
		ids[i] = strconv.Itoa(20000 + 7*i) // 5-digit block ids
	}
	raw := []byte(`{"do_remote_prefill":false,"do_remote_decode":true,"remote_block_ids":[[` + strings.Join(ids, ",") +
		`]],"remote_engine_id":"d-engine","remote_request_id":"chatcmpl-0a1b2c3d","remote_host":"10.0.0.2","remote_port":5601,"tp_size":1,"remote_num_tokens":` +
		itoa(blocks*defaultBlockSize) + `,"remote_blocks_expiry_time":12345.5}`)
	want := keep * defaultBlockSize
	out, err := Cut(raw, want, defaultBlockSize)
	require.NoError(b, err)
	hi, err := Check(out, 16)
	require.NoError(b, err)
	require.Equal(b, want, hi.Tokens)
	b.SetBytes(int64(len(raw)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Cut(raw, want, defaultBlockSize); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(len(raw)), "handle-B")
}

// FuzzCut compares Cut with the former per-element cut: the same handle
// or the same error, for any handle text, cut and block size.
func FuzzCut(f *testing.F) {
	h := func(r int, groups string) string {
		return `{"remote_block_ids":[` + groups + `],"remote_engine_id":"e","remote_request_id":"q","remote_host":"h","remote_port":1,"remote_num_tokens":` + itoa(r) + `}`
	}
	for _, s := range []string{
		h(40, "[10,11,12]"), h(40, "[10,11,12],[20,21,22]"), h(40, "[10,11,12],[20]"), h(40, "10,11,12"), h(40, "[10, 11,12]"),
		h(40, "[10,11],[20,21]"), h(40, "[10,[11],12]"), h(40, "[1.5,11,12]"), h(40, "[]"), h(40, " [10,11,12]"),
		h(40, `[10,11,12],"x"`), string(toytok.GroupHandle(3, 1000, 16, 2, false)),
	} {
		f.Add([]byte(s), uint16(32), uint8(16))
	}
	f.Fuzz(func(t *testing.T, raw []byte, tokens uint16, bs uint8) {
		blockSize := int(bs%64) + 1
		got, err := Cut(raw, int(tokens), blockSize)
		want, wantErr := cutElements(raw, int(tokens), blockSize)
		if (err == nil) != (wantErr == nil) || (err != nil && !errors.Is(err, wantErr) && err.Error() != wantErr.Error()) {
			t.Fatalf("Cut(%q, %d, %d): %v; per element: %v", raw, tokens, blockSize, err, wantErr)
		}
		if string(got) != string(want) {
			t.Fatalf("Cut(%q, %d, %d) = %q; per element %q", raw, tokens, blockSize, got, want)
		}
	})
}

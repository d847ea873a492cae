package kvroute

import (
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

func seqOf(rng *rand.Rand, n int) []uint32 {
	s := make([]uint32, n)
	for i := range s {
		s[i] = uint32(rng.IntN(150000))
	}
	return s
}

func TestFingerprintCommonPrefix(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	base := seqOf(rng, 1000) // D's prompt + generated tokens
	const bs = 16
	const r = 999 // remote_num_tokens: all but the last sampled token
	fp := newFingerprint(base[:700], base[700:], r, bs)
	require.NotNil(t, fp)
	with := func(prefix []uint32, rest ...uint32) []uint32 {
		return append(append([]uint32(nil), prefix...), rest...)
	}
	edited := with(base)
	edited[500] ^= 1
	cases := []struct {
		name   string
		prompt []uint32
		want   int
	}{
		{"honest continuation", with(base[:r], 7, 8, 9), r},
		{"exactly the sequence", with(base[:r]), r},
		{"one token short", with(base[:r-1]), (r - 1) / bs * bs},
		{"edit at 500", edited, 500 / bs * bs},
		{"first token differs", with([]uint32{base[0] + 1}, base[1:]...), 0},
		{"diverges at the last token", with(base[:r-1], base[r-1]+1, 5), (r - 1) / bs * bs},
		{"empty", nil, 0},
		{"short prefix only", with(base[:40]), 32},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			n, err := fp.commonPrefix(c.prompt)
			require.NoError(t, err)
			assert.Equal(t, c.want, n)
		})
	}
}

func TestFingerprintSize(t *testing.T) {
	fp := newFingerprint(make([]uint32, 24000), nil, 24000, 16)
	// 1,500 blocks of 8 bytes plus the whole-sequence hash and two varints.
	assert.Less(t, len(fp), 8*1501+8)
	assert.Nil(t, newFingerprint(make([]uint32, 10), nil, 11, 16), "fewer ids than remote_num_tokens")
	_, err := fingerprint([]byte{1, 2, 3}).commonPrefix(nil)
	assert.ErrorIs(t, err, errBadFingerprint)
}

func TestFingerprintOneDifferenceNeverCollides(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for range 2000 {
		a := seqOf(rng, 1+rng.IntN(200))
		b := append([]uint32(nil), a...)
		i := rng.IntN(len(b))
		b[i] = uint32(rng.IntN(1 << 31))
		if b[i] == a[i] {
			continue
		}
		fa := newFingerprint(a, nil, len(a), 16)
		n, err := fa.commonPrefix(b)
		require.NoError(t, err)
		require.LessOrEqual(t, n, i, "the verified prefix never covers the differing token")
	}
}

func TestCutHandle(t *testing.T) {
	handle := func(r int, groups ...string) []byte {
		return []byte(`{"do_remote_decode":true,"remote_block_ids":[` + strings.Join(groups, ",") +
			`],"remote_engine_id":"e","remote_request_id":"q","remote_host":"h","remote_port":1,"remote_num_tokens":` +
			itoa(r) + `,"dcp_size":1,"x":{"k":[1.50]}}`)
	}
	t.Run("two groups cut from the front", func(t *testing.T) {
		out, err := cutHandle(handle(40, "[10,11,12]", "[20,21,22]"), 32, 16)
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
		out, err := cutHandle(handle(40, "10,11,12"), 16, 16)
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
		{"groups of unequal length (sliding window)", handle(40, "[10,11,12]", "[20]"), errPartialGroups},
		{"block count does not fit the block size", handle(40, "[10,11]"), errPartialBlocks},
		{"dcp", []byte(`{"remote_block_ids":[[1,2,3]],"remote_num_tokens":40,"dcp_size":2}`), errPartialDCP},
	}
	for _, c := range refusals {
		t.Run(c.name, func(t *testing.T) {
			_, err := cutHandle(c.raw, 32, 16)
			assert.ErrorIs(t, err, c.want)
		})
	}
}

func itoa(n int) string { return strconv.Itoa(n) }

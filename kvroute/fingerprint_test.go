package kvroute

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/sse"
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

// The verification benchmarks use a 24,000-token conversation, about a
// 100 KB history: D's prompt of 23,800 tokens and 200 generated.
const (
	benchPromptLen = 23800
	benchGenLen    = 200
)

// BenchmarkFingerprint fingerprints D's 24,000 tokens (R = 23,999: all but
// the last sampled token), as retain does once per token-mode turn.
func BenchmarkFingerprint(b *testing.B) {
	rng := rand.New(rand.NewPCG(5, 6))
	prompt, gen := seqOf(rng, benchPromptLen), seqOf(rng, benchGenLen)
	r := benchPromptLen + benchGenLen - 1
	b.ReportAllocs()
	var fp fingerprint
	for b.Loop() {
		fp = newFingerprint(prompt, gen, r, DefaultBlockSize)
	}
	b.ReportMetric(float64(len(fp)), "fingerprint-B")
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(r), "ns/token")
}

// BenchmarkCommonPrefix compares a 24,000-token prompt with the
// fingerprint of a 23,900-token sequence, as verify does once per
// token-mode candidate: "full" (the prompt continues the sequence) and
// "mismatch-middle" (a token differs at 11,950: the comparison stops at
// the block holding it).
func BenchmarkCommonPrefix(b *testing.B) {
	rng := rand.New(rand.NewPCG(7, 8))
	prompt := seqOf(rng, 24000)
	const r = 23900
	fp := newFingerprint(prompt[:r], nil, r, DefaultBlockSize)
	edited := append([]uint32(nil), prompt...)
	edited[r/2] ^= 1
	for _, c := range []struct {
		name   string
		prompt []uint32
		want   int
	}{
		{"full", prompt, r},
		{"mismatch-middle", edited, r / 2 / DefaultBlockSize * DefaultBlockSize},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				n, err := fp.commonPrefix(c.prompt)
				if err != nil || n != c.want {
					b.Fatalf("commonPrefix = %d, %v; want %d", n, err, c.want)
				}
			}
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
		itoa(blocks*DefaultBlockSize) + `,"remote_blocks_expiry_time":12345.5}`)
	want := keep * DefaultBlockSize
	out, err := cutHandle(raw, want, DefaultBlockSize)
	require.NoError(b, err)
	hi, err := checkHandle(out, 16)
	require.NoError(b, err)
	require.Equal(b, want, hi.tokens)
	b.SetBytes(int64(len(raw)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := cutHandle(raw, want, DefaultBlockSize); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(len(raw)), "handle-B")
}

// BenchmarkReadRenderAnswer reads the token ids of a render answer for a
// 24,000-token prompt as renderCall does once its body is read: validate
// the object, take token_ids, parse them into a new slice.
func BenchmarkReadRenderAnswer(b *testing.B) {
	rng := rand.New(rand.NewPCG(9, 10))
	ids := seqOf(rng, 24000)
	body := []byte(`{"token_ids":[`)
	for i, id := range ids {
		if i > 0 {
			body = append(body, ',')
		}
		body = strconv.AppendUint(body, uint64(id), 10)
	}
	body = append(body, "]}"...)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		o, err := jsonraw.Parse(body)
		if err != nil {
			b.Fatal(err)
		}
		v, _ := o.Get("token_ids")
		got, ok := sse.AppendTokenIDs(nil, v)
		if !ok || len(got) != len(ids) {
			b.Fatalf("ok %v, %d ids", ok, len(got))
		}
	}
}

// TestFingerprintFrom checks that a fingerprint started from a verified
// prefix's chain is byte for byte the one hashed from scratch, whatever the
// next sequence holds: the same prefix, one differing token inside or
// after it, a shorter one, another block size.
func TestFingerprintFrom(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	ids := func(n int) []uint32 {
		s := make([]uint32, n)
		for i := range s {
			s[i] = rng.Uint32N(200000)
		}
		return s
	}
	for _, bs := range []int{1, 3, 16} {
		for _, r := range []int{1, 15, 16, 17, 160, 161} {
			old := ids(r + 40)
			fp := newFingerprint(old[:r-min(r, 5)], old[r-min(r, 5):], r, bs)
			// The next rendered prompt: the old sequence, then more.
			rendered := append(slices.Clone(old[:r]), ids(50)...)
			cp, err := fp.verifyPrefix(rendered)
			require.NoError(t, err)
			require.Equal(t, r, cp.n, "bs %d r %d: whole sequence verified", bs, r)
			gen := ids(30)
			for _, c := range []struct {
				name   string
				prompt []uint32
				bs     int
			}{
				{"same", rendered, bs},
				{"token differs in prefix", with(rendered, r/2, 7), bs},
				{"token differs after prefix", with(rendered, r+1, 7), bs},
				{"shorter", rendered[:r], bs},
				{"other block size", rendered, bs + 1},
			} {
				n := len(c.prompt) + len(gen) - 3
				want := newFingerprint(c.prompt, gen, n, c.bs)
				got := fingerprintFrom(cp, c.prompt, gen, n, c.bs)
				require.Equal(t, want, got, "bs %d r %d: %s", bs, r, c.name)
			}
			// A partial match: the chain up to the last matching block.
			bad := with(rendered, r-1, rendered[r-1]+1)
			cp, err = fp.verifyPrefix(bad)
			require.NoError(t, err)
			wantN, _ := fp.commonPrefix(bad)
			require.Equal(t, wantN, cp.n)
			n := len(bad) + len(gen)
			require.Equal(t, newFingerprint(bad, gen, n, bs), fingerprintFrom(cp, bad, gen, n, bs), "bs %d r %d: partial", bs, r)
		}
	}
}

// with returns a copy of s with s[i] = v.
func with(s []uint32, i int, v uint32) []uint32 {
	s = slices.Clone(s)
	s[i] = v
	return s
}

// FuzzFingerprintFrom checks fingerprintFrom against newFingerprint for
// sequences derived from fuzzed bytes.
func FuzzFingerprintFrom(f *testing.F) {
	f.Add([]byte{1, 2, 3, 4, 5, 6, 7, 8, 9}, []byte{1, 2, 3, 4, 9}, uint8(4), uint8(2))
	f.Fuzz(func(t *testing.T, a, b []byte, bs, extra uint8) {
		if bs == 0 || len(a) == 0 {
			return
		}
		old, next := fuzzIDs(a), fuzzIDs(b)
		fp := newFingerprint(old, nil, len(old), int(bs))
		cp, err := fp.verifyPrefix(next)
		require.NoError(t, err)
		n, _ := fp.commonPrefix(next)
		require.Equal(t, n, cp.n)
		gen := fuzzIDs(a[:min(len(a), int(extra))])
		for _, bsz := range []int{int(bs), int(bs) + 1} {
			for m := 1; m <= len(next)+len(gen); m += 1 + len(next)/7 {
				want := newFingerprint(next, gen, m, bsz)
				require.Equal(t, want, fingerprintFrom(cp, next, gen, m, bsz))
				// Into a used buffer, with room or without.
				for _, dst := range [][]byte{make([]byte, 5, fingerprintSize(m, bsz)), {9}} {
					require.Equal(t, want, appendFingerprintFrom(dst, cp, next, gen, m, bsz))
					require.Equal(t, want, appendFingerprint(dst, next, gen, m, bsz))
				}
			}
		}
	})
}

// verifySerial is verifyPrefix as a walk over the tokens in order, one
// chain (the definition verifyPrefix's block-parallel check must match).
func verifySerial(f fingerprint, prompt []uint32) (chainPrefix, error) {
	bs, n, hashes, err := f.parse()
	if err != nil {
		return chainPrefix{}, err
	}
	full := n / bs
	h := uint64(fpSeed)
	matched := 0
	prefix := func(m int, h uint64) chainPrefix {
		if m == 0 {
			return chainPrefix{}
		}
		return chainPrefix{ids: prompt, n: m, h: h, blockSize: bs, blocks: hashes[:8*(m/bs)]}
	}
	blockH := uint64(0)
	for i, id := range prompt {
		if i == n {
			break
		}
		h = fpMix(h, id)
		if (i+1)%bs == 0 {
			blk := (i + 1) / bs
			if binary.LittleEndian.Uint64(hashes[8*(blk-1):]) != h {
				return prefix(matched, blockH), nil
			}
			matched, blockH = blk*bs, h
		}
	}
	if len(prompt) >= n && binary.LittleEndian.Uint64(hashes[8*full:]) == h {
		return prefix(n, h), nil
	}
	return prefix(matched, blockH), nil
}

func requireSamePrefix(t *testing.T, want, got chainPrefix, msg string) {
	t.Helper()
	require.Equal(t, want.n, got.n, msg)
	require.Equal(t, want.h, got.h, msg)
	require.Equal(t, want.blockSize, got.blockSize, msg)
	require.Equal(t, want.blocks, got.blocks, msg)
	require.Equal(t, len(want.ids), len(got.ids), msg)
}

// TestVerifyPrefixBlocks checks the block-parallel verifyPrefix against
// the token-by-token walk: prompts that continue the sequence, end inside
// it, or differ in one token at every position class (each of four blocks
// checked together, the blocks after the last group, the partial tail),
// for several block sizes and lengths.
func TestVerifyPrefixBlocks(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	for _, bs := range []int{1, 3, 16, 64} {
		for _, r := range []int{1, 15, 16, 17, 63, 64, 65, 200, 1000, 1001} {
			seq := seqOf(rng, r+20)
			fp := newFingerprint(seq[:r], nil, r, bs)
			require.NotNil(t, fp)
			prompts := [][]uint32{seq, seq[:r], seq[:r/2], nil}
			for _, at := range []int{0, bs - 1, bs, 2*bs + 1, 3 * bs, 4*bs + 2, 5*bs - 1, r / 2, r - 1, r} {
				if at < len(seq) {
					p := slices.Clone(seq)
					p[at] ^= 1
					prompts = append(prompts, p)
				}
			}
			for i, p := range prompts {
				want, err := verifySerial(fp, p)
				require.NoError(t, err)
				got, err := fp.verifyPrefix(p)
				require.NoError(t, err)
				requireSamePrefix(t, want, got, fmt.Sprintf("bs %d, R %d, prompt %d", bs, r, i))
			}
		}
	}
}

// FuzzVerifyPrefix checks verifyPrefix against verifySerial on fuzzed
// fingerprints (made from a sequence, then with fuzzed bytes written over
// some hashes, so that any block may mismatch) and prompts.
func FuzzVerifyPrefix(f *testing.F) {
	f.Add([]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17}, []byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18}, uint8(2), []byte{})
	f.Add([]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17}, []byte{1, 2, 3, 4, 5, 6, 7, 8, 0}, uint8(1), []byte{3, 9, 9, 9, 9, 9, 9, 9, 9})
	f.Fuzz(func(t *testing.T, a, b []byte, bs uint8, corrupt []byte) {
		if bs == 0 || len(a) == 0 {
			return
		}
		old, next := fuzzIDs(a), fuzzIDs(b)
		fp := newFingerprint(old, nil, len(old), int(bs))
		_, _, hashes, err := fp.parse()
		require.NoError(t, err)
		// corrupt: a hash index, then 8 bytes to write there, repeated.
		for len(corrupt) >= 9 && len(hashes) >= 8 {
			k := int(corrupt[0]) % (len(hashes) / 8)
			copy(hashes[8*k:8*k+8], corrupt[1:9])
			corrupt = corrupt[9:]
		}
		want, err := verifySerial(fp, next)
		require.NoError(t, err)
		got, err := fp.verifyPrefix(next)
		require.NoError(t, err)
		requireSamePrefix(t, want, got, "")
	})
}

// fuzzIDs maps fuzzed bytes to token ids from a small alphabet, so that
// sequences share prefixes often.
func fuzzIDs(p []byte) []uint32 {
	s := make([]uint32, len(p))
	for i, c := range p {
		s[i] = uint32(c % 8)
	}
	return s
}

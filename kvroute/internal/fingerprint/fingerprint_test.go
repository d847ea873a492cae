package fingerprint

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const defaultBlockSize = 16

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
	fp := New(base[:700], base[700:], r, bs)
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
			n, err := fp.CommonPrefix(c.prompt)
			require.NoError(t, err)
			assert.Equal(t, c.want, n)
		})
	}
}

func TestFingerprintSize(t *testing.T) {
	fp := New(make([]uint32, 24000), nil, 24000, 16)
	// 1,500 blocks of 8 bytes plus the whole-sequence hash and two varints.
	assert.Less(t, len(fp), 8*1501+8)
	assert.Nil(t, New(make([]uint32, 10), nil, 11, 16), "fewer ids than remote_num_tokens")
	_, err := Fingerprint([]byte{1, 2, 3}).CommonPrefix(nil)
	assert.ErrorIs(t, err, ErrMalformed)
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
		fa := New(a, nil, len(a), 16)
		n, err := fa.CommonPrefix(b)
		require.NoError(t, err)
		require.LessOrEqual(t, n, i, "the verified prefix never covers the differing token")
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
	var fp Fingerprint
	for b.Loop() {
		fp = New(prompt, gen, r, defaultBlockSize)
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
	fp := New(prompt[:r], nil, r, defaultBlockSize)
	edited := append([]uint32(nil), prompt...)
	edited[r/2] ^= 1
	for _, c := range []struct {
		name   string
		prompt []uint32
		want   int
	}{
		{"full", prompt, r},
		{"mismatch-middle", edited, r / 2 / defaultBlockSize * defaultBlockSize},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				n, err := fp.CommonPrefix(c.prompt)
				if err != nil || n != c.want {
					b.Fatalf("commonPrefix = %d, %v; want %d", n, err, c.want)
				}
			}
		})
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
			fp := New(old[:r-min(r, 5)], old[r-min(r, 5):], r, bs)
			// The next rendered prompt: the old sequence, then more.
			rendered := append(slices.Clone(old[:r]), ids(50)...)
			cp, err := fp.VerifyPrefix(rendered)
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
				want := New(c.prompt, gen, n, c.bs)
				got := From(cp, c.prompt, gen, n, c.bs)
				require.Equal(t, want, got, "bs %d r %d: %s", bs, r, c.name)
			}
			// A partial match: the chain up to the last matching block.
			bad := with(rendered, r-1, rendered[r-1]+1)
			cp, err = fp.VerifyPrefix(bad)
			require.NoError(t, err)
			wantN, _ := fp.CommonPrefix(bad)
			require.Equal(t, wantN, cp.n)
			n := len(bad) + len(gen)
			require.Equal(t, New(bad, gen, n, bs), From(cp, bad, gen, n, bs), "bs %d r %d: partial", bs, r)
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
		fp := New(old, nil, len(old), int(bs))
		cp, err := fp.VerifyPrefix(next)
		require.NoError(t, err)
		n, _ := fp.CommonPrefix(next)
		require.Equal(t, n, cp.n)
		gen := fuzzIDs(a[:min(len(a), int(extra))])
		for _, bsz := range []int{int(bs), int(bs) + 1} {
			for m := 1; m <= len(next)+len(gen); m += 1 + len(next)/7 {
				want := New(next, gen, m, bsz)
				require.Equal(t, want, From(cp, next, gen, m, bsz))
				// Into a used buffer, with room or without.
				for _, dst := range [][]byte{make([]byte, 5, Size(m, bsz)), {9}} {
					require.Equal(t, want, AppendFrom(dst, cp, next, gen, m, bsz))
					require.Equal(t, want, Append(dst, next, gen, m, bsz))
				}
			}
		}
	})
}

// verifySerial is verifyPrefix as a walk over the tokens in order, one
// chain (the definition verifyPrefix's block-parallel check must match).
func verifySerial(f Fingerprint, prompt []uint32) (Prefix, error) {
	bs, n, hashes, err := f.parse()
	if err != nil {
		return Prefix{}, err
	}
	full := n / bs
	h := uint64(fpSeed)
	matched := 0
	prefix := func(m int, h uint64) Prefix {
		if m == 0 {
			return Prefix{}
		}
		return Prefix{ids: prompt, n: m, h: h, blockSize: bs, blocks: hashes[:8*(m/bs)]}
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

func requireSamePrefix(t *testing.T, want, got Prefix, msg string) {
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
			fp := New(seq[:r], nil, r, bs)
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
				got, err := fp.VerifyPrefix(p)
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
		fp := New(old, nil, len(old), int(bs))
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
		got, err := fp.VerifyPrefix(next)
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

// blockHashes collects what Blocks names.
func blockHashes(b Blocks) []uint64 {
	out := make([]uint64, b.Len())
	for i := range out {
		out[i] = b.At(i)
	}
	return out
}

// Blocks names each full block by its tokens and every token before it:
// two sequences share exactly the full blocks of their common prefix, and
// within one scope only.
func TestFingerprintBlocks(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	a := seqOf(rng, 100)
	b := slices.Clone(a)
	b[40] ^= 1 // the third block differs, and every one after it
	bsA, blocksA, okA := New(a, nil, 100, 16).Blocks(5)
	bsB, blocksB, okB := New(b, nil, 100, 16).Blocks(5)
	require.True(t, okA && okB)
	require.Equal(t, 16, bsA)
	require.Equal(t, 16, bsB)
	ha, hb := blockHashes(blocksA), blockHashes(blocksB)
	require.Len(t, ha, 6, "full blocks only")
	require.Len(t, hb, 6)
	assert.Equal(t, ha[:2], hb[:2])
	for i := 2; i < 6; i++ {
		assert.NotEqual(t, ha[i], hb[i])
	}
	// The first blocks of a longer sequence are the shorter one's.
	_, blocksC, _ := New(a, seqOf(rng, 30), 130, 16).Blocks(5)
	assert.Equal(t, ha, blockHashes(blocksC)[:6])
	// Another scope: no block in common.
	_, blocksD, _ := New(a, nil, 100, 16).Blocks(6)
	for i, h := range blockHashes(blocksD) {
		assert.NotEqual(t, ha[i], h)
	}
	bs, none, ok := Fingerprint{1, 2}.Blocks(5)
	assert.Zero(t, bs)
	assert.False(t, ok)
	assert.Zero(t, none.Len())
}

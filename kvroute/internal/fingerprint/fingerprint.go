// Package fingerprint keeps, with a retained KV handle, a compact record
// of the token sequence the decode engine's blocks hold, and verifies a new
// prompt against it block by block (kvroute's token verification).
package fingerprint

import (
	"encoding/binary"
	"errors"
	"slices"
)

// A Fingerprint is the compact record, kept with a retained handle, of the
// token sequence the decode engine's blocks hold: its first tokens positions,
// R = remote_num_tokens. It holds, for each full block of blockSize tokens, a
// 64-bit hash chained over every token up to the end of that block, and one
// such hash over all R tokens (the last, partial block included). The raw
// token ids are never kept.
//
// The per-token step h' = mix(h xor id) is a bijection of h for a fixed id
// and injective in id for a fixed h, so two sequences of equal length that
// differ in exactly one token never hash equal; any other difference
// collides with probability about 2^-64. Hashes are unkeyed and stable, so
// router replicas sharing a store agree.
//
// Encoded form: uvarint blockSize, uvarint R, then 8 bytes (little endian)
// per full block, then 8 bytes for the whole sequence.
type Fingerprint []byte

const fpSeed = 0x6b76726f75746531 // "kvroute1"

func fpMix(h uint64, id uint32) uint64 {
	h ^= uint64(id)
	h *= 0x9e3779b97f4a7c15
	h ^= h >> 29
	h *= 0xbf58476d1ce4e5b9
	h ^= h >> 32
	return h
}

// New fingerprints the first n tokens of the concatenation of
// prompt and generated, with blocks of blockSize tokens. It returns nil when
// fewer than n tokens are given.
func New(prompt, generated []uint32, n, blockSize int) Fingerprint {
	return Append(nil, prompt, generated, n, blockSize)
}

// Size is the most bytes a fingerprint of n tokens with blocks
// of blockSize takes.
func Size(n, blockSize int) int {
	return 2*binary.MaxVarintLen64 + 8*(n/max(blockSize, 1)+1)
}

// Append is New built in dst[:0] (a new slice when
// dst is nil or too small).
func Append(dst []byte, prompt, generated []uint32, n, blockSize int) Fingerprint {
	if n <= 0 || blockSize <= 0 || len(prompt)+len(generated) < n {
		return nil
	}
	b := fingerprintBuf(dst, n, blockSize)
	b = binary.AppendUvarint(b, uint64(blockSize))
	b = binary.AppendUvarint(b, uint64(n))
	return appendChain(b, fpSeed, 0, prompt, generated, n, blockSize)
}

var ErrMalformed = errors.New("kvroute: malformed token fingerprint")

// parse returns the block size, the token count and the hash bytes.
func (f Fingerprint) parse() (blockSize, tokens int, hashes []byte, err error) {
	bs, k := binary.Uvarint(f)
	if k <= 0 || bs == 0 || bs > 1<<20 {
		return 0, 0, nil, ErrMalformed
	}
	n, k2 := binary.Uvarint(f[k:])
	if k2 <= 0 || n == 0 || n > 1<<40 {
		return 0, 0, nil, ErrMalformed
	}
	hashes = f[k+k2:]
	if uint64(len(hashes)) != 8*(n/bs+1) {
		return 0, 0, nil, ErrMalformed
	}
	return int(bs), int(n), hashes, nil
}

// Blocks names the full blocks of a fingerprinted sequence by their
// hashes, each mixed with a scope (xor): the hash of block i is chained
// over every token up to its end, so that two sequences' block i hash
// equal (with one scope) only when their tokens up to there are equal.
// At reads one hash; nothing is copied.
type Blocks struct {
	hashes []byte // 8 bytes (little endian) per full block
	scope  uint64
}

// Len returns how many full blocks are named.
func (b Blocks) Len() int { return len(b.hashes) / 8 }

// At returns block i's hash, mixed with the scope (0 ≤ i < Len()).
func (b Blocks) At(i int) uint64 { return binary.LittleEndian.Uint64(b.hashes[8*i:]) ^ b.scope }

// Blocks returns the block size and the full blocks' hashes, mixed with
// scope; false for a malformed fingerprint. The Blocks read f.
func (f Fingerprint) Blocks(scope uint64) (blockSize int, blocks Blocks, ok bool) {
	bs, n, hashes, err := f.parse()
	if err != nil {
		return 0, Blocks{}, false
	}
	return bs, Blocks{hashes: hashes[:8*(n/bs)], scope: scope}, true
}

// CommonPrefix returns how many leading tokens of prompt are verified equal
// to the fingerprinted sequence: all R when prompt begins with the whole
// sequence, else the tokens of the full blocks that match (a multiple of the
// block size), else 0.
func (f Fingerprint) CommonPrefix(prompt []uint32) (int, error) {
	c, err := f.VerifyPrefix(prompt)
	return c.n, err
}

// A Prefix is the hash chain of New over the first n
// tokens of ids (n > 0): its state h after them and, for the full blocks
// of blockSize among them, the 8-byte block hashes. Fingerprinting a
// sequence that begins with those same tokens, with the same block size,
// can start from it instead of hashing them again.
type Prefix struct {
	ids       []uint32
	n         int
	h         uint64
	blockSize int
	blocks    []byte
}

// Tokens returns how many leading tokens the prefix covers (0: none).
func (c Prefix) Tokens() int { return c.n }

// VerifyPrefix is CommonPrefix, also returning the chain over the verified
// prefix (zero when none is verified). Its hashes are the fingerprint's own:
// each equals the chain computed over prompt up to that point, or the
// prefix would not have been verified.
//
// The chain is serial (each token's step waits for the one before), but
// the fingerprint holds its state at each block's end: once blocks 1..k-1
// are verified, the chain after them is the stored hash of block k-1, so
// block k can be checked from there. VerifyPrefix checks four blocks at
// once, each from the stored hash before it, which keeps the multiplier
// busy instead of waiting on one chain; the first block that differs ends
// the prefix, as in the token-by-token walk (verifySerial, its test
// oracle).
func (f Fingerprint) VerifyPrefix(prompt []uint32) (Prefix, error) {
	bs, n, hashes, err := f.parse()
	if err != nil {
		return Prefix{}, err
	}
	full := n / bs
	prefix := func(m int, h uint64) Prefix {
		if m == 0 {
			return Prefix{}
		}
		return Prefix{ids: prompt, n: m, h: h, blockSize: bs, blocks: hashes[:8*(m/bs)]}
	}
	stored := func(blk int) uint64 { // the chain after blk full blocks
		if blk == 0 {
			return fpSeed
		}
		return binary.LittleEndian.Uint64(hashes[8*(blk-1):])
	}
	// The full blocks of the sequence that prompt covers.
	blocks := min(len(prompt), n) / bs
	blk := 0
	for ; blk+4 <= blocks; blk += 4 {
		h0, h1, h2, h3 := stored(blk), stored(blk+1), stored(blk+2), stored(blk+3)
		p0 := prompt[blk*bs : (blk+1)*bs]
		p1 := prompt[(blk+1)*bs : (blk+2)*bs]
		p2 := prompt[(blk+2)*bs : (blk+3)*bs]
		p3 := prompt[(blk+3)*bs : (blk+4)*bs]
		for j := range p0 {
			h0 = fpMix(h0, p0[j])
			h1 = fpMix(h1, p1[j])
			h2 = fpMix(h2, p2[j])
			h3 = fpMix(h3, p3[j])
		}
		switch {
		case h0 != stored(blk+1):
			return prefix(blk*bs, stored(blk)), nil
		case h1 != stored(blk+2):
			return prefix((blk+1)*bs, stored(blk+1)), nil
		case h2 != stored(blk+3):
			return prefix((blk+2)*bs, stored(blk+2)), nil
		case h3 != stored(blk+4):
			return prefix((blk+3)*bs, stored(blk+3)), nil
		}
	}
	for ; blk < blocks; blk++ {
		h := stored(blk)
		for _, id := range prompt[blk*bs : (blk+1)*bs] {
			h = fpMix(h, id)
		}
		if h != stored(blk+1) {
			return prefix(blk*bs, stored(blk)), nil
		}
	}
	// Every full block matched: the whole sequence, when prompt covers it,
	// is checked from the last block's state by the final hash.
	if len(prompt) >= n {
		h := stored(full)
		for _, id := range prompt[full*bs : n] {
			h = fpMix(h, id)
		}
		if binary.LittleEndian.Uint64(hashes[8*full:]) == h {
			return prefix(n, h), nil
		}
	}
	return prefix(blocks*bs, stored(blocks)), nil
}

// From is New(prompt, generated, n, blockSize),
// starting from c when the sequence begins with c's tokens (they are
// compared, not trusted) and c has the same block size and fits in n;
// otherwise it hashes every token.
func From(c Prefix, prompt, generated []uint32, n, blockSize int) Fingerprint {
	return AppendFrom(nil, c, prompt, generated, n, blockSize)
}

// AppendFrom is From built in dst[:0] (a new slice
// when dst is nil or too small).
func AppendFrom(dst []byte, c Prefix, prompt, generated []uint32, n, blockSize int) Fingerprint {
	if c.n == 0 || c.blockSize != blockSize || c.n > n || c.n > len(prompt) || c.n > len(c.ids) ||
		!(SameIDs(prompt, c.ids) || slices.Equal(prompt[:c.n], c.ids[:c.n])) || len(prompt)+len(generated) < n || blockSize <= 0 {
		return Append(dst, prompt, generated, n, blockSize)
	}
	b := fingerprintBuf(dst, n, blockSize)
	b = binary.AppendUvarint(b, uint64(blockSize))
	b = binary.AppendUvarint(b, uint64(n))
	b = append(b, c.blocks...)
	return appendChain(b, c.h, c.n, prompt[c.n:], generated, n, blockSize)
}

// fingerprintBuf returns dst[:0] when it has room for a fingerprint of n
// tokens, else a new slice with just that room.
func fingerprintBuf(dst []byte, n, blockSize int) []byte {
	if size := Size(n, blockSize); cap(dst) < size {
		return make([]byte, 0, size)
	}
	return dst[:0]
}

// appendChain continues the chain with state h after pos tokens over the
// tokens of rest and then generated, up to n tokens, appending each full
// block's hash and then the final one to b.
func appendChain(b []byte, h uint64, pos int, rest, generated []uint32, n, blockSize int) []byte {
	feed := func(ids []uint32) {
		for _, id := range ids {
			if pos == n {
				return
			}
			h = fpMix(h, id)
			pos++
			if pos%blockSize == 0 {
				b = binary.LittleEndian.AppendUint64(b, h)
			}
		}
	}
	feed(rest)
	feed(generated)
	return binary.LittleEndian.AppendUint64(b, h)
}

// SameIDs reports whether a and b are non-empty and start at the same
// element of one array (D's prompt ids taken as the rendered ones), so
// that their common length is equal without being compared.
func SameIDs(a, b []uint32) bool {
	return len(a) > 0 && len(b) > 0 && &a[0] == &b[0]
}

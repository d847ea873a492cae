package kvroute

import (
	"encoding/binary"
	"errors"
)

// A fingerprint is the compact record, kept with a retained handle, of the
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
type fingerprint []byte

const fpSeed = 0x6b76726f75746531 // "kvroute1"

func fpMix(h uint64, id uint32) uint64 {
	h ^= uint64(id)
	h *= 0x9e3779b97f4a7c15
	h ^= h >> 29
	h *= 0xbf58476d1ce4e5b9
	h ^= h >> 32
	return h
}

// newFingerprint fingerprints the first n tokens of the concatenation of
// prompt and generated, with blocks of blockSize tokens. It returns nil when
// fewer than n tokens are given.
func newFingerprint(prompt, generated []uint32, n, blockSize int) fingerprint {
	if n <= 0 || blockSize <= 0 || len(prompt)+len(generated) < n {
		return nil
	}
	full := n / blockSize
	b := make([]byte, 0, 2*binary.MaxVarintLen64+8*(full+1))
	b = binary.AppendUvarint(b, uint64(blockSize))
	b = binary.AppendUvarint(b, uint64(n))
	h := uint64(fpSeed)
	pos := 0
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
	feed(prompt)
	feed(generated)
	return binary.LittleEndian.AppendUint64(b, h)
}

var errBadFingerprint = errors.New("kvroute: malformed token fingerprint")

// parse returns the block size, the token count and the hash bytes.
func (f fingerprint) parse() (blockSize, tokens int, hashes []byte, err error) {
	bs, k := binary.Uvarint(f)
	if k <= 0 || bs == 0 || bs > 1<<20 {
		return 0, 0, nil, errBadFingerprint
	}
	n, k2 := binary.Uvarint(f[k:])
	if k2 <= 0 || n == 0 || n > 1<<40 {
		return 0, 0, nil, errBadFingerprint
	}
	hashes = f[k+k2:]
	if uint64(len(hashes)) != 8*(n/bs+1) {
		return 0, 0, nil, errBadFingerprint
	}
	return int(bs), int(n), hashes, nil
}

// commonPrefix returns how many leading tokens of prompt are verified equal
// to the fingerprinted sequence: all R when prompt begins with the whole
// sequence, else the tokens of the full blocks that match (a multiple of the
// block size), else 0.
func (f fingerprint) commonPrefix(prompt []uint32) (int, error) {
	bs, n, hashes, err := f.parse()
	if err != nil {
		return 0, err
	}
	full := n / bs
	h := uint64(fpSeed)
	matched := 0
	for i, id := range prompt {
		if i == n {
			break
		}
		h = fpMix(h, id)
		if (i+1)%bs == 0 {
			blk := (i + 1) / bs
			if binary.LittleEndian.Uint64(hashes[8*(blk-1):]) != h {
				return matched, nil
			}
			matched = blk * bs
		}
	}
	if len(prompt) >= n && binary.LittleEndian.Uint64(hashes[8*full:]) == h {
		return n, nil
	}
	return matched, nil
}

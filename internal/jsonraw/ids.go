package jsonraw

import (
	"encoding/binary"
	"math/bits"
)

// AppendUint32s converts the JSON array that starts at data[i] (after any
// whitespace) when every element is an integer in [0, 2^32) written
// without sign, fraction or exponent (the shape of a token id list),
// appending the values to dst. It returns the index just past the closing
// ']' and true; or dst with its original length and false for any other
// value, valid JSON or not, and for input that ends early. It does not
// look at the bytes after the array.
func AppendUint32s(dst []uint32, data []byte, i int) ([]uint32, int, bool) {
	n := len(dst)
	i = skipSpace(data, i)
	if i >= len(data) || data[i] != '[' {
		return dst, i, false
	}
	i = skipSpace(data, i+1)
	if i < len(data) && data[i] == ']' {
		return dst, i + 1, true
	}
	for {
		if i+72 <= len(data) {
			var j int
			if dst, j = appendIDBlock(dst, data, i); j > i {
				i = j
				if data[i]-'0' > 9 {
					i = skipSpace(data, i)
				}
				continue
			}
		}
		if i+8 <= len(data) {
			// uint32At's eight-byte step, inlined for the common id of
			// one to seven digits.
			x := binary.LittleEndian.Uint64(data[i:])
			m := (x | (x + 0x4646464646464646) | (x - 0x3030303030303030)) & msb
			if k := bits.TrailingZeros64(m) >> 3; k > 0 && k < 8 && (k == 1 || data[i] != '0') {
				dst = append(dst, digits8(x, k))
				i += k
				if data[i] == ',' {
					i++
					if i < len(data) && data[i]-'0' <= 9 {
						continue
					}
					i = skipSpace(data, i)
					continue
				}
				goto separator
			}
		}
		{
			v, end, ok := uint32At(data, i)
			if !ok {
				return dst[:n], end, false
			}
			dst = append(dst, v)
			i = end
		}
	separator:
		if i < len(data) && data[i] == ',' {
			// The common case: "1,2,3" without spaces.
			i++
			if i < len(data) && data[i]-'0' <= 9 {
				continue
			}
			i = skipSpace(data, i)
			continue
		}
		i = skipSpace(data, i)
		if i >= len(data) {
			return dst[:n], i, false
		}
		switch data[i] {
		case ',':
			i = skipSpace(data, i+1)
		case ']':
			return dst, i + 1, true
		default:
			return dst[:n], i, false
		}
	}
}

// appendIDBlock appends the ids of "d,dd,ddd," runs in the 64 bytes from
// data[i] (i+72 <= len(data)): each id of one to seven digits, without a
// leading zero, that ends with a comma in a word of eight bytes holding
// only digits and commas. It returns the index after the last such comma,
// or i when there is none; the id found there is left to the general
// path. The commas of a word are found at once, so the ids' conversions do
// not wait on one another.
func appendIDBlock(dst []uint32, data []byte, i int) ([]uint32, int) {
	start := i
	for p := i; p < i+64; p += 8 {
		x := binary.LittleEndian.Uint64(data[p:])
		// Per byte, without carries between bytes: top bit set unless
		// the byte is a digit, and unless it is a comma.
		low := x &^ msb
		nondigit := (x | (low + 0x4646464646464646) | ^(low + 0x5050505050505050)) & msb
		v := x ^ 0x2c2c2c2c2c2c2c2c
		comma := ^((v&^msb + 0x7f7f7f7f7f7f7f7f) | v) & msb
		if nondigit != comma {
			break // a byte that is neither
		}
		for ; comma != 0; comma &= comma - 1 {
			e := p + bits.TrailingZeros64(comma)>>3
			k := e - start
			if k < 1 || k > 7 || (k > 1 && data[start] == '0') {
				return dst, start
			}
			dst = append(dst, digits8(binary.LittleEndian.Uint64(data[start:]), k))
			start = e + 1
		}
	}
	return dst, start
}

// uint32At reads the unsigned integer at data[i]: at most ten digits, no
// leading zero, below 2^32. It returns the index after its last digit.
func uint32At(data []byte, i int) (uint32, int, bool) {
	if i+8 <= len(data) {
		// Eight bytes at once: the digits before the first non-digit.
		x := binary.LittleEndian.Uint64(data[i:])
		// A byte is a digit when it is neither above '9' (adding 0x46
		// sets its top bit), below '0' (subtracting 0x30 borrows into
		// it) nor at or above 0x80. Carries and borrows only cross from
		// a byte that is itself flagged, so the lowest flag is exact.
		m := (x | (x + 0x4646464646464646) | (x - 0x3030303030303030)) & msb
		k := bits.TrailingZeros64(m) >> 3 // the number of leading digits, 0 to 8
		if k > 0 && k < 8 {
			if k > 1 && data[i] == '0' {
				return 0, i, false
			}
			return digits8(x, k), i + k, true
		}
		if k == 0 {
			return 0, i, false
		}
	}
	start := i
	var v uint64
	for i < len(data) && i-start <= 10 {
		c := data[i] - '0'
		if c > 9 {
			break
		}
		v = v*10 + uint64(c)
		i++
	}
	if i == start || i-start > 10 || v > 1<<32-1 || (data[start] == '0' && i-start > 1) {
		return 0, i, false
	}
	return uint32(v), i, true
}

// digits8 returns the value of the k (1 to 7) ASCII digits in the low
// bytes of x, the first digit in the lowest byte.
func digits8(x uint64, k int) uint32 {
	// The k digits as the last k of eight, the rest zeros, then combined
	// pairwise.
	y := (x << (64 - 8*uint(k))) & 0x0f0f0f0f0f0f0f0f
	y = (y * 2561) >> 8
	y = ((y & 0x00ff00ff00ff00ff) * 6553601) >> 16
	y = ((y & 0x0000ffff0000ffff) * 42949672960001) >> 32
	return uint32(y)
}

// ResetIDs is Reset, except that the value of a top-level member whose key
// is spelled key literally (no escapes), when it is such an array of
// integers (see AppendUint32s), is converted while it is validated: its
// values are appended to ids[:0], and the result is returned with the
// member's index. The index is -1 when no member has that key spelled so,
// more than one member has that key (however spelled), or the value is
// not such an array (the member is
// then only validated, as by Reset); the returned ids then hold nothing
// meaningful. A document is accepted or rejected, with the same error,
// exactly as by Reset.
func (o *Object) ResetIDs(data []byte, key string, ids []uint32) ([]uint32, int, error) {
	ids, member, _, err := o.ResetIDsKnown(data, key, ids, nil)
	return ids, member, err
}

// ResetIDsKnown is ResetIDs with the text of an id array the caller has
// already converted: known must be, byte for byte, an array AppendUint32s
// accepts in full (from '[' to its ']', no surrounding whitespace), such as
// the value of the member a ResetIDs call converted. When the value of the
// member ResetIDs would convert has exactly known's bytes, it is taken
// without being read again: same is true, the member's index is returned,
// and ids is returned as given (ids[:0]), the caller's ids for known being
// the member's. Otherwise (no known, or any other value) it is ResetIDs.
// A document is accepted or rejected, with the same error, exactly as by
// Reset, provided known is such an array; known is not checked, and it is
// not retained.
func (o *Object) ResetIDsKnown(data []byte, key string, ids []uint32, known []byte) (_ []uint32, member int, same bool, _ error) {
	if len(known) < 2 || known[0] != '[' || known[len(known)-1] != ']' {
		known = nil // not an array's text: no shortcut
	}
	members := o.members[:0]
	*o = Object{}
	i := skipSpace(data, 0)
	if i >= len(data) || data[i] != '{' {
		o.members = members
		return ids, -1, false, o.Reset(data)
	}
	s := scanner{data: data, idKnown: known}
	s.idKey, s.ids, s.idMember = key, ids[:0], -1
	members, end, err := indexObject(&s, data, i, members)
	ids = s.ids
	if err != nil {
		o.members = members
		return ids, -1, false, err
	}
	member = s.idMember
	if s.idSeen > 1 {
		member = -1
	}
	for k := range members {
		if member >= 0 && members[k].escaped && members[k].key == key {
			member = -1 // the same key, spelled with escapes
		}
	}
	o.data, o.open, o.close, o.members = data, i, end-1, members
	return ids, member, member >= 0 && s.idKnownHit, nil
}

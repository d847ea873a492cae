package entry

import (
	"bytes"
	"encoding/binary"
	"math"
	"slices"
	"strconv"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/bufpool"
)

// compactHandle appends h with its remote_block_ids stored as varint
// deltas (the JSON before and after the list, then the ids), about a
// fifth of their decimal JSON. ok is false (dst unchanged) when h has no
// such list of integer lists, or a flat list, or when appendExpanded would
// not give back exactly h (spacing, number spelling): the handle is then
// stored verbatim. That check expands into a buffer from pool (nil: a new
// one), unless the list's length already proves it.
func compactHandle(dst, h []byte, bufs *bufpool.Bytes) ([]byte, bool) {
	return compactHandleCheck(dst, h, bufs, false)
}

// compactKnown is compactHandle for a handle whose remote_block_ids is at
// known (kvhandle.Check's Info.Blocks: integer lists without leading
// zeros): the list is read once, its varint deltas written as its digits
// are read, without parsing the handle or converting the ids into a
// slice first. ok is false (dst unchanged) when the list is not written
// as expansion writes it (whitespace): the general path then decides.
func compactKnown(dst, h []byte, known jsonraw.Known) ([]byte, bool) {
	if known.End <= known.Start || known.End > len(h) || known.Max >= 1<<62 {
		return dst, false
	}
	v := h[known.Start:known.End]
	n := len(dst)
	dst = appendBytes(dst, h[:known.Start])
	dst = appendBytes(dst, h[known.End:])
	groups, i := 1, 0
	if known.Lists.Nested {
		groups, i = known.Lists.Lists, 1
		dst = append(dst, 1)
	} else {
		dst = append(dst, 0)
	}
	dst = binary.AppendUvarint(dst, uint64(groups))
	var prev int64
	for g := range groups {
		if g > 0 {
			if i >= len(v) || v[i] != ',' {
				return dst[:n], false
			}
			i++
		}
		end := bytes.IndexByte(v[i:], ']') + i
		if i >= len(v) || v[i] != '[' || end < i {
			return dst[:n], false
		}
		var ok bool
		if dst, prev, ok = appendDeltas(dst, v[i+1:end], prev); !ok {
			return dst[:n], false
		}
		i = end + 1
	}
	if known.Lists.Nested {
		if i >= len(v) || v[i] != ']' {
			return dst[:n], false
		}
		i++
	}
	if i != len(v) {
		return dst[:n], false
	}
	return dst, true
}

// appendDeltas appends the count of the ids in g, the text of one list
// between its brackets ("12,345,6"), then each id less the one before it
// (prev, carried from list to list) as varints. ok is false for any other
// text than digits and single commas.
func appendDeltas(dst, g []byte, prev int64) (_ []byte, last int64, ok bool) {
	if len(g) == 0 {
		return append(dst, 0), prev, true
	}
	dst = binary.AppendUvarint(dst, uint64(bytes.Count(g, []byte{','})+1))
	for i := 0; ; {
		var id int64
		j := i
		for j < len(g) && g[j]-'0' <= 9 {
			id = id*10 + int64(g[j]-'0')
			j++
		}
		if j == i || j-i > 18 {
			return dst, prev, false
		}
		dst = binary.AppendVarint(dst, id-prev)
		prev = id
		if j == len(g) {
			return dst, prev, true
		}
		if g[j] != ',' {
			return dst, prev, false
		}
		i = j + 1
	}
}

// compactHandleCheck is compactHandle; expand forces the check by
// expansion even when the list's length shows its text is the one
// expansion writes (the test oracle).
func compactHandleCheck(dst, h []byte, bufs *bufpool.Bytes, expand bool) ([]byte, bool) {
	obj, err := jsonraw.Parse(h)
	if err != nil {
		return dst, false
	}
	v, ok := obj.Get("remote_block_ids")
	if !ok || len(v) < 2 || v[0] != '[' {
		return dst, false
	}
	at := bytes.Index(h, v) // any occurrence: the bytes are the same
	if at < 0 {
		return dst, false
	}
	nested := bytes.TrimLeft(v[1:], " ")[0] == '['
	groups := [][]byte{v}
	if nested {
		groups = groups[:0]
		if jsonraw.Elements(v, func(g []byte) error { groups = append(groups, g); return nil }) != nil {
			return dst, false
		}
	}
	n := len(dst)
	dst = appendBytes(dst, h[:at])
	dst = appendBytes(dst, h[at+len(v):])
	if nested {
		dst = append(dst, 1)
	} else {
		dst = append(dst, 0)
	}
	dst = binary.AppendUvarint(dst, uint64(len(groups)))
	dst, canonical, written, ok := appendGroups(dst, groups)
	if !ok {
		return dst[:n], false
	}
	if !nested {
		written -= 2 + len(groups) - 1 // no outer brackets
	}
	if canonical && !expand {
		// AppendUint32s took only digits (no leading zero), commas and
		// whitespace, so a list of the length expansion writes (each id
		// in its shortest decimal, brackets and commas, no whitespace) is
		// byte for byte what it writes; h around it is kept verbatim.
		if written != len(v) {
			return dst[:n], false
		}
		return dst, true
	}
	if !expandsTo(dst[n:], h, bufs) {
		return dst[:n], false
	}
	return dst, true
}

// appendGroups appends each group's count and its ids as varint deltas.
// canonical says every group took the fast path; written is then the
// length of the list's text as expansion writes it.
func appendGroups(dst []byte, groups [][]byte) (_ []byte, canonical bool, written int, ok bool) {
	var prev int64
	var scratch [2048]uint32 // 32k tokens in blocks of 16, on the stack
	canonical, written = true, 2+len(groups)-1
	for _, g := range groups {
		// The common shape, block ids below 2^32, in one pass; any other
		// goes through the general path below, whose result is checked by
		// expanding it again.
		if ids, end, ok := jsonraw.AppendUint32s(scratch[:0], g, 0); ok && end == len(g) {
			dst = binary.AppendUvarint(dst, uint64(len(ids)))
			glen := 2 + max(len(ids)-1, 0) // brackets and commas
			for _, id := range ids {
				dst = binary.AppendVarint(dst, int64(id)-prev)
				prev = int64(id)
				glen += decimalLen(id)
			}
			canonical = canonical && glen == len(g)
			written += glen
			continue
		}
		canonical = false
		count := 0
		if jsonraw.Elements(g, func([]byte) error { count++; return nil }) != nil {
			return dst, false, 0, false
		}
		dst = binary.AppendUvarint(dst, uint64(count))
		err := jsonraw.Elements(g, func(e []byte) error {
			id, ok := jsonraw.Int(e)
			if !ok || id < 0 {
				return errStop
			}
			dst = binary.AppendVarint(dst, id-prev)
			prev = id
			return nil
		})
		if err != nil {
			return dst, false, 0, false
		}
	}
	return dst, canonical, written, true
}

// expandsTo reports whether the compacted handle c expands to exactly h,
// expanding into a buffer from bufs (nil: a new one).
func expandsTo(c, h []byte, bufs *bufpool.Bytes) bool {
	var check []byte
	if bufs != nil {
		check = bufs.Get(len(h))[:0] // an exact expansion fits
	}
	back, err := appendExpanded(check, c)
	same := err == nil && bytes.Equal(back, h)
	if bufs != nil {
		if back == nil {
			back = check
		}
		bufs.Put(back)
	}
	return same
}

// decimalLen is the number of decimal digits of v.
func decimalLen(v uint32) int {
	switch {
	case v < 10:
		return 1
	case v < 100:
		return 2
	case v < 1000:
		return 3
	case v < 10000:
		return 4
	case v < 100000:
		return 5
	case v < 1000000:
		return 6
	case v < 10000000:
		return 7
	case v < 100000000:
		return 8
	case v < 1000000000:
		return 9
	}
	return 10
}

// appendExpanded appends the handle stored by compactHandle in b to dst
// (nil: a new slice sized for the handle).
func appendExpanded(dst, b []byte) ([]byte, error) {
	out, _, err := appendExpandedKnown(dst, b)
	return out, err
}

// appendExpandedKnown is appendExpanded; it also returns where the list it
// wrote is in the result, with its shape and largest id (the zero Known
// when an id is negative: such a list is no block list).
func appendExpandedKnown(dst, b []byte) ([]byte, jsonraw.Known, error) {
	r := entryReader{b: b}
	head, tail := r.bytes(), r.bytes()
	nested := r.byte() == 1
	groups := r.uvarint()
	var known jsonraw.Known
	if r.bad || groups > uint64(len(r.b)) || (!nested && groups != 1) {
		return nil, known, ErrBad
	}
	out := dst
	if out == nil {
		out = make([]byte, 0, len(head)+len(tail)+7*len(r.b)+8)
	}
	out = append(out, head...)
	known.Start = len(out)
	out = append(out, '[')
	var prev int64
	negative := false
	for g := range groups {
		if g > 0 {
			out = append(out, ',')
		}
		if nested {
			out = append(out, '[')
		}
		n := r.uvarint()
		if r.bad || n > uint64(len(r.b)) {
			return nil, jsonraw.Known{}, ErrBad
		}
		var ok bool
		if out, prev, ok = appendIDs(out, &r, n, prev, &known.Max); !ok {
			return nil, jsonraw.Known{}, ErrBad
		}
		negative = negative || known.Max > math.MaxInt64
		if nested {
			out = append(out, ']')
		}
		known.Lists.Longest = max(known.Lists.Longest, int(n))
	}
	if r.bad || len(r.b) != 0 {
		return nil, jsonraw.Known{}, ErrBad
	}
	out = append(out, ']')
	known.End = len(out)
	if nested && groups > 0 {
		known.Lists.Nested, known.Lists.Lists = true, int(groups)
	}
	if negative {
		known = jsonraw.Known{}
	}
	return append(out, tail...), known, nil
}

// appendIDs appends the n ids that follow in r, each a varint delta from
// the one before (prev), in decimal and separated by commas; it returns
// the last id, and raises *maxID to the largest, as a uint64 (a negative
// id is above math.MaxInt64). The common one-byte delta is read inline and
// the digits written in place, without a call per id.
func appendIDs(out []byte, r *entryReader, n uint64, prev int64, maxID *uint64) ([]byte, int64, bool) {
	b := r.b
	k := 0
	var top uint64
	for i := range n {
		var delta int64
		if k < len(b) && b[k] < 0x80 {
			ux := uint64(b[k])
			k++
			delta = int64(ux >> 1)
			if ux&1 != 0 {
				delta = ^delta
			}
		} else {
			v, m := binary.Varint(b[k:])
			if m <= 0 {
				return out, prev, false
			}
			delta, k = v, k+m
		}
		prev += delta
		if cap(out)-len(out) < 24 {
			out = slices.Grow(out, 24+11*int(n-i))
		}
		if i > 0 {
			out = append(out, ',')
		}
		if prev < 0 {
			out = strconv.AppendInt(out, prev, 10)
			top = math.MaxUint64
			continue
		}
		top = max(top, uint64(prev))
		out = appendDecimal(out, uint64(prev))
	}
	r.b = b[k:]
	*maxID = max(*maxID, top)
	return out, prev, true
}

// digitPairs holds "00" to "99".
const digitPairs = "00010203040506070809101112131415161718192021222324252627282930313233343536373839" +
	"40414243444546474849505152535455565758596061626364656667686970717273747576777879" +
	"8081828384858687888990919293949596979899"

// appendDecimal appends v in decimal, writing its digits in place two at
// a time from the last (out has room for them).
func appendDecimal(out []byte, v uint64) []byte {
	if v >= 1_000_000_000 {
		return strconv.AppendUint(out, v, 10)
	}
	n := decimalLen(uint32(v))
	end := len(out) + n
	out = out[:end]
	d := out[end-n : end]
	i := n
	for v >= 100 {
		q := v / 100
		r := 2 * (v - 100*q)
		i -= 2
		d[i+1], d[i] = digitPairs[r+1], digitPairs[r]
		v = q
	}
	if v >= 10 {
		d[1], d[0] = digitPairs[2*v+1], digitPairs[2*v]
	} else {
		d[0] = byte('0' + v)
	}
	return out
}

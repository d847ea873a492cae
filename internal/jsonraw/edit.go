package jsonraw

import "slices"

// Member is a key and a raw JSON value to set with Object.Edit.
type Member struct {
	// Key is the unescaped member name. It must be valid UTF-8, as every
	// decoded key is (invalid bytes decode to U+FFFD).
	Key string
	// Value is the raw JSON value, written verbatim. It is not validated;
	// an empty Value is written as null.
	Value []byte
}

// Edit returns a new document in which every member whose key is in del is
// removed (all duplicates), and then each Member in set either replaces the
// member with that key, keeping the position (and the raw key spelling) of
// its first occurrence and removing any duplicates, or, if there is none
// (including because del removed it), is appended at the end. When set
// names a key more than once the later value wins.
//
// All bytes outside the removed and replaced members are copied verbatim.
// When nothing changes Edit returns the original bytes; otherwise it returns
// a newly allocated slice and never modifies the input.
func (o Object) Edit(del []string, set ...Member) []byte {
	if o.data == nil {
		o = Object{data: []byte("{}"), close: 1}
	}
	out, changed := o.appendEdit(nil, false, del, set)
	if !changed {
		return o.data
	}
	return out
}

// AppendEdit appends Edit's result to dst and reports whether anything
// changed: when nothing does, it appends the document itself. It lets a
// caller that edits many documents in turn reuse one buffer; dst must not
// overlap the document or the values in set.
func (o Object) AppendEdit(dst []byte, del []string, set ...Member) ([]byte, bool) {
	if o.data == nil {
		o = Object{data: []byte("{}"), close: 1}
	}
	return o.appendEdit(dst, true, del, set)
}

// appendEdit appends the edited document to dst; when nothing changes it
// appends the document itself if whole is set, else nothing.
func (o Object) appendEdit(dst []byte, whole bool, del []string, set []Member) ([]byte, bool) {
	var smallAct [16]int
	var smallApp [4]int
	act, appends, changed := o.plan(del, set, smallAct[:0], smallApp[:0])
	if !changed {
		if whole {
			dst = append(dst, o.data...)
		}
		return dst, false
	}
	var small [24][]byte
	pieces := o.pieces(small[:0], nil, act, appends, set)
	size := 0
	for _, p := range pieces {
		size += len(p)
	}
	dst = slices.Grow(dst, size)
	for _, p := range pieces {
		dst = append(dst, p...)
	}
	return dst, true
}

// EditPieces is Edit without the copy: it appends to dst the pieces whose
// concatenation is Edit's result, in order. The pieces alias the document
// and the values in set (which must not change while they are used); only
// the keys of appended members are newly allocated. When nothing changes
// the one piece is the document itself.
func (o Object) EditPieces(dst [][]byte, del []string, set ...Member) [][]byte {
	if o.data == nil {
		o = Object{data: []byte("{}"), close: 1}
	}
	var smallAct [16]int
	var smallApp [4]int
	act, appends, changed := o.plan(del, set, smallAct[:0], smallApp[:0])
	if !changed {
		return append(dst, o.data)
	}
	n := 0
	for _, k := range appends {
		n += len(set[k].Key) + 8
	}
	return o.pieces(dst, make([]byte, 0, n), act, appends, set)
}

// plan decides Edit's action per member: -1 keep, -2 drop, k >= 0 replace
// the value with set[k]; appends are the indexes into set of members to
// append, in order of first appearance.
func (o Object) plan(del []string, set []Member, act, appends []int) ([]int, []int, bool) {
	if len(o.members) > cap(act) {
		act = make([]int, 0, len(o.members))
	}
	changed := false
	for i := range o.members {
		act = append(act, -1)
		m := &o.members[i]
		for _, k := range del {
			if o.keyIs(m, k) {
				act[i] = -2
				changed = true
				break
			}
		}
	}
	for k := range set {
		first := -1
		for i := range o.members {
			if act[i] == -2 || !o.keyIs(&o.members[i], set[k].Key) {
				continue
			}
			if first < 0 {
				first = i
				if act[i] == -1 {
					m := &o.members[i]
					if string(o.data[m.valStart:m.valEnd]) != string(value(set[k].Value)) {
						changed = true
					}
				} else {
					changed = true
				}
				act[i] = k
			} else {
				act[i] = -2
				changed = true
			}
		}
		if first >= 0 {
			continue
		}
		// Not present in the source: append, or overwrite an earlier append.
		dup := false
		for j, a := range appends {
			if set[a].Key == set[k].Key {
				appends[j] = k
				dup = true
				break
			}
		}
		if !dup {
			appends = append(appends, k)
		}
		changed = true
	}
	return act, appends, changed
}

var (
	pieceComma = []byte(",")
	pieceColon = []byte(":")
)

// pieces appends the edited document to dst as pieces; the quoted keys of
// appended members are written into keys (which must have room for them
// all, so that earlier pieces stay valid).
func (o Object) pieces(dst [][]byte, keys []byte, act, appends []int, set []Member) [][]byte {
	dst = append(dst, o.data[:o.open+1])
	wrote := false
	var tail []byte // whitespace between the last written value and '}'
	prevEnd := 0    // the end (its ',') of the last written member
	for i := range o.members {
		a := act[i]
		if a == -2 {
			continue
		}
		m := &o.members[i]
		if wrote {
			// The previous member's trailing whitespace, then its own
			// ',' from the document: a run of members kept as they are
			// stays one piece, however many members it has.
			dst = appendPiece(dst, tail)
			dst = appendPiece(dst, o.data[prevEnd:prevEnd+1])
		}
		wrote = true
		prevEnd = m.end
		if a == -1 {
			dst = appendPiece(dst, o.data[m.start:m.valEnd])
		} else {
			dst = appendPiece(dst, o.data[m.start:m.valStart])
			dst = append(dst, value(set[a].Value))
		}
		tail = o.data[m.valEnd:m.end]
	}
	switch {
	case wrote:
		// New members go before the whitespace that preceded '}'.
	case len(o.members) == 0:
		tail = o.data[o.open+1 : o.close]
	default:
		// Every member was removed: keep the whitespace before '}' only.
		last := &o.members[len(o.members)-1]
		tail = o.data[last.valEnd:last.end]
	}
	for _, k := range appends {
		if wrote {
			dst = append(dst, pieceComma)
		}
		wrote = true
		at := len(keys)
		if keys == nil {
			keys = make([]byte, 0, len(set[k].Key)+8)
		}
		keys = AppendQuote(keys, set[k].Key)
		dst = append(dst, keys[at:len(keys):len(keys)], pieceColon, value(set[k].Value))
	}
	dst = appendPiece(dst, tail)
	return appendPiece(dst, o.data[o.close:])
}

// appendPiece appends p unless it is empty; a piece that continues the
// previous one in the same array is merged into it.
func appendPiece(dst [][]byte, p []byte) [][]byte {
	if len(p) == 0 {
		return dst
	}
	if n := len(dst); n > 0 {
		last := dst[n-1]
		if cap(last) > len(last) && len(p) > 0 && &last[:len(last)+1][len(last)] == &p[0] {
			dst[n-1] = last[:len(last)+len(p)]
			return dst
		}
	}
	return append(dst, p)
}

func value(v []byte) []byte {
	if len(v) == 0 {
		return []byte("null")
	}
	return v
}

package jsonraw

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
	// action per member: -1 keep, -2 drop, k >= 0 replace value with set[k].
	var small [16]int
	act := small[:0]
	if len(o.members) > len(small) {
		act = make([]int, 0, len(o.members))
	}
	changed := false
	var appendSmall [4]int
	appends := appendSmall[:0] // indexes into set, in order of first appearance
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
	if !changed {
		return o.data
	}

	// The output: the input less the members removed or replaced, plus
	// the new members (sized exactly, so removing a large member does not
	// allocate for it).
	size := len(o.data)
	for i, a := range act {
		if a != -1 {
			m := &o.members[i]
			size -= m.end - m.start
		}
	}
	for _, k := range set {
		size += len(k.Key) + len(k.Value) + 8
	}
	if size < 0 {
		size = 0
	}
	out := make([]byte, 0, size)
	out = append(out, o.data[:o.open+1]...)
	wrote := false
	var tail []byte // whitespace between the last written value and '}'
	for i := range o.members {
		a := act[i]
		if a == -2 {
			continue
		}
		m := &o.members[i]
		if wrote {
			out = append(out, ',')
		}
		wrote = true
		if a == -1 {
			out = append(out, o.data[m.start:m.valEnd]...)
		} else {
			out = append(out, o.data[m.start:m.valStart]...)
			out = append(out, value(set[a].Value)...)
		}
		tail = o.data[m.valEnd:m.end]
		out = append(out, tail...)
	}
	switch {
	case wrote:
		// Insert new members before the whitespace that preceded '}'.
		out = out[:len(out)-len(tail)]
	case len(o.members) == 0:
		tail = o.data[o.open+1 : o.close]
	default:
		// Every member was removed: keep the whitespace before '}' only.
		last := &o.members[len(o.members)-1]
		tail = o.data[last.valEnd:last.end]
	}
	for _, k := range appends {
		if wrote {
			out = append(out, ',')
		}
		wrote = true
		out = AppendQuote(out, set[k].Key)
		out = append(out, ':')
		out = append(out, value(set[k].Value)...)
	}
	out = append(out, tail...)
	return append(out, o.data[o.close:]...)
}

func value(v []byte) []byte {
	if len(v) == 0 {
		return []byte("null")
	}
	return v
}

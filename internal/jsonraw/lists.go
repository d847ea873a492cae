package jsonraw

// Lists is the shape of a JSON array of integer arrays, or of a flat array
// of integers, as IntLists read it.
type Lists struct {
	Nested  bool // an array of arrays; false: a flat array of integers (or [])
	Lists   int  // the inner arrays (0 when flat)
	Longest int  // the elements of the longest inner array (of the array when flat)
}

// swarMin is the least limit for which IntLists takes runs of short
// integers in its tight loop: an integer it takes so is one of at most
// seven digits.
const swarMin = 9_999_999

// IntLists reads v when it is a JSON array of arrays of integers or an
// array of integers, each integer from 0 to limit written with digits
// only (no sign, fraction or exponent), and returns its shape; ok is false
// for any other value (mixed arrays, other elements, malformed JSON,
// anything before or after the array). It reads v once, in a tight loop over
// runs of short integers and their commas, without converting them and
// without a call per element. limit must be below 10^19.
func IntLists(v []byte, limit uint64) (Lists, bool) {
	sh, end, ok := intLists(v, 0, limit)
	return sh, ok && end == len(v)
}

// intLists reads the array of integer arrays or of integers that opens at
// d[i] (see IntLists) and returns its shape and the index after it.
func intLists(d []byte, i int, limit uint64) (sh Lists, end int, ok bool) {
	if i >= len(d) || d[i] != '[' {
		return sh, i, false
	}
	j := skipSpace(d, i+1)
	if j >= len(d) || d[j] != '[' {
		sh.Longest, end, ok = intList(d, i, limit)
		return sh, end, ok
	}
	sh.Nested = true
	for {
		n, end, ok := intList(d, j, limit)
		if !ok {
			return sh, end, false
		}
		sh.Lists++
		sh.Longest = max(sh.Longest, n)
		j = skipSpace(d, end)
		switch {
		case j >= len(d):
			return sh, j, false
		case d[j] == ']':
			return sh, j + 1, true
		case d[j] != ',':
			return sh, j, false
		}
		j = skipSpace(d, j+1)
		if j >= len(d) || d[j] != '[' {
			return sh, j, false
		}
	}
}

// ResetLists is Reset, except that the value of the top-level member
// whose key is spelled key literally (no escapes), when it is an array of
// integer arrays or of integers from 0 to limit (see IntLists), is read
// for its shape in the same pass that validates it: the shape is returned
// with the member's index. The index is -1 when no member has that key
// spelled so, more than one member has that key (however spelled), or
// the value has another shape (it is then only validated, as by Reset).
// A document is accepted or rejected, with the same error, exactly as by
// Reset.
func (o *Object) ResetLists(data []byte, key string, limit uint64) (Lists, int, error) {
	return o.ResetListsKnown(data, key, limit, Known{})
}

// Known is an array of integer arrays or of integers that a caller wrote
// or read before: data[Start:End] of the document it is given with, a
// complete array IntLists accepts with shape Lists, none of whose integers
// is above Max. The zero Known is none.
type Known struct {
	Start, End int
	Lists      Lists
	Max        uint64
}

// ResetListsKnown is ResetLists with a Known: when the member ResetLists
// reads starts at known.Start, and known.Max is at most limit, the value
// is taken to end at known.End with known's shape, without being read
// again. A document is accepted or rejected, with the same error, exactly
// as by Reset, provided known is what it says; known is not checked.
func (o *Object) ResetListsKnown(data []byte, key string, limit uint64, known Known) (Lists, int, error) {
	members := o.members[:0]
	*o = Object{}
	i := skipSpace(data, 0)
	if i >= len(data) || data[i] != '{' {
		o.members = members
		return Lists{}, -1, o.Reset(data)
	}
	s := scanner{data: data, listKey: key, listLimit: limit, listMember: -1}
	if known.End > known.Start && known.End <= len(data) && known.Max <= limit {
		s.listKnown = known
	}
	members, end, err := indexObject(&s, data, i, members)
	if err != nil {
		o.members = members
		return Lists{}, -1, err
	}
	member := s.listMember
	if s.listSeen > 1 {
		member = -1
	}
	for k := range members {
		if member >= 0 && members[k].escaped && members[k].key == key {
			member = -1 // the same key, spelled with escapes
		}
	}
	o.data, o.open, o.close, o.members = data, i, end-1, members
	if member < 0 {
		return Lists{}, -1, nil
	}
	return s.lists, member, nil
}

// ResetListsIn is ResetLists for the member key of the object that is the
// value of the top-level member parent (both keys spelled literally): the
// list, read in the same pass that validates the document, is returned as
// a Known in data (Max is limit), with the index of parent's member. The
// Known is the zero Known, and the index -1, when no list was read so:
// none there, another shape, or key spelled literally more than once in
// parent members. A member of parent's value that names key with escapes
// is not looked at: a caller that must refuse a member named twice checks
// that value's Duplicate (kvhandle.Check does). A document is accepted or
// rejected, with the same error, exactly as by Reset.
func (o *Object) ResetListsIn(data []byte, parent, key string, limit uint64) (Known, int, error) {
	members := o.members[:0]
	*o = Object{}
	i := skipSpace(data, 0)
	if i >= len(data) || data[i] != '{' {
		o.members = members
		return Known{}, -1, o.Reset(data)
	}
	s := scanner{data: data, listParent: parent, listKey: key, listLimit: limit, listMember: -1}
	members, end, err := indexObject(&s, data, i, members)
	if err != nil {
		o.members = members
		return Known{}, -1, err
	}
	o.data, o.open, o.close, o.members = data, i, end-1, members
	if s.listMember < 0 || s.listSeen > 1 {
		return Known{}, -1, nil
	}
	return Known{Start: s.listStart, End: s.listEnd, Lists: s.lists, Max: limit}, s.listMember, nil
}

// Index returns the index of the member Get returns for key (the last
// of that name), -1 when there is none.
func (o Object) Index(key string) int {
	for i := len(o.members) - 1; i >= 0; i-- {
		if o.keyIs(&o.members[i], key) {
			return i
		}
	}
	return -1
}

// listValue validates the value at data[i] of the member ResetLists
// reads, reading its shape when it is an array of integer arrays or of
// integers: such a value is read once, and any other (a malformed one
// included) is validated from its start by the general path, which
// reports any error just as Reset does.
func (s *scanner) listValue(i, member int) (int, error) {
	s.listSeen++
	if k := s.listKnown; s.listSeen == 1 && k.End > 0 && i == k.Start {
		s.lists, s.listMember = k.Lists, member
		return k.End, nil
	}
	if s.listSeen == 1 && s.depth+2 <= maxDepth {
		if sh, end, ok := intLists(s.data, i, s.listLimit); ok {
			s.lists, s.listMember, s.listStart, s.listEnd = sh, member, i, end
			if s.listParent != "" {
				s.listMember = -2 // the parent's index is set once its value ends
			}
			return end, nil
		}
	}
	return s.value(i)
}

// intList reads the array of integers from 0 to limit that opens at
// d[i] == '[': it returns the number of elements and the index after the
// closing ']', or ok false.
func intList(d []byte, i int, limit uint64) (n, end int, ok bool) {
	i = skipSpace(d, i+1)
	if i < len(d) && d[i] == ']' {
		return 0, i + 1, true
	}
	for {
		i = skipSpace(d, i)
		if limit >= swarMin {
			// The common run "12,345,6": integers of at most seven
			// digits, each followed by a comma and a digit.
			for i < len(d) && d[i]-'1' <= 8 {
				j := i + 1
				for j < len(d) && d[j]-'0' <= 9 {
					j++
				}
				if j-i > 7 || j+1 >= len(d) || d[j] != ',' || d[j+1]-'0' > 9 {
					break
				}
				n++
				i = j + 1
			}
		}
		// One element in full: the last of the array, a zero, one of
		// eight digits or more, or one among whitespace.
		start := i
		var val uint64
		for i < len(d) && d[i]-'0' <= 9 && i-start < 19 {
			val = val*10 + uint64(d[i]-'0')
			i++
		}
		if i == start || (d[start] == '0' && i-start > 1) || val > limit {
			return n, i, false
		}
		n++
		i = skipSpace(d, i)
		switch {
		case i >= len(d):
			return n, i, false
		case d[i] == ']':
			return n, i + 1, true
		case d[i] != ',':
			return n, i, false // a longer, signed, fractional or other element
		}
		i++
	}
}

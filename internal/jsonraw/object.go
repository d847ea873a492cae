package jsonraw

import "unicode/utf8"

// Object indexes the top-level members of a JSON object held as bytes. The
// zero Object is an empty object with no source bytes. An Object is
// read-only and safe for concurrent use; it aliases the bytes given to
// Parse.
type Object struct {
	data    []byte
	open    int // index of '{'
	close   int // index of '}'
	members []span
}

// span locates one member in data.
type span struct {
	start    int // just after the preceding '{' or ','
	keyStart int // opening quote of the key
	keyEnd   int // just after the closing quote of the key
	valStart int
	valEnd   int
	end      int    // index of the following ',' or '}'
	key      string // decoded key, set only when the raw key needs decoding
	escaped  bool   // the raw key has escapes or invalid UTF-8
}

// needsDecode reports whether the quoted key q differs from its decoding.
func needsDecode(q []byte, escaped bool) bool {
	if escaped {
		return true
	}
	for _, c := range q {
		if c >= utf8.RuneSelf {
			return !utf8.Valid(q)
		}
	}
	return false
}

// Parse validates data as a whole JSON document and indexes the members of
// its top-level object. It returns a *SyntaxError for malformed input
// (including trailing data after the value) and ErrNotObject for a valid
// document that is not an object.
func Parse(data []byte) (Object, error) {
	var o Object
	if err := o.Reset(data); err != nil {
		return Object{}, err
	}
	return o, nil
}

// ParseLimited is Parse with a bound on the members of every object in the
// document, at any depth: an object with more than maxMembers members is a
// *MembersError (matching ErrTooManyMembers), before anything is indexed
// beyond the limit. So the index and every later walk of the document
// that collects an object's members hold at most maxMembers of them.
// maxMembers <= 0 means no bound.
func ParseLimited(data []byte, maxMembers int) (Object, error) {
	var o Object
	if err := o.reset(data, maxMembers); err != nil {
		return Object{}, err
	}
	return o, nil
}

// Reset is Parse into o, reusing o's storage, so that parsing many documents
// in turn does not allocate in steady state. On error o is left empty.
func (o *Object) Reset(data []byte) error { return o.reset(data, 0) }

func (o *Object) reset(data []byte, maxMembers int) error {
	members := o.members[:0]
	*o = Object{}
	s := scanner{data: data, maxMembers: maxMembers}
	i := skipSpace(data, 0)
	if i >= len(data) || data[i] != '{' {
		o.members = members
		// Validate anyway so that malformed input is reported as such.
		end, err := s.value(i)
		if err != nil {
			return err
		}
		if err := s.trailing(end); err != nil {
			return err
		}
		return ErrNotObject
	}
	members, end, err := indexObject(&s, data, i, members)
	if err != nil {
		o.members = members
		return err
	}
	*o = Object{data: data, open: i, close: end - 1, members: members}
	return nil
}

// indexObject scans the document whose top-level object opens at data[i]
// with s, appending the object's members to members[:0] (a new slice when
// nil). It returns them and the end of the object, or, for a malformed
// document, the error and members emptied for reuse.
func indexObject(s *scanner, data []byte, i int, members []span) ([]span, int, error) {
	if members == nil {
		members = make([]span, 0, 16)
	}
	end, err := s.object(i, func(start, keyStart, keyEnd int, escaped bool, valStart, valEnd, end int) error {
		sp := span{start: start, keyStart: keyStart, keyEnd: keyEnd, valStart: valStart, valEnd: valEnd, end: end}
		if needsDecode(data[keyStart:keyEnd], escaped) {
			sp.escaped = true
			sp.key = string(unquote(nil, data[keyStart:keyEnd]))
		}
		members = append(members, sp)
		return nil
	})
	if err == nil {
		err = s.trailing(end)
	}
	if err != nil {
		return members[:0], end, err
	}
	return members, end, nil
}

// Bytes returns the document Parse was given.
func (o Object) Bytes() []byte { return o.data }

// Len returns the number of members, counting duplicate keys separately.
func (o Object) Len() int { return len(o.members) }

// Member returns the unescaped key and the raw value (without surrounding
// whitespace) of the i-th member in document order. It panics if i is out
// of range.
func (o Object) Member(i int) (key string, value []byte) {
	m := &o.members[i]
	return o.keyOf(m), o.data[m.valStart:m.valEnd:m.valEnd]
}

// ValueSpan returns where the raw value of the i-th member is in the
// document: Member's value is Bytes()[start:end]. It panics if i is out of
// range.
func (o Object) ValueSpan(i int) (start, end int) {
	m := &o.members[i]
	return m.valStart, m.valEnd
}

func (o Object) keyOf(m *span) string {
	if m.escaped {
		return m.key
	}
	return intern(o.data[m.keyStart+1 : m.keyEnd-1])
}

func (o Object) keyIs(m *span, key string) bool {
	if m.escaped {
		return m.key == key
	}
	return string(o.data[m.keyStart+1:m.keyEnd-1]) == key
}

// Get returns the raw value of the member named key. When the key occurs
// more than once the last occurrence wins, as with encoding/json.
func (o Object) Get(key string) (value []byte, ok bool) {
	for i := len(o.members) - 1; i >= 0; i-- {
		m := &o.members[i]
		if o.keyIs(m, key) {
			return o.data[m.valStart:m.valEnd:m.valEnd], true
		}
	}
	return nil, false
}

// Duplicate returns the first member name (decoded) that the object holds
// more than once, and whether there is one. It allocates only to return a
// name it found.
func (o Object) Duplicate() (string, bool) {
	if len(o.members) > dupTable/2 {
		return o.duplicateEach()
	}
	// Each name in a small open-addressed table of earlier members, by
	// a hash of its decoded bytes: the same member is found as by
	// comparing each with every earlier one.
	var table [dupTable]uint8 // member index + 1, 0: empty
	for i := range o.members {
		mi := &o.members[i]
		for slot := o.keyHash(mi) % dupTable; ; slot = (slot + 1) % dupTable {
			j := table[slot]
			if j == 0 {
				table[slot] = uint8(i + 1)
				break
			}
			if o.sameKey(mi, &o.members[j-1]) {
				return o.keyOf(mi), true
			}
		}
	}
	return "", false
}

// dupTable is the size of Duplicate's table: objects of up to half as
// many members use it.
const dupTable = 128

// duplicateEach is Duplicate for a large object: each member's name
// compared with every earlier one's.
func (o Object) duplicateEach() (string, bool) {
	for i := 1; i < len(o.members); i++ {
		mi := &o.members[i]
		for j := range i {
			if o.sameKey(mi, &o.members[j]) {
				return o.keyOf(mi), true
			}
		}
	}
	return "", false
}

// keyHash is FNV-1a of m's decoded name.
func (o Object) keyHash(m *span) uint32 {
	h := uint32(2166136261)
	if m.escaped {
		for i := 0; i < len(m.key); i++ {
			h = (h ^ uint32(m.key[i])) * 16777619
		}
		return h
	}
	for _, c := range o.data[m.keyStart+1 : m.keyEnd-1] {
		h = (h ^ uint32(c)) * 16777619
	}
	return h
}

// sameKey reports whether two members' keys decode to the same name.
func (o Object) sameKey(a, b *span) bool {
	switch {
	case a.escaped && b.escaped:
		return a.key == b.key
	case a.escaped:
		return a.key == string(o.data[b.keyStart+1:b.keyEnd-1])
	case b.escaped:
		return b.key == string(o.data[a.keyStart+1:a.keyEnd-1])
	}
	return string(o.data[a.keyStart+1:a.keyEnd-1]) == string(o.data[b.keyStart+1:b.keyEnd-1])
}

// Has reports whether a member named key exists.
func (o Object) Has(key string) bool {
	_, ok := o.Get(key)
	return ok
}

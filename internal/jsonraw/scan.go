package jsonraw

import (
	"bytes"
	"encoding/binary"
	"math/bits"
)

const (
	lsb = 0x0101010101010101
	msb = 0x8080808080808080
)

// special8 has the top bit set of the first byte of x (in little-endian
// order) that is a quote, a backslash or a control character (< 0x20), and
// of no byte before it; of later bytes it may be set falsely (borrows cross
// from a flagged byte). It is zero when there is no such byte.
func special8(x uint64) uint64 {
	// Bytes >= 0x80 never match; mask them out so the borrow tricks below
	// only see ASCII.
	y := x & ^uint64(msb)
	lt20 := y - lsb*0x20
	quote := (y ^ lsb*'"') - lsb
	bslash := (y ^ lsb*'\\') - lsb
	return (lt20 | quote | bslash) & ^x & msb
}

// scanner validates JSON values in data. Each method takes the index where
// its token starts and returns the index just past it.
type scanner struct {
	data  []byte
	depth int
	// trusted skips the validation of string contents: the input is known
	// to be valid JSON, so only the closing quote needs to be found.
	trusted bool
	// valid (PruneValid) also skips an array that holds no string, object
	// or array by its closing bracket.
	valid bool
	// maxMembers, when positive, bounds the members of every object
	// (ParseLimited).
	maxMembers int

	// With idKey set (ResetIDs), the value of the top-level member whose
	// raw key is idKey is converted into ids while validated; idMember is
	// its index among the top-level members (-1: none converted) and
	// idSeen the number of top-level members with that raw key.
	idKey    string
	ids      []uint32
	idMember int
	idSeen   int
	// idKnown (ResetIDsKnown) is the text of an id array already
	// validated and converted; a value with exactly its bytes is taken as
	// it without being read again, and idKnownHit records that it was.
	idKnown    []byte
	idKnownHit bool

	// With listKey set (ResetLists), the value of the top-level member
	// whose raw key is listKey is read for its shape (lists) while
	// validated, when it is an array of integer arrays or of integers up
	// to listLimit; listMember is its index among the top-level members
	// (-1: none read) and listSeen the number of top-level members with
	// that raw key.
	listKey    string
	listLimit  uint64
	lists      Lists
	listMember int
	listSeen   int
	listKnown  Known // ResetListsKnown's, the zero Known for none
	// With listParent set (ResetListsIn), the member listKey is looked
	// for in the object that is the value of the top-level member
	// listParent (inParent while that value is scanned), and listMember
	// is listParent's index; listStart and listEnd locate the list read.
	listParent         string
	inParent           bool
	listStart, listEnd int
}

func isSpace(c byte) bool {
	return c == ' ' || c == '\n' || c == '\r' || c == '\t'
}

// skipSpace returns the index of the first non-whitespace byte at or after i.
func skipSpace(data []byte, i int) int {
	for i < len(data) && isSpace(data[i]) {
		i++
	}
	return i
}

func (s *scanner) unexpected(i int, what string) error {
	if i >= len(s.data) {
		return syntaxErr(len(s.data), "unexpected end of input "+what)
	}
	return syntaxErr(i, "invalid character "+quoteByte(s.data[i])+" "+what)
}

func quoteByte(c byte) string {
	switch {
	case c == '\'':
		return `'\''`
	case c == '"':
		return `'"'`
	case c >= 0x20 && c < 0x7f:
		return "'" + string(rune(c)) + "'"
	default:
		const hex = "0123456789abcdef"
		return `'\x` + string([]byte{hex[c>>4], hex[c&0xf]}) + "'"
	}
}

// value validates the value starting at data[i] (no leading whitespace).
func (s *scanner) value(i int) (int, error) {
	if i >= len(s.data) {
		return i, s.unexpected(i, "looking for beginning of value")
	}
	switch c := s.data[i]; c {
	case '"':
		end, _, err := s.str(i)
		return end, err
	case '{':
		return s.object(i, nil)
	case '[':
		return s.array(i, nil)
	case 't':
		return s.literal(i, "true")
	case 'f':
		return s.literal(i, "false")
	case 'n':
		return s.literal(i, "null")
	default:
		if c == '-' || (c >= '0' && c <= '9') {
			return s.number(i)
		}
		return i, s.unexpected(i, "looking for beginning of value")
	}
}

func (s *scanner) literal(i int, lit string) (int, error) {
	for j := 0; j < len(lit); j++ {
		if i+j >= len(s.data) || s.data[i+j] != lit[j] {
			return i + j, s.unexpected(i+j, "in literal "+lit)
		}
	}
	return i + len(lit), nil
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

func (s *scanner) number(i int) (int, error) {
	d := s.data
	if d[i] == '-' {
		i++
	}
	switch {
	case i < len(d) && d[i] == '0':
		i++
	case i < len(d) && d[i] >= '1' && d[i] <= '9':
		i++
		for i < len(d) && isDigit(d[i]) {
			i++
		}
	default:
		return i, s.unexpected(i, "in numeric literal")
	}
	if i < len(d) && d[i] == '.' {
		i++
		if i >= len(d) || !isDigit(d[i]) {
			return i, s.unexpected(i, "after decimal point in numeric literal")
		}
		for i < len(d) && isDigit(d[i]) {
			i++
		}
	}
	if i < len(d) && (d[i] == 'e' || d[i] == 'E') {
		i++
		if i < len(d) && (d[i] == '+' || d[i] == '-') {
			i++
		}
		if i >= len(d) || !isDigit(d[i]) {
			return i, s.unexpected(i, "in exponent of numeric literal")
		}
		for i < len(d) && isDigit(d[i]) {
			i++
		}
	}
	return i, nil
}

func isHex(c byte) bool {
	return isDigit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')
}

// str validates the string starting at the quote data[i]. escaped reports
// whether it contains a backslash escape.
func (s *scanner) str(i int) (end int, escaped bool, err error) {
	if s.trusted {
		return s.trustedStr(i)
	}
	d := s.data
	i++
	for {
		// Fast path over plain bytes, eight at a time, to the first byte
		// that is not (special8 flags it exactly).
		for i+8 <= len(d) {
			if m := special8(binary.LittleEndian.Uint64(d[i:])); m != 0 {
				i += bits.TrailingZeros64(m) >> 3
				break
			}
			i += 8
		}
		for i < len(d) {
			c := d[i]
			if c == '"' || c == '\\' || c < 0x20 {
				break
			}
			i++
		}
		if i >= len(d) {
			return i, escaped, s.unexpected(i, "in string literal")
		}
		switch d[i] {
		case '"':
			return i + 1, escaped, nil
		case '\\':
			escaped = true
			i++
			if i >= len(d) {
				return i, escaped, s.unexpected(i, "in string escape code")
			}
			switch d[i] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i++
			case 'u':
				i++
				for k := 0; k < 4; k++ {
					if i >= len(d) || !isHex(d[i]) {
						return i, escaped, s.unexpected(i, "in \\u hexadecimal character escape")
					}
					i++
				}
			default:
				return i, escaped, s.unexpected(i, "in string escape code")
			}
		default: // control character
			return i, escaped, s.unexpected(i, "in string literal")
		}
	}
}

// trustedStr finds the end of the string starting at the quote data[i]
// without validating its contents.
func (s *scanner) trustedStr(i int) (end int, escaped bool, err error) {
	d := s.data
	j := i + 1
	for {
		k := bytes.IndexByte(d[j:], '"')
		if k < 0 {
			return len(d), escaped, s.unexpected(len(d), "in string literal")
		}
		k += j
		// The quote is escaped if an odd number of backslashes precede it.
		n := 0
		for k-1-n > i && d[k-1-n] == '\\' {
			n++
		}
		if n%2 == 0 {
			return k + 1, bytes.IndexByte(d[i+1:k], '\\') >= 0, nil
		}
		j = k + 1
	}
}

// memberFunc receives the spans of one object member: start is just after
// the '{' or ',' before it, key spans the quoted key, val the value, and end
// is the index of the ',' or '}' after it.
type memberFunc func(start, keyStart, keyEnd int, escaped bool, valStart, valEnd, end int) error

func (s *scanner) push(i int) error {
	s.depth++
	if s.depth > maxDepth {
		return syntaxErr(i, "exceeded max depth")
	}
	return nil
}

// object validates the object starting at data[i] == '{', calling fn (if
// not nil) for each member.
func (s *scanner) object(i int, fn memberFunc) (int, error) {
	if err := s.push(i); err != nil {
		return i, err
	}
	d := s.data
	i++
	start := i
	i = skipSpace(d, i)
	if i < len(d) && d[i] == '}' {
		s.depth--
		return i + 1, nil
	}
	for member := 0; ; member++ {
		if s.maxMembers > 0 && member == s.maxMembers {
			return i, &MembersError{Offset: i, Limit: s.maxMembers}
		}
		if i >= len(d) || d[i] != '"' {
			return i, s.unexpected(i, "looking for beginning of object key string")
		}
		keyStart := i
		keyEnd, escaped, err := s.str(i)
		if err != nil {
			return keyEnd, err
		}
		i = skipSpace(d, keyEnd)
		if i >= len(d) || d[i] != ':' {
			return i, s.unexpected(i, "after object key")
		}
		i = skipSpace(d, i+1)
		valStart := i
		var valEnd int
		switch {
		case s.idKey != "" && s.depth == 1 && !escaped && string(d[keyStart+1:keyEnd-1]) == s.idKey:
			valEnd, err = s.idValue(i, member)
		case s.listKey != "" && !escaped && s.listDepth(d[keyStart+1:keyEnd-1]):
			valEnd, err = s.listValue(i, member)
		case s.listParent != "" && s.depth == 1 && !escaped && string(d[keyStart+1:keyEnd-1]) == s.listParent:
			s.inParent = true
			valEnd, err = s.value(i)
			s.inParent = false
			if s.listMember == -2 {
				s.listMember = member // the list was read in this member's value
			}
		default:
			valEnd, err = s.value(i)
		}
		if err != nil {
			return valEnd, err
		}
		i = skipSpace(d, valEnd)
		if i >= len(d) || (d[i] != ',' && d[i] != '}') {
			return i, s.unexpected(i, "after object key:value pair")
		}
		if fn != nil {
			if err := fn(start, keyStart, keyEnd, escaped, valStart, valEnd, i); err != nil {
				return i, err
			}
		}
		if d[i] == '}' {
			s.depth--
			return i + 1, nil
		}
		i++
		start = i
		i = skipSpace(d, i)
	}
}

// listDepth reports whether key, a raw key at the current depth, is the
// member ResetLists (depth 1) or ResetListsIn (depth 2, in listParent's
// value) reads.
func (s *scanner) listDepth(key []byte) bool {
	if string(key) != s.listKey {
		return false
	}
	if s.listParent == "" {
		return s.depth == 1
	}
	return s.inParent && s.depth == 2
}

// array validates the array starting at data[i] == '[', calling fn (if not
// nil) with the span of each element.
func (s *scanner) array(i int, fn func(valStart, valEnd int) error) (int, error) {
	if s.valid && fn == nil {
		if end, ok := skipFlatArray(s.data, i); ok {
			return end, nil
		}
	}
	if err := s.push(i); err != nil {
		return i, err
	}
	d := s.data
	i = skipSpace(d, i+1)
	if i < len(d) && d[i] == ']' {
		s.depth--
		return i + 1, nil
	}
	for {
		if fn == nil {
			i = skipInts(d, i)
		}
		valStart := i
		valEnd, err := s.value(i)
		if err != nil {
			return valEnd, err
		}
		i = skipSpace(d, valEnd)
		if i >= len(d) || (d[i] != ',' && d[i] != ']') {
			return i, s.unexpected(i, "after array element")
		}
		if fn != nil {
			if err := fn(valStart, valEnd); err != nil {
				return i, err
			}
		}
		if d[i] == ']' {
			s.depth--
			return i + 1, nil
		}
		i = skipSpace(d, i+1)
	}
}

// skipFlatArray returns the index after the valid array at data[i] ==
// '[' when the array holds no string, object or array (numbers, literals):
// its closing bracket is then the first one, found with the byte searches
// of the bytes package rather than byte by byte.
func skipFlatArray(d []byte, i int) (int, bool) {
	j := bytes.IndexByte(d[i+1:], ']')
	if j < 0 {
		return i, false
	}
	in := d[i+1 : i+1+j]
	if bytes.IndexByte(in, '[') >= 0 || bytes.IndexByte(in, '"') >= 0 || bytes.IndexByte(in, '{') >= 0 {
		return i, false
	}
	return i + 2 + j, true
}

// idValue validates the value at data[i] of the member with the key
// ResetIDs converts, converting it when it is an id array: the array is
// read once, and only a value that is not such an array (a malformed one
// included) is validated again from its start by the general path, which
// reports any error just as Reset does.
func (s *scanner) idValue(i, member int) (int, error) {
	s.idSeen++
	if s.idSeen == 1 && len(s.idKnown) > 0 && s.depth < maxDepth && bytes.HasPrefix(s.data[i:], s.idKnown) {
		// A complete array (its text is one), so the value ends where it
		// does: the general path would read the same bytes to the same
		// ids.
		s.idMember, s.idKnownHit = member, true
		return i + len(s.idKnown), nil
	}
	if s.idSeen == 1 && i < len(s.data) && s.data[i] == '[' && s.depth < maxDepth {
		if cap(s.ids) < (len(s.data)-i)/2 {
			// At most one id per two bytes ("1,"): room for one per comma
			// in the rest of the document, allocated once (a quarter more,
			// for a caller that reuses it for a longer list).
			if n := bytes.Count(s.data[i:], []byte{','}) + 1; cap(s.ids) < n {
				s.ids = make([]uint32, 0, n+n/4)
			}
		}
		ids, end, ok := AppendUint32s(s.ids[:0], s.data, i)
		s.ids = ids[:0]
		if ok {
			s.ids, s.idMember = ids, member
			return end, nil
		}
	}
	return s.value(i)
}

// skipInts returns the index after a run of array elements at i that are
// non-negative integers each followed by a comma and a digit ("1,22,3"),
// the shape of a token id list, which it checks in one tight loop; the
// element it stops at is left to the general path.
func skipInts(d []byte, i int) int {
	for i < len(d) && d[i]-'0' <= 9 {
		j := i + 1
		if d[i] != '0' {
			for j < len(d) && d[j]-'0' <= 9 {
				j++
			}
		}
		if j+1 >= len(d) || d[j] != ',' || d[j+1]-'0' > 9 {
			return i
		}
		i = j + 1
	}
	return i
}

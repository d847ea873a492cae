package jsonraw

import (
	"errors"
	"fmt"
)

// Verdict is what Prune does with an object member, decided from its name.
type Verdict int

const (
	// Keep keeps the member, and Prune walks its value.
	Keep Verdict = iota
	// Cut removes the member (its value is validated, not walked).
	Cut
	// Refuse makes Prune fail with ErrRefused.
	Refuse
)

// ErrRefused is returned by Prune when its decide function refused a
// member.
var ErrRefused = errors.New("jsonraw: a member was refused")

// Prune validates data as a whole JSON document (any value, as Valid) and
// asks decide about every object member at any depth, in document order,
// with the member's name decoded: escapes resolved and invalid UTF-8 read
// as U+FFFD, as encoding/json and every conforming decoder read it; the
// slice is valid only during the call. Duplicate names are asked about
// each time. The value of a member that is cut is validated but not
// walked.
//
// When no member is cut, Prune returns data itself and false. Otherwise it
// appends to dst the document without the cut members, each with the
// comma that separated it from a kept neighbour, every other byte as it
// was (whitespace, escapes and number spellings included), and returns it
// and true. It returns a *SyntaxError for malformed data, and an error
// wrapping ErrRefused (with the offset of the member's name) as soon as
// decide refuses a member.
func Prune(dst, data []byte, decide func(key []byte) Verdict) ([]byte, bool, error) {
	return prune(dst, data, decide, false)
}

// PruneValid is Prune for data known to be valid JSON (a document Parse
// accepted): the value of a member that is cut is skipped, not validated
// again (an array of plain values by its closing bracket), and the
// strings of kept values are not validated again. On valid data it gives
// what Prune gives; on other data its result is unspecified, but it never
// panics.
func PruneValid(dst, data []byte, decide func(key []byte) Verdict) ([]byte, bool, error) {
	return prune(dst, data, decide, true)
}

func prune(dst, data []byte, decide func(key []byte) Verdict, valid bool) ([]byte, bool, error) {
	p := pruner{scanner: scanner{data: data, trusted: valid, valid: valid}, decide: decide}
	i := skipSpace(data, 0)
	end, err := p.value(i)
	if err == nil {
		err = p.trailing(end)
	}
	if err != nil {
		return nil, false, err
	}
	if len(p.cuts) == 0 {
		return data, false, nil
	}
	n := len(data)
	for _, c := range p.cuts {
		n -= c[1] - c[0]
	}
	if cap(dst)-len(dst) < n {
		nd := make([]byte, len(dst), len(dst)+n)
		copy(nd, dst)
		dst = nd
	}
	prev := 0
	for _, c := range p.cuts {
		dst = append(dst, data[prev:c[0]]...)
		prev = c[1]
	}
	return append(dst, data[prev:]...), true, nil
}

// pruner is the walk of Prune: a validating scanner that decides each
// member before its value and records the byte ranges to cut, in order.
type pruner struct {
	scanner
	decide func(key []byte) Verdict
	cuts   [][2]int
}

// value validates and walks the value at data[i].
func (p *pruner) value(i int) (int, error) {
	if i < len(p.data) {
		switch p.data[i] {
		case '{':
			return p.object(i)
		case '[':
			return p.array(i)
		}
	}
	return p.scanner.value(i)
}

// name returns the decoded name of the member whose quoted key is q.
// Invalid UTF-8 decodes to U+FFFD, which no name a caller looks for
// contains, so the raw bytes of a key without escapes decide as its
// decoding would. (The buffer of an escaped key is declared on that path
// alone, so that only such keys cost an allocation.)
func name(q []byte, escaped bool) []byte {
	if !escaped {
		return q[1 : len(q)-1]
	}
	var buf [64]byte
	return unquote(buf[:0], q)
}

// object walks the object at data[i] == '{'. A cut member takes the comma
// before it when a kept member precedes it; a run of cut members at the
// start of the object takes the comma after it up to the next kept
// member's name (or, when none follows, ends with the last cut value).
func (p *pruner) object(i int) (int, error) {
	if err := p.push(i); err != nil {
		return i, err
	}
	d := p.data
	i = skipSpace(d, i+1)
	if i < len(d) && d[i] == '}' {
		p.depth--
		return i + 1, nil
	}
	keptEnd := -1 // end of the last kept member's value (or of the cut after it)
	runStart := -1
	for {
		if i >= len(d) || d[i] != '"' {
			return i, p.unexpected(i, "looking for beginning of object key string")
		}
		keyStart := i
		keyEnd, escaped, err := p.str(i)
		if err != nil {
			return keyEnd, err
		}
		i = skipSpace(d, keyEnd)
		if i >= len(d) || d[i] != ':' {
			return i, p.unexpected(i, "after object key")
		}
		i = skipSpace(d, i+1)
		var valEnd int
		switch p.decide(name(d[keyStart:keyEnd], escaped)) {
		case Refuse:
			return keyStart, fmt.Errorf("%w at offset %d", ErrRefused, keyStart)
		case Cut:
			if valEnd, err = p.scanner.value(i); err != nil {
				return valEnd, err
			}
			switch {
			case keptEnd >= 0:
				// From the end of what precedes it, its comma included.
				p.cuts = append(p.cuts, [2]int{keptEnd, valEnd})
				keptEnd = valEnd
			case runStart < 0:
				runStart = keyStart
			}
		default:
			if runStart >= 0 {
				p.cuts = append(p.cuts, [2]int{runStart, keyStart})
				runStart = -1
			}
			if valEnd, err = p.value(i); err != nil {
				return valEnd, err
			}
			keptEnd = valEnd
		}
		i = skipSpace(d, valEnd)
		if i >= len(d) || (d[i] != ',' && d[i] != '}') {
			return i, p.unexpected(i, "after object key:value pair")
		}
		if d[i] == '}' {
			if runStart >= 0 {
				p.cuts = append(p.cuts, [2]int{runStart, valEnd})
			}
			p.depth--
			return i + 1, nil
		}
		i = skipSpace(d, i+1)
	}
}

// array walks the array at data[i] == '['.
func (p *pruner) array(i int) (int, error) {
	if p.valid {
		// No member in it to decide about.
		if end, ok := skipFlatArray(p.data, i); ok {
			return end, nil
		}
	}
	if err := p.push(i); err != nil {
		return i, err
	}
	d := p.data
	i = skipSpace(d, i+1)
	if i < len(d) && d[i] == ']' {
		p.depth--
		return i + 1, nil
	}
	for {
		i = skipInts(d, i)
		end, err := p.value(i)
		if err != nil {
			return end, err
		}
		i = skipSpace(d, end)
		if i >= len(d) || (d[i] != ',' && d[i] != ']') {
			return i, p.unexpected(i, "after array element")
		}
		if d[i] == ']' {
			p.depth--
			return i + 1, nil
		}
		i = skipSpace(d, i+1)
	}
}

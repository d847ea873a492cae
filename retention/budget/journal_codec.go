package budget

import (
	"encoding/binary"
	"errors"
	"math"
	"slices"
	"time"
)

// The journal's records: a version byte, a kind byte, the source, then the
// kind's fields. Integers are varints, strings a length and their bytes,
// hashes 8 bytes little-endian. An addition is about 100 bytes and its
// key's, engine's and class's lengths, plus 8 per prefix position the
// ledger samples (link: 32 for the first 8,192 tokens, then 16 per
// doubling: 56 for a 25,000-token hold, about 550 bytes in all).

const recordVersion = 1

const (
	kindAdd byte = 1 + iota
	kindReturn
	kindEnd
	kindCapacity
	kindRunning
	kindPrefilled
)

var errRecord = errors.New("budget: journal record malformed")

func putString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

func header(kind byte, source string) []byte {
	b := make([]byte, 0, 96)
	b = append(b, recordVersion, kind)
	return putString(b, source)
}

// encodeAdd encodes h's addition, with the values of prefix (of blocks of
// bs tokens; nil: none) at the positions link reads.
func encodeAdd(source string, h Hold, prefix Blocks, bs int) []byte {
	b := header(kindAdd, source)
	b = putString(b, h.Key)
	b = putString(b, h.Engine)
	b = binary.AppendUvarint(b, uint64(h.Tokens))
	b = binary.AppendVarint(b, h.Created.UnixNano())
	b = binary.AppendVarint(b, h.Expires.UnixNano())
	b = putString(b, h.Features.Class)
	b = binary.AppendVarint(b, int64(h.Features.Turn))
	tool := byte(0)
	if h.Features.ToolCalls {
		tool = 1
	}
	b = append(b, tool)
	b = binary.AppendVarint(b, int64(h.Saved))
	b = binary.LittleEndian.AppendUint64(b, ownerHash(h.Owner))
	if prefix == nil {
		return binary.AppendUvarint(b, 0)
	}
	n := min(h.Tokens/bs, prefix.Len())
	b = binary.AppendUvarint(b, uint64(bs))
	b = binary.AppendUvarint(b, uint64(n))
	g := granule(bs)
	for j := 1; j*g <= n; j += step(j) {
		b = binary.LittleEndian.AppendUint64(b, prefix.At(j*g-1))
	}
	return b
}

// encodeEnd encodes a return (kindReturn) or an end (kindEnd) of key's
// hold created at created (0: unknown), at at.
func encodeEnd(kind byte, source, key string, created, at int64) []byte {
	b := header(kind, source)
	b = putString(b, key)
	b = binary.AppendVarint(b, created)
	return binary.AppendVarint(b, at)
}

// encodePrefilled encodes key's turn's placement p at at (SetPlaced), or,
// released, that Victims released key's hold. The decode engine and its
// tier's tokens follow the fields of the first version's record, which
// readers of that version ignore; a record without them has none.
func encodePrefilled(source, key string, p Placement, released bool, at int64) []byte {
	b := header(kindPrefilled, source)
	b = putString(b, key)
	b = putString(b, p.Prefill)
	rel := byte(0)
	if released {
		rel = 1
	}
	b = append(b, rel)
	b = binary.AppendVarint(b, at)
	if p.Decode == "" {
		return b
	}
	b = putString(b, p.Decode)
	b = binary.AppendUvarint(b, uint64(p.Tokens))
	return putString(b, p.Prior)
}

func encodeCapacity(source, engine string, tokens int64, bs int) []byte {
	b := header(kindCapacity, source)
	b = putString(b, engine)
	b = binary.AppendVarint(b, tokens)
	return binary.AppendUvarint(b, uint64(bs))
}

func encodeRunning(source string, until int64, running map[string]int64) []byte {
	b := header(kindRunning, source)
	b = binary.AppendVarint(b, until)
	b = binary.AppendUvarint(b, uint64(len(running)))
	engines := make([]string, 0, len(running))
	for e := range running {
		engines = append(engines, e)
	}
	slices.Sort(engines)
	for _, e := range engines {
		b = putString(b, e)
		b = binary.AppendVarint(b, running[e])
	}
	return b
}

// reader decodes a record; the first error sticks.
type reader struct {
	b   []byte
	err error
}

func (r *reader) fail() {
	if r.err == nil {
		r.err = errRecord
	}
	r.b = nil
}

func (r *reader) byte() byte {
	if len(r.b) < 1 {
		r.fail()
		return 0
	}
	c := r.b[0]
	r.b = r.b[1:]
	return c
}

func (r *reader) uvarint() uint64 {
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.fail()
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *reader) varint() int64 {
	v, n := binary.Varint(r.b)
	if n <= 0 {
		r.fail()
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *reader) string() string {
	n := r.uvarint()
	if n > uint64(len(r.b)) {
		r.fail()
		return ""
	}
	s := string(r.b[:n])
	r.b = r.b[n:]
	return s
}

func (r *reader) uint64() uint64 {
	if len(r.b) < 8 {
		r.fail()
		return 0
	}
	v := binary.LittleEndian.Uint64(r.b)
	r.b = r.b[8:]
	return v
}

// record is a decoded journal record.
type record struct {
	kind    byte
	source  string
	hold    Hold      // kindAdd (Owner empty: owner holds its hash)
	owner   uint64    // kindAdd
	key     string    // kindReturn, kindEnd, kindPrefilled
	created int64     // kindReturn, kindEnd
	at      int64     // kindReturn, kindEnd, kindPrefilled; kindRunning: until
	engine  string    // kindCapacity, kindPrefilled
	freed   bool      // kindPrefilled: Victims released the hold
	placed  Placement // kindPrefilled
	cap     Capacity
	running map[string]int64
}

// decode reads a record.
func decode(b []byte) (record, error) {
	r := reader{b: b}
	var rc record
	if r.byte() != recordVersion {
		return rc, errRecord
	}
	rc.kind = r.byte()
	rc.source = r.string()
	switch rc.kind {
	case kindAdd:
		decodeAdd(&r, &rc)
	case kindReturn, kindEnd:
		rc.key, rc.created, rc.at = r.string(), r.varint(), r.varint()
	case kindPrefilled:
		rc.key, rc.engine = r.string(), r.string()
		rc.freed = r.byte() == 1
		rc.at = r.varint()
		rc.placed.Prefill = rc.engine
		if r.err == nil && len(r.b) > 0 {
			rc.placed.Decode = r.string()
			rc.placed.Tokens = int(min(r.uvarint(), math.MaxInt32))
			// Prior is the last field; a record of the version before it
			// ends with a count of written tokens there instead, read as
			// no Prior rather than as an invalid record (a rolling
			// upgrade loses no placement).
			if rest := (reader{b: r.b}); len(rest.b) > 0 {
				if prior := rest.string(); rest.err == nil && len(rest.b) == 0 {
					rc.placed.Prior = prior
				}
				r.b = nil
			}
			if rc.placed.Decode == "" {
				rc.placed.Tokens, rc.placed.Prior = 0, ""
			}
		}
	case kindCapacity:
		rc.engine = r.string()
		rc.cap = Capacity{Tokens: r.varint(), BlockSize: int(min(r.uvarint(), math.MaxInt32))}
	case kindRunning:
		rc.at = r.varint()
		n := r.uvarint()
		if n > uint64(len(r.b))/2 { // each engine takes 2 bytes at least
			r.fail()
			break
		}
		rc.running = make(map[string]int64, n)
		for range n {
			e := r.string()
			if t := r.varint(); r.err == nil && t != 0 {
				rc.running[e] = t
			}
		}
	default:
		r.fail()
	}
	return rc, r.err
}

func decodeAdd(r *reader, rc *record) {
	h := &rc.hold
	h.Key, h.Engine = r.string(), r.string()
	h.Tokens = int(min(r.uvarint(), math.MaxUint32))
	h.Created, h.Expires = time.Unix(0, r.varint()), time.Unix(0, r.varint())
	h.Features.Class = r.string()
	h.Features.Turn = int(max(min(r.varint(), math.MaxInt32), math.MinInt32))
	h.Features.ToolCalls = r.byte() == 1
	h.Saved = time.Duration(max(r.varint(), 0))
	rc.owner = r.uint64()
	bs := int(min(r.uvarint(), math.MaxInt32))
	if bs == 0 || r.err != nil {
		return
	}
	n := int(min(r.uvarint(), uint64(h.Tokens)))
	s := sampled{n: n}
	g := granule(bs)
	for j := 1; j*g <= n && r.err == nil; j += step(j) {
		s.pos = append(s.pos, j*g-1)
		s.val = append(s.val, r.uint64())
	}
	h.Prefix, h.PrefixBlockSize = s, bs
}

// sampled is a prefix read from a journal record: its values at the
// positions link reads, the only ones it asks for.
type sampled struct {
	n   int
	pos []int
	val []uint64
}

func (s sampled) Len() int { return s.n }

func (s sampled) At(i int) uint64 {
	if k, ok := slices.BinarySearch(s.pos, i); ok {
		return s.val[k]
	}
	return 0
}

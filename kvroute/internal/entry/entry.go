// Package entry is the wire format of a retained decode handle: the
// handle, compacted when its block ids allow, with what the router knows
// about it (when and where it was made, the Identifier's check, the token
// fingerprint). A Store keeps the encoded bytes.
package entry

import (
	"bytes"
	"encoding/binary"
	"errors"
	"strconv"
	"time"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/bufpool"
	"github.com/bidikv/bidikv/kvroute/internal/fingerprint"
)

var errStop = errors.New("stop")

// Entry is a retained decode handle with what the router knows about it.
type Entry struct {
	Created   time.Time               // when the router saw D finish (router clock)
	Endpoint  string                  // the decode endpoint that holds the blocks
	Tokens    int                     // remote_num_tokens
	Check     []byte                  // the Identifier's Retention.Check
	ContentOK bool                    // the Identifier accepted the turn (no Refusal): content verification may be used
	FP        fingerprint.Fingerprint // the token fingerprint of D's blocks, nil when unknown
	Handle    []byte                  // D's kv_transfer_params, verbatim

	// What the decode memory budget needs of a hold (version 4): the
	// conversation's turn number (1 for a first request; 0 when unknown,
	// an older entry), whether the reply ended in tool calls, the model
	// and the API the turn was served on (a release request names them).
	Turn      int
	ToolCalls bool
	Model     string
	API       byte // the code of the router's API descriptor (kvroute's api.code: persisted, never renumbered; 0: unknown)

	Raw []byte // the stored value, for putting it back
	// Expanded: Handle was expanded into a buffer from Decode's
	// pool, which the caller puts back when done with it.
	Expanded bool
}

// Entry encodings: version 1 had no flags and no fingerprint; version 2
// added them; version 3 adds flagCompactBlocks, a handle stored compacted
// (compactHandle), which a router that reads only version 2 refuses as a
// bad entry rather than misreading; version 4 adds, after the
// fingerprint, the turn number, the model and the API (and
// flagToolCalls), which a router that reads only version 3 refuses.
const (
	entryVersion1 = 1
	entryVersion2 = 2
	entryVersion3 = 3
	entryVersion  = 4
)

const (
	flagContentOK     = 1
	flagCompactBlocks = 2
	flagToolCalls     = 4
)

// EncodedSize bounds the length of e's encoding.
func (e Entry) EncodedSize() int {
	return 3 + 8*binary.MaxVarintLen64 + len(e.Endpoint) + len(e.Check) + len(e.FP) + len(e.Model) + len(e.Handle)
}

// Encode serialises e compactly into dst[:0]: a version byte, varints, the
// endpoint, the check, a flag byte and the fingerprint, the turn number,
// the model and the API code, then the handle
// JSON as is, or compacted (compactHandle, whose check expands it into a
// buffer from pool; nil: a new one).
func (e Entry) Encode(dst []byte, bufs *bufpool.Bytes) []byte {
	b := append(dst[:0], entryVersion)
	b = binary.AppendVarint(b, e.Created.UnixNano())
	b = binary.AppendUvarint(b, uint64(e.Tokens))
	b = appendBytes(b, []byte(e.Endpoint))
	b = appendBytes(b, e.Check)
	var flags byte
	if e.ContentOK {
		flags |= flagContentOK
	}
	if e.ToolCalls {
		flags |= flagToolCalls
	}
	at := len(b)
	b = append(b, flags)
	b = appendBytes(b, e.FP)
	b = binary.AppendUvarint(b, uint64(max(e.Turn, 0)))
	b = appendBytes(b, []byte(e.Model))
	b = append(b, e.API)
	if c, ok := compactHandle(b, e.Handle, bufs); ok {
		c[at] |= flagCompactBlocks
		return c
	}
	return append(b, e.Handle...)
}

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
	r := entryReader{b: b}
	head, tail := r.bytes(), r.bytes()
	nested := r.byte() == 1
	groups := r.uvarint()
	if r.bad || groups > uint64(len(r.b)) || (!nested && groups != 1) {
		return nil, ErrBad
	}
	out := dst
	if out == nil {
		out = make([]byte, 0, len(head)+len(tail)+7*len(r.b)+8)
	}
	out = append(out, head...)
	out = append(out, '[')
	var prev int64
	for g := range groups {
		if g > 0 {
			out = append(out, ',')
		}
		if nested {
			out = append(out, '[')
		}
		n := r.uvarint()
		if r.bad || n > uint64(len(r.b)) {
			return nil, ErrBad
		}
		for i := range n {
			if i > 0 {
				out = append(out, ',')
			}
			prev += r.varint()
			out = strconv.AppendInt(out, prev, 10)
		}
		if nested {
			out = append(out, ']')
		}
	}
	if r.bad || len(r.b) != 0 {
		return nil, ErrBad
	}
	out = append(out, ']')
	return append(out, tail...), nil
}

func appendBytes(b, v []byte) []byte {
	b = binary.AppendUvarint(b, uint64(len(v)))
	return append(b, v...)
}

var ErrBad = errors.New("kvroute: retained value is not a kvroute entry")

// entryReader reads the fields of an encoded entry in order.
type entryReader struct {
	b   []byte
	bad bool
}

func (r *entryReader) uvarint() uint64 {
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.bad = true
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *entryReader) varint() int64 {
	v, n := binary.Varint(r.b)
	if n <= 0 {
		r.bad = true
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *entryReader) bytes() []byte {
	l := r.uvarint()
	if r.bad || uint64(len(r.b)) < l {
		r.bad = true
		return nil
	}
	v := r.b[:l:l]
	r.b = r.b[l:]
	return v
}

func (r *entryReader) byte() byte {
	if len(r.b) == 0 {
		r.bad = true
		return 0
	}
	c := r.b[0]
	r.b = r.b[1:]
	return c
}

// Decode decodes an entry encode wrote, expanding a compacted handle
// into a buffer from pool (nil: a new one), which the caller puts back
// when done with e.handle (e.expanded).
func Decode(b []byte, bufs *bufpool.Bytes) (Entry, error) {
	var e Entry
	if len(b) < 1 || b[0] < entryVersion1 || b[0] > entryVersion {
		return e, ErrBad
	}
	r := entryReader{b: b[1:]}
	created := r.varint()
	e.Tokens = int(r.uvarint())
	e.Endpoint = string(r.bytes())
	e.Check = r.bytes()
	compact := false
	if b[0] == entryVersion1 {
		e.ContentOK = true
	} else {
		flags := r.byte()
		e.ContentOK = flags&flagContentOK != 0
		compact = b[0] >= entryVersion3 && flags&flagCompactBlocks != 0
		if FP := r.bytes(); len(FP) > 0 {
			e.FP = fingerprint.Fingerprint(FP)
		}
		if b[0] >= entryVersion {
			e.ToolCalls = flags&flagToolCalls != 0
			e.Turn = int(min(r.uvarint(), 1<<31))
			e.Model = string(r.bytes())
			e.API = r.byte()
		}
	}
	if r.bad || len(r.b) == 0 {
		return Entry{}, ErrBad
	}
	e.Handle = r.b
	if compact {
		var dst []byte
		if bufs != nil {
			// About five bytes of JSON per byte of varint deltas.
			dst = bufs.Get(6*len(r.b) + 64)[:0]
		}
		h, err := appendExpanded(dst, r.b)
		if err != nil {
			if bufs != nil {
				bufs.Put(dst)
			}
			return Entry{}, err
		}
		e.Handle, e.Expanded = h, bufs != nil
	}
	e.Created = time.Unix(0, created)
	e.Raw = b
	return e, nil
}

// Package entry is the wire format of a retained decode handle: the
// handle, compacted when its block ids allow, with what the router knows
// about it (when and where it was made, the Identifier's check, the token
// fingerprint). A Store keeps the encoded bytes.
package entry

import (
	"encoding/binary"
	"errors"
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
	// Blocks is where Handle's remote_block_ids is, with its shape and
	// largest id, when known: given to Encode (kvhandle.Check's
	// Info.Blocks), it compacts the handle without reading it again;
	// from Decode, it is the list the expansion wrote, which the
	// handle's check (kvhandle.CheckKnown) need not read again. Not
	// stored.
	Blocks jsonraw.Known
	// Prefill is the prefill engine that served the turn (its prefix
	// cache holds the turn's prompt), for the decode memory ledger. Not
	// stored.
	Prefill string
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
// JSON as is, or compacted: in one pass over its block list when e.Blocks
// says where it is (compactKnown), else by compactHandle, whose check
// expands it into a buffer from pool (nil: a new one).
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
	if c, ok := compactKnown(b, e.Handle, e.Blocks); ok {
		c[at] |= flagCompactBlocks
		return c
	}
	if c, ok := compactHandle(b, e.Handle, bufs); ok {
		c[at] |= flagCompactBlocks
		return c
	}
	return append(b, e.Handle...)
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
		h, known, err := appendExpandedKnown(dst, r.b)
		if err != nil {
			if bufs != nil {
				bufs.Put(dst)
			}
			return Entry{}, err
		}
		e.Handle, e.Expanded, e.Blocks = h, bufs != nil, known
	}
	e.Created = time.Unix(0, created)
	e.Raw = b
	return e, nil
}

package kvroute

import (
	"bytes"
	"encoding/binary"
	"errors"
	"strconv"
	"time"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/sse"
)

// The kv_transfer_params member name.
const kvKey = sse.HandleKey

// missHandle is message 1 of the package doc's Wire protocol: "prefill
// here, decode elsewhere".
var missHandle = []byte(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

var (
	jsonTrue  = []byte("true")
	jsonFalse = []byte("false")
)

// handleInfo is what the router reads from an engine's handle.
type handleInfo struct {
	tokens   int  // remote_num_tokens, 0 when absent
	pushMode bool // transfer_mode "push": not usable bidirectionally
}

var errUnusableHandle = errors.New("handle lacks remote_engine_id, remote_request_id, remote_host, remote_port or remote_block_ids")

var errStop = errors.New("stop")

// hitHandle turns a retained decode handle into message 2: the two role
// flags forced, every other key verbatim. The handle is checked again
// (checkHandle): an entry may come from another router sharing the store.
func hitHandle(dHandle []byte, blockSize int) ([]byte, error) {
	if _, err := checkHandle(dHandle, blockSize); err != nil {
		return nil, err
	}
	obj, err := jsonraw.Parse(dHandle)
	if err != nil {
		return nil, err
	}
	return obj.Edit(nil,
		jsonraw.Member{Key: "do_remote_decode", Value: jsonTrue},
		jsonraw.Member{Key: "do_remote_prefill", Value: jsonFalse}), nil
}

// entry is a retained decode handle with what the router knows about it.
type entry struct {
	created   time.Time   // when the router saw D finish (router clock)
	endpoint  string      // the decode endpoint that holds the blocks
	tokens    int         // remote_num_tokens
	check     []byte      // the Identifier's Retention.Check
	contentOK bool        // the Identifier accepted the turn (no Refusal): content verification may be used
	fp        fingerprint // the token fingerprint of D's blocks, nil when unknown
	handle    []byte      // D's kv_transfer_params, verbatim

	raw []byte // the stored value, for putting it back
	// expanded: handle was expanded into a buffer from decodeEntry's
	// pool.
	expanded bool
}

// Entry encodings: version 1 had no flags and no fingerprint; version 2
// added them; version 3 adds flagCompactBlocks, a handle stored compacted
// (compactHandle), which a router that reads only version 2 refuses as a
// bad entry rather than misreading.
const (
	entryVersion1 = 1
	entryVersion2 = 2
	entryVersion  = 3
)

const (
	flagContentOK     = 1
	flagCompactBlocks = 2
)

// encodedSize bounds the length of e's encoding.
func (e entry) encodedSize() int {
	return 2 + 6*binary.MaxVarintLen64 + len(e.endpoint) + len(e.check) + len(e.fp) + len(e.handle)
}

// encode serialises e compactly into dst[:0]: a version byte, varints, the
// endpoint, the check, a flag byte and the fingerprint, then the handle
// JSON as is, or compacted (compactHandle, whose check expands it into a
// buffer from pool; nil: a new one).
func (e entry) encode(dst []byte, pool *bufPool) []byte {
	b := append(dst[:0], entryVersion)
	b = binary.AppendVarint(b, e.created.UnixNano())
	b = binary.AppendUvarint(b, uint64(e.tokens))
	b = appendBytes(b, []byte(e.endpoint))
	b = appendBytes(b, e.check)
	var flags byte
	if e.contentOK {
		flags |= flagContentOK
	}
	at := len(b)
	b = append(b, flags)
	b = appendBytes(b, e.fp)
	if c, ok := compactHandle(b, e.handle, pool); ok {
		c[at] |= flagCompactBlocks
		return c
	}
	return append(b, e.handle...)
}

// compactHandle appends h with its remote_block_ids stored as varint
// deltas (the JSON before and after the list, then the ids), about a
// fifth of their decimal JSON. ok is false (dst unchanged) when h has no
// such list of integer lists, or a flat list, or when appendExpanded would
// not give back exactly h (spacing, number spelling): the handle is then
// stored verbatim. That check expands into a buffer from pool (nil: a new
// one), unless the list's length already proves it.
func compactHandle(dst, h []byte, pool *bufPool) ([]byte, bool) {
	return compactHandleCheck(dst, h, pool, false)
}

// compactHandleCheck is compactHandle; expand forces the check by
// expansion even when the list's length shows its text is the one
// expansion writes (the test oracle).
func compactHandleCheck(dst, h []byte, pool *bufPool, expand bool) ([]byte, bool) {
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
	var prev int64
	var scratch [2048]uint32 // 32k tokens in blocks of 16, on the stack
	// canonical: every group took the fast path, and the text has exactly
	// the length expansion would write (see below); written counts it.
	canonical, written := true, 2+len(groups)-1
	if !nested {
		written = 0
	}
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
			return dst[:n], false
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
			return dst[:n], false
		}
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
	var check []byte
	if pool != nil {
		check = pool.get(len(h))[:0] // an exact expansion fits
	}
	back, err := appendExpanded(check, dst[n:])
	same := err == nil && bytes.Equal(back, h)
	if pool != nil {
		if back == nil {
			back = check
		}
		pool.put(back)
	}
	if !same {
		return dst[:n], false
	}
	return dst, true
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
		return nil, errBadEntry
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
			return nil, errBadEntry
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
		return nil, errBadEntry
	}
	out = append(out, ']')
	return append(out, tail...), nil
}

func appendBytes(b, v []byte) []byte {
	b = binary.AppendUvarint(b, uint64(len(v)))
	return append(b, v...)
}

var errBadEntry = errors.New("kvroute: retained value is not a kvroute entry")

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

// decodeEntry decodes an entry encode wrote, expanding a compacted handle
// into a buffer from pool (nil: a new one), which the caller puts back
// when done with e.handle (e.expanded).
func decodeEntry(b []byte, pool *bufPool) (entry, error) {
	var e entry
	if len(b) < 1 || b[0] < entryVersion1 || b[0] > entryVersion {
		return e, errBadEntry
	}
	r := entryReader{b: b[1:]}
	created := r.varint()
	e.tokens = int(r.uvarint())
	e.endpoint = string(r.bytes())
	e.check = r.bytes()
	compact := false
	if b[0] == entryVersion1 {
		e.contentOK = true
	} else {
		flags := r.byte()
		e.contentOK = flags&flagContentOK != 0
		compact = b[0] >= entryVersion && flags&flagCompactBlocks != 0
		if fp := r.bytes(); len(fp) > 0 {
			e.fp = fingerprint(fp)
		}
	}
	if r.bad || len(r.b) == 0 {
		return entry{}, errBadEntry
	}
	e.handle = r.b
	if compact {
		var dst []byte
		if pool != nil {
			// About five bytes of JSON per byte of varint deltas.
			dst = pool.get(6*len(r.b) + 64)[:0]
		}
		h, err := appendExpanded(dst, r.b)
		if err != nil {
			if pool != nil {
				pool.put(dst)
			}
			return entry{}, err
		}
		e.handle, e.expanded = h, pool != nil
	}
	e.created = time.Unix(0, created)
	e.raw = b
	return e, nil
}

// Why a handle cannot be read partially (TurnRecord.MissReason detail and
// Stats.PartialRefused).
var (
	errPartialDCP    = errors.New("handle has dcp_size > 1: decode-context-parallel blocks cannot be cut from the front")
	errPartialGroups = errors.New("handle's KV groups differ in length (sliding-window or state groups cannot be cut from the front)")
	errPartialBlocks = errors.New("handle's block count does not match remote_num_tokens at the configured block size (check WithBlockSize)")
	errPartialFlat   = errors.New("handle has no remote_block_ids list")
)

// cutHandle returns a copy of a decode handle that lets the prefill engine
// read only the first tokens positions (package doc, Verification):
// remote_num_tokens lowered to tokens and every KV group's remote_block_ids
// cut from the front to its first ceil(tokens/blockSize) blocks. The handle
// must be one whose blocks can be cut: dcp_size 1 (or absent), every group of
// equal length, and that length ceil(remote_num_tokens/blockSize), which
// catches a block size that differs from the engine's.
func cutHandle(raw []byte, tokens, blockSize int) ([]byte, error) {
	obj, err := jsonraw.Parse(raw)
	if err != nil {
		return nil, err
	}
	if v, ok := obj.Get("dcp_size"); ok && !jsonraw.IsNull(v) {
		if n, ok := jsonraw.Int(v); !ok || n > 1 {
			return nil, errPartialDCP
		}
	}
	rv, _ := obj.Get("remote_num_tokens")
	r, ok := jsonraw.Int(rv)
	if !ok || r <= 0 || tokens <= 0 || int64(tokens) > r {
		return nil, errUnusableHandle
	}
	want := int((r + int64(blockSize) - 1) / int64(blockSize))
	keep := (tokens + blockSize - 1) / blockSize
	blocks, ok := obj.Get("remote_block_ids")
	if !ok || len(blocks) == 0 || blocks[0] != '[' {
		return nil, errPartialFlat
	}
	// Nested [[...], ...] per group, or the flat [...] of very old engines
	// (one group).
	nested := false
	_ = jsonraw.Elements(blocks, func(e []byte) error {
		nested = len(e) > 0 && e[0] == '['
		return errStop
	})
	out := make([]byte, 0, len(blocks))
	cutGroup := func(dst, group []byte) ([]byte, error) {
		n := 0
		dst = append(dst, '[')
		err := jsonraw.Elements(group, func(e []byte) error {
			if n < keep {
				if n > 0 {
					dst = append(dst, ',')
				}
				dst = append(dst, e...)
			}
			n++
			return nil
		})
		if err != nil {
			return nil, err
		}
		if n != want {
			return nil, errPartialBlocks
		}
		return append(dst, ']'), nil
	}
	if !nested {
		if out, err = cutGroup(out, blocks); err != nil {
			return nil, err
		}
	} else {
		out = append(out, '[')
		g := 0
		err := jsonraw.Elements(blocks, func(group []byte) error {
			if len(group) == 0 || group[0] != '[' {
				return errPartialGroups
			}
			if g > 0 {
				out = append(out, ',')
			}
			g++
			var err error
			out, err = cutGroup(out, group)
			if errors.Is(err, errPartialBlocks) && g > 1 {
				return errPartialGroups
			}
			return err
		})
		if err != nil {
			return nil, err
		}
		out = append(out, ']')
	}
	return obj.Edit(nil,
		jsonraw.Member{Key: "remote_num_tokens", Value: strconv.AppendInt(nil, int64(tokens), 10)},
		jsonraw.Member{Key: "remote_block_ids", Value: out}), nil
}

package convkey

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"hash"
	"unicode/utf8"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// Hasher feeds a digest and frames fields without allocating.
type Hasher struct {
	h     hash.Hash
	tmp   [2*binary.MaxVarintLen64 + 64]byte
	chunk []byte  // writeText's, allocated on first use
	sub   *Hasher // a message's content digest, allocated on first use
}

func (d *Hasher) Write(p []byte) (int, error) {
	d.h.Write(p)
	return len(p), nil
}

// Field writes a length-prefixed name and value, so no two different
// sequences of fields hash the same input.
func (d *Hasher) Field(name string, v []byte) {
	d.lengthPrefix(name, len(v))
	d.Write(v)
}

// content writes the field name whose value is tag followed by the digest
// of body (contentDigest): a message's content, however long, is read once
// and needs no length known before it is hashed.
func (d *Hasher) content(name string, tag byte, body []byte, quoted bool) {
	if d.sub == nil {
		d.sub = New()
	}
	s := d.sub
	s.Reset()
	if quoted {
		s.writeText(body)
	} else {
		s.Write(body)
	}
	d.lengthPrefix(name, 1+sha256.Size)
	d.tmp[0] = tag
	s.h.Sum(d.tmp[:1])
	d.Write(d.tmp[:1+sha256.Size])
}

// writeText writes the decoding of the JSON string q: a string without
// escapes is hashed from q's bytes; the others are decoded piece by piece
// (the runs between escapes), gathered in chunks so that the digest gets
// few large writes, with no copy of the whole text. A q that is not a
// string writes nothing, as jsonraw.String's "".
func (d *Hasher) writeText(q []byte) {
	inner := q[1 : len(q)-1]
	if bytes.IndexByte(inner, '\\') < 0 && utf8.Valid(inner) {
		d.Write(inner)
		return
	}
	if d.chunk == nil {
		d.chunk = make([]byte, 0, hashChunk)
	}
	c := d.chunk[:0]
	jsonraw.StringPiecesTrusted(q, func(p []byte) {
		if len(c)+len(p) > cap(c) {
			d.Write(c)
			c = c[:0]
			if len(p) > cap(c)/2 {
				d.Write(p)
				return
			}
		}
		c = append(c, p...)
	})
	d.Write(c)
}

// hashChunk is the size of the chunks escaped strings are hashed in.
const hashChunk = 2 << 10

// lengthPrefix writes a field's name and the length of its value.
func (d *Hasher) lengthPrefix(name string, l int) {
	n := binary.PutUvarint(d.tmp[:], uint64(len(name)))
	if len(name) > 64 {
		d.Write(d.tmp[:n])
		d.Write([]byte(name))
		n = 0
	} else {
		n += copy(d.tmp[n:], name)
	}
	n += binary.PutUvarint(d.tmp[n:], uint64(l))
	d.Write(d.tmp[:n])
}

func isEmptyString(v []byte) bool { return len(v) == 2 && v[0] == '"' && v[1] == '"' }

// New returns a SHA-256 Hasher.
func New() *Hasher { return &Hasher{h: sha256.New()} }

// FieldString is Field for a string value, copied through the hasher's
// scratch space rather than converted.
func (d *Hasher) FieldString(name, s string) {
	d.lengthPrefix(name, len(s))
	for len(s) > 0 {
		n := copy(d.tmp[:], s)
		d.Write(d.tmp[:n])
		s = s[n:]
	}
}

// WriteDigest writes a 32-byte digest.
func (d *Hasher) WriteDigest(sum [32]byte) {
	copy(d.tmp[:], sum[:])
	d.Write(d.tmp[:32])
}

// Sum returns the digest of what was written to h.
func (d *Hasher) Sum() [32]byte {
	var s [32]byte
	copy(s[:], d.h.Sum(d.tmp[:0]))
	return s
}

// Compact appends v without insignificant whitespace to buf and returns
// buf's bytes, so that formatting does not change a digest. v comes from a
// validated body; should it not be JSON, it is appended as is.
func Compact(buf *bytes.Buffer, v []byte) []byte {
	if json.Compact(buf, v) != nil {
		buf.Write(v)
	}
	return buf.Bytes()
}

// DigestKey is the store key of a digest: prefix, a colon, the digest in
// hex.

func DigestKey(prefix string, sum [32]byte) string {
	// Built on the stack: the string is the one allocation.
	var b [16 + 1 + 2*len(sum)]byte
	if len(prefix) > 16 {
		return prefix + ":" + hex.EncodeToString(sum[:])
	}
	n := copy(b[:], prefix)
	b[n] = ':'
	n++
	n += hex.Encode(b[n:], sum[:])
	return string(b[:n])
}

// Reset empties the Hasher for a new digest.
func (d *Hasher) Reset() {
	d.h.Reset()
}

// WriteReply writes the digest of a reply the decode engine produced (its
// content and tool calls) as the digest of the assistant message the next
// request will send (Chainer.Message): after the digest of the
// conversation before it, it gives the chain with the reply.
func WriteReply(d *Hasher, content string, toolCalls []byte) {
	if d.sub == nil {
		d.sub = New()
	}
	m := d.sub
	m.Reset()
	writeMessage(m, "assistant", 't', []byte(content), true, "", "", toolCalls, nil)
	d.WriteDigest(m.Sum())
}

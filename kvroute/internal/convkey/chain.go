package convkey

import (
	"bytes"
	"crypto/sha256"
	"slices"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// Message members that never reach the rendered prompt when empty, and
// assistant members that clients echo back without meaning.
var ignoredMessageFields = map[string]bool{
	"refusal": true, "annotations": true, "audio": true, "function_call": true,
}

// Chainer hashes messages in canonical form. It keeps its digests and
// scratch buffers from one message to the next, so that hashing a
// conversation allocates little: content is hashed straight from the
// request's bytes, and only strings with escapes are decoded (into
// scratch).
type Chainer struct {
	d       Hasher
	scratch []byte
	extra   [][2][]byte
}

// NewChainer returns a Chainer.
func NewChainer() *Chainer {
	return &Chainer{d: Hasher{h: sha256.New()}}
}

// Message returns the chain of prev and m, sha256(prev || digest(m)), and
// m's role, where digest(m) is the digest of m in canonical form (the
// content's own digest in it: Hasher.content). With anchor not nil it also
// replaces *anchor by the chain of *anchor and m, from the same digest: m
// is read and hashed once.
func (c *Chainer) Message(prev [32]byte, m []byte, anchor *[32]byte) ([32]byte, string, error) {
	var (
		role, name, toolCallID []byte
		content                []byte
		toolCalls              []byte
	)
	extra := c.extra[:0]
	err := jsonraw.Members(m, func(k string, v []byte) error {
		switch k {
		case "role":
			role = rawString(v)
		case "content":
			content = v
		case "name":
			name = rawString(v)
		case "tool_call_id":
			toolCallID = rawString(v)
		case "tool_calls":
			toolCalls = v
		default:
			if ignoredMessageFields[k] || jsonraw.IsNull(v) || isEmptyString(v) {
				return nil
			}
			extra = append(extra, [2][]byte{[]byte(k), v})
		}
		return nil
	})
	c.extra = extra[:0]
	if err != nil {
		return prev, "", err
	}
	// role, name and tool_call_id are short: decode the escaped ones.
	var rs, ns, ts string
	if role != nil {
		rs = roleString(role)
	}
	if name != nil {
		ns, _ = jsonraw.String(name)
	}
	if toolCallID != nil {
		ts, _ = jsonraw.String(toolCallID)
	}
	d := &c.d
	d.h.Reset()
	slices.SortFunc(extra, func(a, b [2][]byte) int { return bytes.Compare(a[0], b[0]) })
	var tag byte
	var body []byte
	tag, body, c.scratch = canonicalContent(content, c.scratch)
	writeMessage(d, rs, tag, body, false, ns, ts, toolCalls, extra)
	md := d.Sum()
	if anchor != nil {
		*anchor = chain(d, *anchor, md)
	}
	return chain(d, prev, md), rs, nil
}

// chain returns sha256(prev || md), hashed with d.
func chain(d *Hasher, prev, md [32]byte) [32]byte {
	d.h.Reset()
	d.WriteDigest(prev)
	d.WriteDigest(md)
	return d.Sum()
}

// rawString returns v if it is a JSON string, else nil (a value that is
// not a string hashes as the empty string, as jsonraw.String's "" did).
func rawString(v []byte) []byte {
	if len(v) == 0 || v[0] != '"' {
		return []byte{}
	}
	return v
}

// roleString decodes a role, without allocating for the usual ones.
func roleString(v []byte) string {
	switch string(v) {
	case `"user"`:
		return "user"
	case `"assistant"`:
		return "assistant"
	case `"system"`:
		return "system"
	case `"tool"`:
		return "tool"
	case `"developer"`:
		return "developer"
	}
	s, _ := jsonraw.String(v)
	return s
}

// Scratch keeps the digest state one request's keys and anchors reuse: a
// turn hashes its request several times, one digest after another. It is
// not safe for concurrent use.
type Scratch struct {
	hashers [3]*Hasher
	n       int
	chainer *Chainer
}

// Hasher returns an empty Hasher, a free one if s has one.
func (s *Scratch) Hasher() *Hasher {
	if s.n == 0 {
		return New()
	}
	s.n--
	h := s.hashers[s.n]
	s.hashers[s.n] = nil
	h.Reset()
	return h
}

// SumPut returns h's digest and gives h back to s: the caller must not use
// h after.
func (s *Scratch) SumPut(h *Hasher) [32]byte {
	sum := h.Sum()
	if s.n < len(s.hashers) {
		s.hashers[s.n] = h
		s.n++
	}
	return sum
}

// Chainer returns s's free Chainer, or a new one; PutChainer gives it back
// when the caller is done with it.
func (s *Scratch) Chainer() *Chainer {
	c := s.chainer
	s.chainer = nil
	if c == nil {
		c = NewChainer()
	}
	return c
}

// PutChainer gives c back to s.
func (s *Scratch) PutChainer(c *Chainer) { s.chainer = c }

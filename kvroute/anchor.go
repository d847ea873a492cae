package kvroute

import (
	"encoding/binary"
	"unicode"
	"unicode/utf8"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/capture"
	"github.com/bidikv/bidikv/kvroute/internal/convkey"
)

// Conversation anchors. ContinuationKeys retains a conversation's live
// handle under one key that the conversation's later requests can name even
// after an edit, a compaction or a template that rewrites history, so that
// token verification can reuse the unedited prefix: the anchor. It digests
// the tenant, the model, cache_salt and either the client's conversation
// hint (conversationHint) or the conversation's start (chat: the messages up
// to and including the first one that is not a system or developer message;
// completions: a leading slice of the prompt whose length is a "quarter
// octave" step, see anchorLen). Nothing in an anchor is trusted: what the
// handle holds is verified before it is used.
//
// One Take finds a chat conversation's handle, so a miss costs one store
// round trip.

// anchorBase hashes what every anchor of the request shares.
// The caller gives h back with req.sumPut.
func anchorBase(req *Request, kind string) *convkey.Hasher {
	h := req.keys.Hasher()
	h.FieldString("anchor.v1", kind)
	h.FieldString("tenant", req.Tenant())
	for _, f := range [...]string{"model", "cache_salt"} {
		if v, ok := req.Field(f); ok && !jsonraw.IsNull(v) {
			h.Field(f, v)
		}
	}
	return h
}

// chatAnchorFrom returns the anchor key of a chat request whose
// conversation start (chainConversation's second result) is start.
func chatAnchorFrom(req *Request, start [32]byte) string {
	h := anchorBase(req, "chat.v2") // the chain's version (chainConversation)
	if hint := conversationHint(req); hint != "" {
		h.Field("hint", []byte(hint))
		return convkey.DigestKey("a", req.keys.SumPut(h))
	}
	h.Field("start", start[:])
	return convkey.DigestKey("a", req.keys.SumPut(h))
}

// completionAnchors returns the anchor keys under which a completions
// request may find its conversation's handle, most specific first: the
// hint's, or those of the prompt's leading anchorLen steps, longest first,
// at most maxAnchorTries of them. A handle is retained under the longest
// step within its prompt + reply, so it is found while the prompt has grown
// less than about fourfold since; and two conversations share an anchor
// only if they share at least about four fifths of the text retained.
func completionAnchors(req *Request, prompt string) []string {
	h := anchorBase(req, "completion")
	if hint := conversationHint(req); hint != "" {
		h.Field("hint", []byte(hint))
		return []string{convkey.DigestKey("a", req.keys.SumPut(h))}
	}
	base := req.keys.SumPut(h)
	var keys []string
	for a := anchorLen(len(prompt)); a >= minAnchor && len(keys) < maxAnchorTries; a = anchorLen(a - 1) {
		keys = append(keys, prefixAnchor(base, prompt[:a]))
	}
	return keys
}

// completionAnchor returns the anchor key a completions turn whose prompt
// plus reply is text is retained under ("" when text is too short).
func completionAnchor(req *Request, text string) string {
	h := anchorBase(req, "completion")
	if hint := conversationHint(req); hint != "" {
		h.Field("hint", []byte(hint))
		return convkey.DigestKey("a", req.keys.SumPut(h))
	}
	a := anchorLen(len(text))
	if a < minAnchor {
		return ""
	}
	return prefixAnchor(req.keys.SumPut(h), text[:a])
}

const maxAnchorTries = 8

func prefixAnchor(base [32]byte, s string) string {
	h := convkey.New()
	h.WriteDigest(base)
	h.Field("prefix", []byte(s))
	return convkey.DigestKey("a", h.Sum())
}

// anchorLen returns the longest anchor length <= n: the numbers m*2^e
// with m in 4..7 (16, 20, 24, 28, 32, 40, ...), four steps an octave, each
// at most 1.25 times the one before; 0 when n < 4.
func anchorLen(n int) int {
	if n < 4 {
		return 0
	}
	e := 0
	for n>>e >= 8 {
		e++
	}
	return (n >> e) << e
}

// anchorText returns what a completions prompt is anchored on: the prompt
// string, or for a prompt of token ids their little-endian bytes (four per
// id), so that the anchor does not depend on the client's JSON spacing.
func anchorText(req *Request) (string, bool) {
	if s, ok := promptString(req); ok {
		return s, true
	}
	p, ok := req.Field("prompt")
	if !ok {
		return "", false
	}
	ids, ok := capture.AppendTokenIDs(nil, p)
	if !ok || len(ids) == 0 {
		return "", false
	}
	b := make([]byte, 0, 4*len(ids))
	for _, id := range ids {
		b = binary.LittleEndian.AppendUint32(b, id)
	}
	return string(b), true
}

// agentAnchor is the anchor of a Responses or Messages request: the hint,
// else the head member and the turns up to and including the first user
// turn (a string input: its first 256 bytes), as far as the engine renders
// them (renderFilter: Claude Code's per-request billing header in the
// system prompt is not, so it cannot make every turn a new conversation).
func agentAnchor(req *Request) string {
	h := anchorBase(req, req.Path)
	if hint := conversationHint(req); hint != "" {
		h.Field("hint", []byte(hint))
		return convkey.DigestKey("a", req.keys.SumPut(h))
	}
	a, ok := apiFor(req.Path)
	if !ok {
		a = responsesAPI // renders every text
	}
	head, turns := a.head, a.turns
	var buf []byte
	if v, ok := req.Field(head); ok && !jsonraw.IsNull(v) {
		buf = anchorContent(buf[:0], v, a, "", true)
		h.Field(head, buf)
	}
	v, _ := req.Field(turns)
	if s, ok := jsonraw.String(v); ok {
		h.Field("start", []byte(s[:min(len(s), 256)]))
		return convkey.DigestKey("a", h.Sum())
	}
	_ = jsonraw.Elements(v, func(item []byte) error {
		role, _ := jsonraw.Lookup(item, "role")
		buf = append(buf[:0], role...)
		if c, ok := jsonraw.Lookup(item, "content"); ok {
			rs, _ := jsonraw.String(role)
			buf = anchorContent(append(buf, 0), c, a, rs, false)
		}
		h.Field("turn", buf)
		if s, _ := jsonraw.String(role); s == "user" {
			return errStop
		}
		return nil
	})
	return convkey.DigestKey("a", h.Sum())
}

// anchorContent appends what an anchor keeps of a content value of the
// head member (head) or of a turn of the given role: a string, or the
// text of each block of a list, in order; a block without text as its
// type. Texts the API's engine does not render (a.renders) are left out.
// Block metadata that agents move from turn to turn (Claude Code's
// cache_control breakpoints) and the string-or-blocks spelling do not
// change an anchor, which is only a candidate lookup: token verification
// decides.
func anchorContent(dst, v []byte, a *api, role string, head bool) []byte {
	if s, ok := jsonraw.String(v); ok {
		if !a.renders(s, role, head, false) {
			return dst
		}
		return append(append(dst, s...), 0)
	}
	_ = jsonraw.Elements(v, func(b []byte) error {
		if t, ok := jsonraw.Lookup(b, "text"); ok {
			if s, ok := jsonraw.String(t); ok {
				if a.renders(s, role, head, true) {
					dst = append(append(dst, s...), 0)
				}
				return nil
			}
		}
		if t, ok := jsonraw.Lookup(b, "type"); ok {
			dst = append(append(dst, t...), 0)
		}
		return nil
	})
	return dst
}

func agentLookup(req *Request) (Candidates, error) {
	return Candidates{Keys: []string{agentAnchor(req)}}, nil
}

func agentKey(req *Request) (Retention, error) {
	return Retention{Key: agentAnchor(req), Refusal: RefuseTokenOnly}, nil
}

// ContinuationKeys on completions: a prompt string is keyed on its anchor
// and checked with the text it must begin with; the seams between prompt,
// reply and what follows must be clean token boundaries (see
// ContinuationKeys).

func (c ContinuationKeys) completionLookup(req *Request) (Candidates, error) {
	text, ok := anchorText(req)
	if !ok {
		return Candidates{}, nil
	}
	return Candidates{Keys: completionAnchors(req, text)}, nil
}

const minAnchor = 16

func (c ContinuationKeys) completionKey(req *Request, reply *Reply, soft Refusal) (Retention, error) {
	prompt, ok := promptString(req)
	if !ok {
		// A prompt of token ids: keyed for token verification only.
		text, ok := anchorText(req)
		if key := completionAnchor(req, text); ok && key != "" {
			return Retention{Key: key, Refusal: RefuseUnkeyable}, nil
		}
		return Retention{Refusal: RefuseUnkeyable}, nil
	}
	// D tokenized the prompt alone: it must end where the next prompt's
	// tokenization will also cut, and so must the reply (checked by
	// Verify against what follows it).
	// A bad seam is a soft refusal: the key is still returned.
	var refusal Refusal
	if endsInSpace(prompt) || (reply.Content != "" && !cleanSeam(prompt, reply.Content)) {
		refusal = RefuseTokenBoundary
	}
	text := prompt + reply.Content
	if endsInSpace(text) {
		refusal = RefuseTokenBoundary
	}
	key := completionAnchor(req, text)
	if key == "" {
		return Retention{Refusal: RefuseUnkeyable}, nil
	}
	if soft != "" {
		refusal = soft
	}
	sum := completionCheckSum(req, text)
	check := binary.AppendUvarint(nil, uint64(len(text)))
	return Retention{Key: key, Check: append(check, sum[:]...), Refusal: refusal}, nil
}

// completionCheckSum is the content check of a completions turn whose
// prompt (plus reply) is text: a digest of the prompt-shaping fields
// (completionShaping: add_special_tokens puts a BOS token in front of the
// prompt, so the same text renders other tokens) and of text.
func completionCheckSum(req *Request, text string) [32]byte {
	shaping := shapingDigest(req, "completion", completionShaping)
	h := req.keys.Hasher()
	h.WriteDigest(shaping)
	h.FieldString("text", text)
	return req.keys.SumPut(h)
}

// promptString returns a completions prompt given as one string.
func promptString(req *Request) (string, bool) {
	v, ok := req.Field("prompt")
	if !ok {
		return "", false
	}
	if _, has := req.Field("suffix"); has {
		return "", false
	}
	return jsonraw.String(v)
}

// cleanSeam reports whether a BPE tokenizer is taken to split left+right
// between left and right (the heuristic of ContinuationKeys' doc): left
// ends in a rune that is not whitespace, and right begins with a space, or
// with a newline after a letter or digit. Punctuation takes the newlines
// after it ("." + "\n" is one Llama 3 token), one punctuation mark or a
// space prefixes the word after it, and letter and digit runs merge, so
// every other seam is refused.
func cleanSeam(left, right string) bool {
	a, _ := utf8.DecodeLastRuneInString(left)
	b, _ := utf8.DecodeRuneInString(right)
	if left == "" || right == "" || a == utf8.RuneError || unicode.IsSpace(a) {
		return false
	}
	switch b {
	case ' ':
		return true
	case '\n', '\r':
		return isWordRune(a)
	}
	return false
}

func isWordRune(r rune) bool { return unicode.IsLetter(r) || unicode.IsNumber(r) }

// endsInSpace reports whether s ends in a whitespace rune.
func endsInSpace(s string) bool {
	r, _ := utf8.DecodeLastRuneInString(s)
	return s != "" && unicode.IsSpace(r)
}

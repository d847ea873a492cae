package kvroute

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"hash"
	"slices"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// ContinuationKeys is the default Identifier. It keys a retained handle on
// what the decode engine's KV actually holds: a digest of the tenant, every
// prompt-shaping request field, the canonical messages and the reply the
// engine produced. A later request finds the handle only if it sends that
// same conversation, reply included, followed by something new; a request
// that edited, stripped or reordered anything, or that comes from another
// tenant, cannot name the handle. No client id is needed and none unlocks
// a handle.
//
// Chat requests are looked up under every prefix of their messages that
// ends with an assistant message, longest first; the hashing is a single
// chained pass over the messages. Completions requests are looked up under
// the conversation hint (ConversationHint), if any, otherwise under the
// prompt's leading bytes, and the handle is used only after the new prompt
// is verified to begin with the stored prompt plus the generated text, to
// go on beyond it, and to go on at a clean token boundary (see below).
//
// Equal meaning hashes equal: content as a string or as a single text part
// (vLLM hands the template the same thing for both); absent, null and
// empty content; absent, null and empty optional message fields; echoed
// assistant fields such as refusal, annotations or audio; tool calls whose
// members come in another order, and an absent tool-call type and
// "function". Different rendering hashes differently: two or more text
// parts never hash like a string (vLLM's "openai" content format
// concatenates them, its "string" format joins them with newlines); a
// tool call's arguments given as a string hash as that text, given as any
// other JSON value as its compacted JSON, with distinct tags, and object
// members inside arguments keep their order (the template renders them in
// that order: transformers' tojson does not sort keys); every member of a
// tool call and of its function is hashed, so any change to a call
// changes the digest.
//
// Request flags are read as vLLM's pydantic models read them (lax mode:
// "echo": 1 and "continue_final_message": "true" are true); a flag that
// cannot be read counts as the value that refuses.
//
// A finished turn is refused (Retention.Refusal) when the next prompt may
// not reproduce the engine's tokens. A hard refusal returns no key: the
// turn is not retained. A soft refusal (marked "soft" below) returns the
// key with the refusal: content rules never use such a handle, but the
// router may retain it for token verification (WithVerification), which
// compares the engine's token ids and so is exact where these rules guess.
//   - RefuseReasoning: the engine returned reasoning output (the template
//     strips it from past turns);
//   - RefuseInlineReasoning (soft): a chat reply's content holds a
//     reasoning close tag (ReasoningCloseTags): a reasoning model served
//     without a reasoning parser, whose template strips the reasoning from
//     past turns;
//   - RefuseThinkingOff (soft): chat_template_kwargs.enable_thinking is set
//     to anything but true (Qwen3-style templates put an empty think block
//     in the generation prompt that past turns do not render);
//   - RefuseNoGenerationPrompt (soft): add_generation_prompt is false, so
//     the reply follows the user message directly while the next render
//     puts the assistant header in between;
//   - RefuseN: n other than 1;
//   - RefuseTruncate: truncate_prompt_tokens is set;
//   - RefuseStopString: a stop string ended the reply and was cut from it;
//   - RefuseContinueFinal: continue_final_message;
//   - RefuseEcho: echo;
//   - RefuseIncomplete: the reply could not be reassembled;
//   - RefuseTooLarge: the reply is over MaxReplyBytes;
//   - RefuseUnkeyable: a completions prompt that is not a single string, has
//     a suffix, or is too short to anchor;
//   - RefuseTokenBoundary (soft): a completions prompt and its reply do not
//     meet at a clean token boundary, or their text ends in whitespace.
//
// Completions token boundaries are a heuristic for BPE tokenizers (GPT-2,
// Llama 3, Qwen and tiktoken style pre-tokenizers, and SentencePiece): D
// tokenized the prompt alone and generated the reply's tokens after it,
// while the next prompt is tokenized in one piece, so the two agree only if
// no token spans the seams. Such tokenizers attach a space to the word
// after it, merge letter and digit runs, let a punctuation mark take the
// newlines after it, and let one punctuation mark prefix the next word. A
// seam is taken as clean only when the text before it ends in a
// non-whitespace rune and the text after it begins with a space, or with a
// newline after a letter or digit. Key refuses when the prompt ends in
// whitespace, when prompt and reply do not meet cleanly, or when
// prompt+reply ends in whitespace; Verify refuses a handle when the new
// prompt does not go on cleanly right after the stored text. Even a clean
// seam cannot show that the engine's tokens equal a fresh tokenization of
// its own text: only the token verification mode (WithVerification),
// which compares the engine's token ids, is exact.
//
// The zero value is ready to use.
type ContinuationKeys struct {
	// MaxReplyBytes bounds the reply that is keyed; a longer one is
	// refused. 0 means DefaultMaxReplyBytes.
	MaxReplyBytes int
	// ReasoningCloseTags are the strings that, found in a chat reply's
	// content, mark reasoning served inline (RefuseInlineReasoning). nil
	// means the one tag DefaultReasoningCloseTag; an empty, non-nil slice
	// turns the check off.
	ReasoningCloseTags []string
}

// DefaultMaxReplyBytes is ContinuationKeys' default reply bound.
const DefaultMaxReplyBytes = 1 << 20

// DefaultReasoningCloseTag is ContinuationKeys' default reasoning close
// tag, used by Qwen3, DeepSeek-R1 and most open reasoning models.
const DefaultReasoningCloseTag = "</think>"

// Fields that shape the rendered prompt in vLLM's chat and completion
// request models, hashed into every content check (chat: the chained
// conversation digest; completions: the prompt's check). Sorted, so the
// digest does not depend on the client's key order.
var chatShaping = []string{
	"add_generation_prompt", "add_special_tokens", "cache_salt", "chat_template",
	"chat_template_kwargs", "continue_final_message", "documents", "media_io_kwargs",
	"mm_processor_kwargs", "model", "parallel_tool_calls", "reasoning_effort",
	"tool_choice", "tools",
}

var completionShaping = []string{
	"add_special_tokens", "cache_salt", "mm_processor_kwargs", "model",
}

// Message members that never reach the rendered prompt when empty, and
// assistant members that clients echo back without meaning.
var ignoredMessageFields = map[string]bool{
	"refusal": true, "annotations": true, "audio": true, "function_call": true,
}

// chatDigest is what Lookup computes of a chat conversation, kept in
// Candidates.Memo for Verify and Key.
type chatDigest struct {
	// chain is the digest of the whole conversation, which Key extends
	// with the reply.
	chain [32]byte
	// bounds are the digests of every prefix of the messages that ends
	// with an assistant message, but the last message.
	bounds [][32]byte
	// anchor is the chat anchor key, from the same pass.
	anchor string
	// keys backs Lookup's Candidates.Keys (the anchor): one allocation
	// with the digest.
	keys [1]string
}

// Lookup implements Identifier: the conversation's anchor (see anchor.go),
// one key. It also hashes the conversation once, keeping the digest of
// every prefix that ends with an assistant message (except the last
// message) for Verify and the whole chain for Key, in Candidates.Memo.
func (c ContinuationKeys) Lookup(req *Request) (Candidates, error) {
	switch req.Path {
	case PathChatCompletions:
	case PathCompletions:
		return c.completionLookup(req)
	default:
		return agentLookup(req)
	}
	// Room for a conversation of a few turns without regrowing.
	bounds := make([][32]byte, 0, 8)
	last := ""
	cur, start, err := chainConversation(req, func(cur [32]byte, role string) {
		if role == "assistant" {
			bounds = append(bounds, cur)
		}
		last = role
	})
	if err != nil {
		return Candidates{}, err
	}
	// A request whose last message is the stored reply itself sends
	// nothing new: it is no continuation.
	if last == "assistant" && len(bounds) > 0 {
		bounds = bounds[:len(bounds)-1]
	}
	anchor := chatAnchorFrom(req, start)
	d := &chatDigest{chain: cur, bounds: bounds, anchor: anchor, keys: [1]string{anchor}}
	return Candidates{Keys: d.keys[:], Memo: d}, nil
}

// digest returns the chat digest Lookup left in cands, computing it when
// cands holds none (Key without Lookup, or Candidates from another
// Identifier).
func (c ContinuationKeys) digest(req *Request, cands Candidates) (*chatDigest, error) {
	if d, ok := cands.Memo.(*chatDigest); ok {
		return d, nil
	}
	fresh, err := c.Lookup(req)
	if err != nil {
		return nil, err
	}
	return fresh.Memo.(*chatDigest), nil
}

// Key implements Identifier.
func (c ContinuationKeys) Key(req *Request, cands Candidates, reply *Reply) (Retention, error) {
	reason, soft := c.refusal(req, reply)
	if reason != "" && !soft {
		return Retention{Refusal: reason}, nil
	}
	switch req.Path {
	case PathChatCompletions:
	case PathCompletions:
		return c.completionKey(req, reply, reason)
	default:
		return agentKey(req)
	}
	d, err := c.digest(req, cands)
	if err != nil {
		return Retention{}, err
	}
	h := req.getHasher()
	h.writeDigest(d.chain)
	writeMessage(h, "assistant", 't', []byte(reply.Content), true, "", "", reply.ToolCalls, nil)
	next := req.sumPut(h)
	return Retention{Key: d.anchor, Check: next[:], Refusal: reason}, nil
}

// Verify implements Identifier: chat keys need no check; a completions
// handle is used only if the new prompt begins with the stored text and
// goes on beyond it at a clean token boundary (cleanSeam: the stored text
// ends in a rune that is not whitespace and the new text begins with a
// space, or with a newline after a letter or digit). The boundary rule is
// a heuristic (see ContinuationKeys); token verification is exact.
func (c ContinuationKeys) Verify(req *Request, cands Candidates, check []byte) bool {
	if req.Path != PathChatCompletions && req.Path != PathCompletions {
		return false // Responses and Messages: token verification only
	}
	if req.Chat() {
		if len(check) != sha256.Size {
			return false
		}
		d, err := c.digest(req, cands)
		if err != nil {
			return false
		}
		for _, b := range d.bounds {
			if bytes.Equal(b[:], check) {
				return true
			}
		}
		return false
	}
	prompt, ok := promptString(req)
	if !ok {
		return false
	}
	n, k := binary.Uvarint(check)
	if k <= 0 || len(check)-k != sha256.Size || uint64(len(prompt)) <= n {
		return false
	}
	sum := completionCheckSum(req, prompt[:n])
	return bytes.Equal(sum[:], check[k:]) && cleanSeam(prompt[:n], prompt[n:])
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

// refusal returns why the turn must not be retained under content rules,
// and whether the refusal is soft: the key is still computed and returned
// with the refusal, so that the router may retain the turn for token
// verification only.
func (c ContinuationKeys) refusal(req *Request, reply *Reply) (reason Refusal, soft bool) {
	max := c.MaxReplyBytes
	if max <= 0 {
		max = DefaultMaxReplyBytes
	}
	if v, ok := req.Field("n"); ok && !jsonraw.IsNull(v) {
		if n, ok := lenientInt(v); !ok || n != 1 {
			return RefuseN, false
		}
	}
	// Every other refusal is soft: the engine's token ids still say exactly
	// what its blocks hold.
	switch {
	case reply.Reasoning != "":
		return RefuseReasoning, true
	case reply.Incomplete:
		return RefuseIncomplete, true
	case len(reply.Content)+len(reply.ToolCalls) > max:
		return RefuseTooLarge, true
	}
	if v, ok := req.Field("truncate_prompt_tokens"); ok && !jsonraw.IsNull(v) {
		return RefuseTruncate, true
	}
	if flagTrue(req, "continue_final_message") {
		return RefuseContinueFinal, true
	}
	if flagTrue(req, "echo") {
		return RefuseEcho, true
	}
	if reply.FinishReason == "stop" && hasStopStrings(req) && !stopStringKept(req) && !stopByToken(reply.StopReason) {
		return RefuseStopString, true
	}
	// Soft refusals: the turn is keyed as usual, for token verification
	// only.
	if req.Chat() {
		if v, ok := req.Field("add_generation_prompt"); ok && !jsonraw.IsNull(v) {
			if b, ok := lenientBool(v); !ok || !b {
				return RefuseNoGenerationPrompt, true
			}
		}
		if thinkingDisabled(req) {
			return RefuseThinkingOff, true
		}
		if c.inlineReasoning(reply.Content) {
			return RefuseInlineReasoning, true
		}
	}
	return "", false
}

// inlineReasoning reports whether content holds one of the reasoning
// close tags.
func (c ContinuationKeys) inlineReasoning(content string) bool {
	if c.ReasoningCloseTags == nil {
		return strings.Contains(content, DefaultReasoningCloseTag)
	}
	for _, t := range c.ReasoningCloseTags {
		if t != "" && strings.Contains(content, t) {
			return true
		}
	}
	return false
}

// thinkingDisabled reports whether chat_template_kwargs sets
// enable_thinking to anything but true. Qwen3-style templates then append
// an empty "<think>\n\n</think>\n\n" to the generation prompt but render
// past assistant turns without it, so D's tokens are not a prefix of the
// next prompt. (The template sees the raw value: only true is sure to
// leave the generation prompt alone; absent means the template's default,
// thinking, whose output is refused as reasoning.)
func thinkingDisabled(req *Request) bool {
	kw, ok := req.Field("chat_template_kwargs")
	if !ok || len(kw) == 0 || kw[0] != '{' {
		return false
	}
	v, ok := jsonraw.Lookup(kw, "enable_thinking")
	if !ok {
		return false
	}
	b, isBool := jsonraw.Bool(v)
	return !isBool || !b
}

// hasStopStrings reports whether the request sets non-empty stop strings.
func hasStopStrings(req *Request) bool {
	v, ok := req.Field("stop")
	if !ok || jsonraw.IsNull(v) {
		return false
	}
	if s, ok := jsonraw.String(v); ok {
		return s != ""
	}
	found := false
	_ = jsonraw.Elements(v, func(e []byte) error {
		if s, ok := jsonraw.String(e); ok && s != "" {
			found = true
			return errStop
		}
		return nil
	})
	return found
}

func stopStringKept(req *Request) bool {
	v, ok := req.Field("include_stop_str_in_output")
	if !ok {
		return false
	}
	b, _ := lenientBool(v)
	return b
}

// stopByToken reports whether vLLM's stop_reason says the reply ended on
// end-of-sequence (null) or a stop token id (a number), not a stop string.
func stopByToken(stopReason []byte) bool {
	if stopReason == nil {
		return false
	}
	if jsonraw.IsNull(stopReason) {
		return true
	}
	_, isInt := jsonraw.Int(stopReason)
	return isInt
}

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
	h := req.getHasher()
	h.writeDigest(shaping)
	h.fieldString("text", text)
	return req.sumPut(h)
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

func digestKey(prefix string, sum [32]byte) string {
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

// shapingDigest hashes the tenant and the prompt-shaping fields present.
func shapingDigest(req *Request, kind string, fields []string) [32]byte {
	h := req.getHasher()
	h.fieldString("v1", kind)
	h.fieldString("tenant", req.Tenant())
	var buf bytes.Buffer
	for _, f := range fields {
		v, ok := req.Field(f)
		if !ok || jsonraw.IsNull(v) {
			continue
		}
		buf.Reset()
		writeField(h, f, compact(&buf, v))
	}
	return req.sumPut(h)
}

// chainer hashes messages in canonical form. It keeps its digests and
// scratch buffers from one message to the next, so that hashing a
// conversation allocates little: content is hashed straight from the
// request's bytes, and only strings with escapes are decoded (into
// scratch).
type chainer struct {
	d       hasher
	scratch []byte
	extra   [][2][]byte
}

func newChainer() *chainer {
	return &chainer{d: hasher{h: sha256.New()}}
}

// message returns sha256(prev || canonical(m)) and m's role. With anchor
// not nil it also replaces *anchor by sha256(*anchor || canonical(m)), from
// the same pass over m.
func (c *chainer) message(prev [32]byte, m []byte, anchor *[32]byte) ([32]byte, string, error) {
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
	d.writeDigest(prev)
	if anchor != nil {
		if d.a == nil {
			d.a = sha256.New()
		}
		d.a.Reset()
		copy(d.tmp[:], anchor[:])
		d.a.Write(d.tmp[:32])
		d.both = true
	}
	slices.SortFunc(extra, func(a, b [2][]byte) int { return bytes.Compare(a[0], b[0]) })
	var tag byte
	var body []byte
	tag, body, c.scratch = canonicalContent(content, c.scratch)
	writeMessage(d, rs, tag, body, false, ns, ts, toolCalls, extra)
	d.both = false
	sum := d.sum()
	if anchor != nil {
		copy(anchor[:], d.a.Sum(d.tmp[:0]))
	}
	return sum, rs, nil
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

// chainMessage returns sha256(prev || canonical(m)) and m's role.
func chainMessage(prev [32]byte, m []byte) ([32]byte, string, error) {
	return newChainer().message(prev, m, nil)
}

// hasher feeds one digest, or two with both set, the same bytes, and
// frames fields without allocating.
type hasher struct {
	h, a  hash.Hash
	both  bool
	tmp   [2*binary.MaxVarintLen64 + 64]byte
	chunk []byte // taggedString's, allocated on first use
}

func (d *hasher) Write(p []byte) (int, error) {
	d.h.Write(p)
	if d.both {
		d.a.Write(p)
	}
	return len(p), nil
}

// field is writeField: a length-prefixed name and value.
func (d *hasher) field(name string, v []byte) {
	d.tagged(name, -1, v)
}

// tagged is field for the value tag followed by v (tag < 0: v alone).
func (d *hasher) tagged(name string, tag int, v []byte) {
	l := len(v)
	if tag >= 0 {
		l++
	}
	d.lengthPrefix(name, l)
	if tag >= 0 {
		d.tmp[0] = byte(tag)
		d.Write(d.tmp[:1])
	}
	d.Write(v)
}

// taggedString is tagged for the decoding of the JSON string q: strings
// without escapes are hashed from q's bytes; the others are decoded twice,
// piece by piece, once for their length and once into the digest, so no
// copy of the text is made.
func (d *hasher) taggedString(name string, tag byte, q []byte) {
	inner := q[1 : len(q)-1]
	if bytes.IndexByte(inner, '\\') < 0 && utf8.Valid(inner) {
		d.tagged(name, int(tag), inner)
		return
	}
	n := 0
	if !jsonraw.StringPiecesTrusted(q, func(p []byte) { n += len(p) }) {
		d.tagged(name, int(tag), nil) // not a string: as jsonraw.String's ""
		return
	}
	d.lengthPrefix(name, n+1)
	d.tmp[0] = tag
	d.Write(d.tmp[:1])
	// The pieces are short (the runs between escapes): gather them in
	// chunks, so the digest gets few large writes.
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
func (d *hasher) lengthPrefix(name string, l int) {
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

// canonicalContent maps content to one form, returned as a tag byte and
// the bytes that follow it (aliasing v or scratch, which is returned for
// reuse); for tag 't' the bytes are a raw JSON string, hashed as its
// decoding without building it (hasher.taggedString). vLLM turns string content
// into a list of one text part and null into no parts, then hands the
// template either the parts (its "openai" content format, where a template
// concatenates text parts) or their texts joined with newlines ("string"
// format); the router cannot know which. So a string and a single text
// part give the text tagged "t", and null, absent, "" and [] the empty
// text; two or more text parts give their texts, each length-prefixed,
// tagged "p", unlike any string; anything else (images, audio, parts with
// other members) gives its compacted JSON tagged "j".
func canonicalContent(v, scratch []byte) (tag byte, body, buf []byte) {
	if len(v) == 0 || jsonraw.IsNull(v) {
		return 't', nil, scratch
	}
	if v[0] == '"' {
		return 't', v, scratch // a raw string: writeMessage decodes it
	}
	if v[0] == '[' {
		// Text parts: their raw strings first, decoded below.
		var small [4][]byte
		parts := small[:0]
		allText := true
		_ = jsonraw.Elements(v, func(p []byte) error {
			var typ, text []byte
			hasText := false
			other := false
			_ = jsonraw.Members(p, func(k string, pv []byte) error {
				switch k {
				case "type":
					typ = pv
				case "text":
					text = pv
					hasText = len(pv) > 0 && pv[0] == '"'
				default:
					if !jsonraw.IsNull(pv) {
						other = true
					}
				}
				return nil
			})
			if !hasText || other || !isText(typ) {
				allText = false
				return errStop
			}
			parts = append(parts, text)
			return nil
		})
		if allText {
			switch len(parts) {
			case 0:
				return 't', nil, scratch
			case 1:
				return 't', parts[0], scratch
			}
			b := scratch[:0]
			for _, p := range parts {
				// Decoded after a length placeholder, then the length put
				// in front: each part is appended once.
				at := len(b)
				b = append(b, make([]byte, binary.MaxVarintLen64)...)
				b, _ = jsonraw.AppendString(b, p)
				n := len(b) - at - binary.MaxVarintLen64
				var l [binary.MaxVarintLen64]byte
				k := binary.PutUvarint(l[:], uint64(n))
				copy(b[at:], l[:k])
				b = append(b[:at+k], b[at+binary.MaxVarintLen64:]...)
			}
			return 'p', b, b
		}
	}
	out := compact(bytes.NewBuffer(scratch[:0]), v)
	return 'j', out, out
}

// isText reports whether a part's type is the JSON string "text".
func isText(typ []byte) bool {
	if string(typ) == `"text"` {
		return true
	}
	s, ok := jsonraw.String(typ)
	return ok && s == "text"
}

// writeMessage hashes one message in canonical form: content is tag
// followed by body. A text body (tag 't') is the JSON string of a request's
// content, hashed as its decoding; text is set when body is the text itself
// (a reply D sent, which may begin with a quote like any text), hashed as
// is.
func writeMessage(d *hasher, role string, tag byte, body []byte, text bool, name, toolCallID string, toolCalls []byte, extra [][2][]byte) {
	d.fieldString("role", role)
	if tag == 't' && !text && len(body) > 0 && body[0] == '"' {
		d.taggedString("content", tag, body)
	} else {
		d.tagged("content", int(tag), body)
	}
	d.fieldString("name", name)
	d.fieldString("tool_call_id", toolCallID)
	writeToolCalls(d, toolCalls)
	if len(extra) > 0 {
		var buf bytes.Buffer
		for _, e := range extra {
			buf.Reset()
			d.field("x:"+string(e[0]), compact(&buf, e[1]))
		}
	}
	d.tmp[0] = 0xff // end of message
	d.Write(d.tmp[:1])
}

// writeToolCalls hashes tool calls; null and [] hash like none. Each call
// hashes every member that is not null, in key order (clients re-serialize
// calls in their own member order: the OpenAI SDK echoes
// {"id","function":{"arguments","name"},"type"} for the engine's
// {"id","type","function":{"name","arguments"}}), with an absent type read
// as "function". function's members are hashed the same way, arguments by
// toolArguments, every other value as canonical JSON.
func writeToolCalls(h *hasher, v []byte) {
	if len(v) == 0 || jsonraw.IsNull(v) {
		return
	}
	var buf []byte
	_ = jsonraw.Elements(v, func(call []byte) error {
		h.field("call", nil)
		if len(call) == 0 || call[0] != '{' {
			buf = canonicalJSON(buf[:0], call)
			h.field("c", buf)
			return nil
		}
		hasType := false
		members := sortedMembers(call)
		for _, m := range members {
			if m.key == "type" {
				hasType = true
			}
		}
		if !hasType {
			members = append(members, member{"type", []byte(`"function"`)})
			slices.SortStableFunc(members, func(a, b member) int { return strings.Compare(a.key, b.key) })
		}
		for _, m := range members {
			if m.key == "function" && len(m.v) > 0 && m.v[0] == '{' {
				h.field("c:function", []byte("object"))
				for _, f := range sortedMembers(m.v) {
					if f.key == "arguments" {
						buf = toolArguments(buf[:0], f.v)
					} else {
						buf = canonicalJSON(buf[:0], f.v)
					}
					h.field("f:"+f.key, buf)
				}
				continue
			}
			buf = canonicalJSON(buf[:0], m.v)
			h.field("c:"+m.key, buf)
		}
		return nil
	})
}

// toolArguments appends the canonical form of a tool call's arguments: a
// string as 's' and its text, any other JSON value as 'j' and its
// canonical JSON, so the string "{}" and the object {} differ (the engine
// returns the string form, and a client that echoes it back unchanged
// hits; the object form renders through the template's own serializer).
func toolArguments(dst, v []byte) []byte {
	if s, ok := jsonraw.String(v); ok {
		return append(append(dst, 's'), s...)
	}
	return canonicalJSON(append(dst, 'j'), v)
}

type member struct {
	key string
	v   []byte
}

// sortedMembers returns obj's members that are not null, sorted by key
// (stably: duplicates keep their order).
func sortedMembers(obj []byte) []member {
	var ms []member
	_ = jsonraw.Members(obj, func(k string, v []byte) error {
		if !jsonraw.IsNull(v) {
			ms = append(ms, member{k, v})
		}
		return nil
	})
	slices.SortStableFunc(ms, func(a, b member) int { return strings.Compare(a.key, b.key) })
	return ms
}

// canonicalJSON appends v without insignificant whitespace and with every
// string re-encoded in one escaping, so "\u0061" and "a" agree. Object
// members keep their order, as Python dicts (and so chat templates) do;
// numbers keep their spelling.
func canonicalJSON(dst, v []byte) []byte {
	i := 0
	for i < len(v) && isJSONSpace(v[i]) {
		i++
	}
	j := len(v)
	for j > i && isJSONSpace(v[j-1]) {
		j--
	}
	v = v[i:j]
	if len(v) == 0 {
		return dst
	}
	switch v[0] {
	case '"':
		s, ok := jsonraw.String(v)
		if !ok {
			return append(dst, v...)
		}
		return jsonraw.AppendQuote(dst, s)
	case '{':
		dst = append(dst, '{')
		n := 0
		_ = jsonraw.Members(v, func(k string, mv []byte) error {
			if n > 0 {
				dst = append(dst, ',')
			}
			n++
			dst = jsonraw.AppendQuote(dst, k)
			dst = append(dst, ':')
			dst = canonicalJSON(dst, mv)
			return nil
		})
		return append(dst, '}')
	case '[':
		dst = append(dst, '[')
		n := 0
		_ = jsonraw.Elements(v, func(e []byte) error {
			if n > 0 {
				dst = append(dst, ',')
			}
			n++
			dst = canonicalJSON(dst, e)
			return nil
		})
		return append(dst, ']')
	}
	return append(dst, v...)
}

func isJSONSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

// writeField writes a length-prefixed name and value, so no two different
// sequences of fields hash the same input.
func writeField(h *hasher, name string, v []byte) { h.field(name, v) }

// newHasher returns a SHA-256 hasher.
func newHasher() *hasher { return &hasher{h: sha256.New()} }

// fieldString is field for a string value, copied through the hasher's
// scratch space rather than converted.
func (d *hasher) fieldString(name, s string) {
	d.lengthPrefix(name, len(s))
	for len(s) > 0 {
		n := copy(d.tmp[:], s)
		d.Write(d.tmp[:n])
		s = s[n:]
	}
}

// writeDigest writes a 32-byte digest.
func (d *hasher) writeDigest(sum [32]byte) {
	copy(d.tmp[:], sum[:])
	d.Write(d.tmp[:32])
}

// sum returns the digest of what was written to h.
func (d *hasher) sum() [32]byte {
	var s [32]byte
	copy(s[:], d.h.Sum(d.tmp[:0]))
	return s
}

// compact appends v without insignificant whitespace to buf and returns
// buf's bytes, so that formatting does not change a digest. v comes from a
// validated body; should it not be JSON, it is appended as is.
func compact(buf *bytes.Buffer, v []byte) []byte {
	if json.Compact(buf, v) != nil {
		buf.Write(v)
	}
	return buf.Bytes()
}

// chainConversation hashes the tenant, the prompt-shaping fields and every
// message in one pass, calling visit (if not nil) after each message with
// the digest of the conversation up to and including it. It also returns
// the digest chatAnchor keys the conversation's start on: the chain from
// zero over the messages up to and including the first that is not a
// system or developer message, hashed in the same pass.
func chainConversation(req *Request, visit func(cur [32]byte, role string)) ([32]byte, [32]byte, error) {
	msgs, _ := req.Field("messages")
	cur := shapingDigest(req, "chat", chatShaping)
	var start [32]byte
	open := true
	c := req.getChainer()
	defer req.putChainer(c)
	err := jsonraw.Elements(msgs, func(m []byte) error {
		var role string
		var err error
		var anchor *[32]byte
		if open {
			anchor = &start
		}
		if cur, role, err = c.message(cur, m, anchor); err != nil {
			return err
		}
		if role != "system" && role != "developer" {
			open = false
		}
		if visit != nil {
			visit(cur, role)
		}
		return nil
	})
	return cur, start, err
}

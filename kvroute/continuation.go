package kvroute

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"strings"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/convkey"
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
// the conversation hint (conversationHint), if any, otherwise under the
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
	// refused. 0 means 1 MiB.
	MaxReplyBytes int
	// ReasoningCloseTags are the strings that, found in a chat reply's
	// content, mark reasoning served inline (RefuseInlineReasoning). nil
	// means the one tag "</think>" (Qwen3, DeepSeek-R1 and most open
	// reasoning models); an empty, non-nil slice turns the check off.
	ReasoningCloseTags []string
	// ByConversationID keys conversations by a client-chosen id instead
	// of their content: the body field conversation_id, else session_id,
	// else prompt_cache_key, else the X-Session-ID header, scoped by
	// tenant (the proxy's --key-mode conversation-id). Requests with none
	// are never reused.
	//
	// The id only finds a handle; it never vouches for it. A handle
	// retained under an id is verified as by content (by tokens, or by the
	// content rules above when the handle has no token fingerprint), and
	// a turn those rules refuse is retained for token verification only,
	// or not at all (RefuseNoConversationID without an id). Trusting the
	// id alone would let a client send a different prompt under an old id:
	// the prefill engine would pull the old KV as the prefix of the new
	// prompt, answer wrongly, and cache those blocks under the new
	// prompt's token hashes, where every tenant that sends that prompt
	// reads them.
	ByConversationID bool
}

// defaultMaxReplyBytes is ContinuationKeys' default reply bound.
const defaultMaxReplyBytes = 1 << 20

// defaultReasoningCloseTag is ContinuationKeys' default reasoning close
// tag, used by Qwen3, DeepSeek-R1 and most open reasoning models.
const defaultReasoningCloseTag = "</think>"

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
	if c.ByConversationID {
		return c.idLookup(req)
	}
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
	if c.ByConversationID {
		return c.idKey(req, cands, reply)
	}
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
	h := req.keys.Hasher()
	h.WriteDigest(d.chain)
	convkey.WriteReply(h, reply.Content, reply.ToolCalls)
	next := req.keys.SumPut(h)
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
	if req.Path == PathChatCompletions {
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

// refusal returns why the turn must not be retained under content rules,
// and whether the refusal is soft: the key is still computed and returned
// with the refusal, so that the router may retain the turn for token
// verification only.
func (c ContinuationKeys) refusal(req *Request, reply *Reply) (reason Refusal, soft bool) {
	max := c.MaxReplyBytes
	if max <= 0 {
		max = defaultMaxReplyBytes
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
	if req.Path == PathChatCompletions {
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
		return strings.Contains(content, defaultReasoningCloseTag)
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

// shapingDigest hashes the tenant and the prompt-shaping fields present.
func shapingDigest(req *Request, kind string, fields []string) [32]byte {
	h := req.keys.Hasher()
	h.FieldString("v1", kind)
	h.FieldString("tenant", req.Tenant())
	var buf bytes.Buffer
	for _, f := range fields {
		v, ok := req.Field(f)
		if !ok || jsonraw.IsNull(v) {
			continue
		}
		buf.Reset()
		h.Field(f, convkey.Compact(&buf, v))
	}
	return req.keys.SumPut(h)
}

// chainConversation hashes the tenant, the prompt-shaping fields and every
// message in one pass, calling visit (if not nil) after each message with
// the digest of the conversation up to and including it. It also returns
// the digest chatAnchor keys the conversation's start on: the chain from
// zero over the messages up to and including the first that is not a
// system or developer message, hashed in the same pass.
func chainConversation(req *Request, visit func(cur [32]byte, role string)) ([32]byte, [32]byte, error) {
	msgs, _ := req.Field("messages")
	// chat.v2: messages chained by their digests (convkey.Chainer), so
	// that entries keyed by the former chain are never taken for its.
	cur := shapingDigest(req, "chat.v2", chatShaping)
	var start [32]byte
	open := true
	c := req.keys.Chainer()
	defer req.keys.PutChainer(c)
	err := jsonraw.Elements(msgs, func(m []byte) error {
		var role string
		var err error
		var anchor *[32]byte
		if open {
			anchor = &start
		}
		if cur, role, err = c.Message(cur, m, anchor); err != nil {
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

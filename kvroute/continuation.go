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
// is verified to begin with the stored prompt plus the generated text.
//
// Equal meaning hashes equal: content as a string or as text parts; absent,
// null and empty optional fields; echoed assistant fields such as refusal,
// annotations or audio. A finished turn is refused (not retained) when the
// next prompt cannot reproduce the engine's tokens: reasoning output, n
// other than 1, truncate_prompt_tokens, a stop string cut from the reply,
// continue_final_message, echo, a reply that could not be reassembled, or
// one over MaxReplyBytes.
//
// The zero value is ready to use.
type ContinuationKeys struct {
	// MaxReplyBytes bounds the reply that is keyed; a longer one is
	// refused. 0 means DefaultMaxReplyBytes.
	MaxReplyBytes int
}

// DefaultMaxReplyBytes is ContinuationKeys' default reply bound.
const DefaultMaxReplyBytes = 1 << 20

// Refusal reasons reported by ContinuationKeys (TurnRecord.StoreRefusal).
const (
	RefuseReasoning     = "reasoning"
	RefuseN             = "n"
	RefuseTruncate      = "truncate_prompt_tokens"
	RefuseStopString    = "stop_string"
	RefuseContinueFinal = "continue_final_message"
	RefuseEcho          = "echo"
	RefuseIncomplete    = "incomplete_reply"
	RefuseTooLarge      = "reply_too_large"
	RefuseUnkeyable     = "unkeyable_prompt"
)

// Fields that shape the rendered prompt in vLLM's chat and completion
// request models, hashed into every key. Sorted, so the digest does not
// depend on the client's key order.
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

// Lookup implements Identifier.
func (c ContinuationKeys) Lookup(req *Request) ([]string, error) {
	if !req.Chat() {
		return c.completionLookup(req)
	}
	var keys []string
	last := ""
	cur, err := chainConversation(req, func(cur [32]byte, role string) {
		if role == "assistant" {
			keys = append(keys, digestKey("c", cur))
		}
		last = role
	})
	if err != nil {
		return nil, err
	}
	req.chain, req.chained = cur, true // Key extends it with the reply
	// A request whose last message is the stored reply itself sends
	// nothing new: it is no continuation.
	if last == "assistant" && len(keys) > 0 {
		keys = keys[:len(keys)-1]
	}
	slices.Reverse(keys)
	return keys, nil
}

// Key implements Identifier.
func (c ContinuationKeys) Key(req *Request, reply *Reply) (Retention, error) {
	if reason := c.refusal(req, reply); reason != "" {
		return Retention{Refusal: reason}, nil
	}
	if !req.Chat() {
		return c.completionKey(req, reply)
	}
	cur := req.chain
	if !req.chained {
		var err error
		if cur, err = chainConversation(req, nil); err != nil {
			return Retention{}, err
		}
	}
	h := sha256.New()
	h.Write(cur[:])
	writeMessage(h, "assistant", contentText(reply.Content), "", "", reply.ToolCalls, nil)
	var next [32]byte
	h.Sum(next[:0])
	return Retention{Key: digestKey("c", next)}, nil
}

// Verify implements Identifier: chat keys need no check; a completions
// handle is used only if the new prompt begins with the stored text and
// goes on beyond it.
func (c ContinuationKeys) Verify(req *Request, check []byte) bool {
	if req.Chat() || len(check) == 0 {
		return len(check) == 0
	}
	prompt, ok := promptString(req)
	if !ok {
		return false
	}
	n, k := binary.Uvarint(check)
	if k <= 0 || len(check)-k != sha256.Size || uint64(len(prompt)) <= n {
		return false
	}
	sum := sha256.Sum256([]byte(prompt[:n]))
	return bytes.Equal(sum[:], check[k:])
}

func (c ContinuationKeys) refusal(req *Request, reply *Reply) string {
	max := c.MaxReplyBytes
	if max <= 0 {
		max = DefaultMaxReplyBytes
	}
	switch {
	case reply.Reasoning != "":
		return RefuseReasoning
	case reply.Incomplete:
		return RefuseIncomplete
	case len(reply.Content)+len(reply.ToolCalls) > max:
		return RefuseTooLarge
	}
	if v, ok := req.Field("n"); ok && !jsonraw.IsNull(v) {
		if n, ok := jsonraw.Int(v); !ok || n != 1 {
			return RefuseN
		}
	}
	if v, ok := req.Field("truncate_prompt_tokens"); ok && !jsonraw.IsNull(v) {
		return RefuseTruncate
	}
	if v, ok := req.Field("continue_final_message"); ok {
		if b, _ := jsonraw.Bool(v); b {
			return RefuseContinueFinal
		}
	}
	if v, ok := req.Field("echo"); ok {
		if b, _ := jsonraw.Bool(v); b {
			return RefuseEcho
		}
	}
	if reply.FinishReason == "stop" && hasStopStrings(req) && !stopStringKept(req) && !stopByToken(reply.StopReason) {
		return RefuseStopString
	}
	return ""
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
	b, _ := jsonraw.Bool(v)
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

// Completions: the anchor is the hint, else the prompt's leading bytes.
const maxAnchor = 1024

func (c ContinuationKeys) completionLookup(req *Request) ([]string, error) {
	prompt, ok := promptString(req)
	if !ok {
		return nil, nil
	}
	base := shapingDigest(req, "completion", completionShaping)
	if hint := ConversationHint(req); hint != "" {
		return []string{anchorKey(base, "hint", hint)}, nil
	}
	var keys []string
	for a := maxAnchor; a >= minAnchor; a /= 2 {
		if a < len(prompt) {
			keys = append(keys, anchorKey(base, "prefix", prompt[:a]))
		}
	}
	return keys, nil
}

const minAnchor = 16

func (c ContinuationKeys) completionKey(req *Request, reply *Reply) (Retention, error) {
	prompt, ok := promptString(req)
	if !ok {
		return Retention{Refusal: RefuseUnkeyable}, nil
	}
	text := prompt + reply.Content
	base := shapingDigest(req, "completion", completionShaping)
	var key string
	if hint := ConversationHint(req); hint != "" {
		key = anchorKey(base, "hint", hint)
	} else {
		a := maxAnchor
		for a > len(text) {
			a /= 2
		}
		if a < minAnchor {
			return Retention{Refusal: RefuseUnkeyable}, nil
		}
		key = anchorKey(base, "prefix", text[:a])
	}
	sum := sha256.Sum256([]byte(text))
	check := binary.AppendUvarint(nil, uint64(len(text)))
	return Retention{Key: key, Check: append(check, sum[:]...)}, nil
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

func anchorKey(base [32]byte, kind, s string) string {
	h := sha256.New()
	h.Write(base[:])
	writeField(h, kind, []byte(s))
	var sum [32]byte
	h.Sum(sum[:0])
	return digestKey("p", sum)
}

func digestKey(prefix string, sum [32]byte) string {
	return prefix + ":" + hex.EncodeToString(sum[:])
}

// shapingDigest hashes the tenant and the prompt-shaping fields present.
func shapingDigest(req *Request, kind string, fields []string) [32]byte {
	h := sha256.New()
	writeField(h, "v1", []byte(kind))
	writeField(h, "tenant", []byte(req.Tenant()))
	var buf bytes.Buffer
	for _, f := range fields {
		v, ok := req.Field(f)
		if !ok || jsonraw.IsNull(v) {
			continue
		}
		buf.Reset()
		writeField(h, f, compact(&buf, v))
	}
	var sum [32]byte
	h.Sum(sum[:0])
	return sum
}

// chainMessage returns sha256(prev || canonical(m)) and m's role.
func chainMessage(prev [32]byte, m []byte) ([32]byte, string, error) {
	var (
		role, name, toolCallID string
		content                []byte
		toolCalls              []byte
		extra                  [][2][]byte
	)
	err := jsonraw.Members(m, func(k string, v []byte) error {
		switch k {
		case "role":
			role, _ = jsonraw.String(v)
		case "content":
			content = v
		case "name":
			name, _ = jsonraw.String(v)
		case "tool_call_id":
			toolCallID, _ = jsonraw.String(v)
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
	if err != nil {
		return prev, "", err
	}
	h := sha256.New()
	h.Write(prev[:])
	slices.SortFunc(extra, func(a, b [2][]byte) int { return bytes.Compare(a[0], b[0]) })
	writeMessage(h, role, canonicalContent(content), name, toolCallID, toolCalls, extra)
	var sum [32]byte
	h.Sum(sum[:0])
	return sum, role, nil
}

func isEmptyString(v []byte) bool { return len(v) == 2 && v[0] == '"' && v[1] == '"' }

// canonicalContent maps content to one form: a string and a list of text
// parts (joined with newlines, as vLLM does for string-format templates)
// give the text tagged "t"; null and absent give the empty text; anything
// else (images, audio) gives its compacted JSON tagged "j".
func canonicalContent(v []byte) []byte {
	if len(v) == 0 || jsonraw.IsNull(v) {
		return contentText("")
	}
	if s, ok := jsonraw.String(v); ok {
		return contentText(s)
	}
	if v[0] == '[' {
		var parts []string
		allText := true
		_ = jsonraw.Elements(v, func(p []byte) error {
			var typ, text string
			hasText := false
			other := false
			_ = jsonraw.Members(p, func(k string, pv []byte) error {
				switch k {
				case "type":
					typ, _ = jsonraw.String(pv)
				case "text":
					text, hasText = jsonraw.String(pv)
				default:
					if !jsonraw.IsNull(pv) {
						other = true
					}
				}
				return nil
			})
			if typ != "text" || !hasText || other {
				allText = false
				return errStop
			}
			parts = append(parts, text)
			return nil
		})
		if allText {
			return contentText(strings.Join(parts, "\n"))
		}
	}
	var buf bytes.Buffer
	buf.WriteByte('j')
	return compact(&buf, v)
}

func contentText(s string) []byte {
	b := make([]byte, 0, len(s)+1)
	b = append(b, 't')
	return append(b, s...)
}

// writeMessage hashes one message in canonical form.
func writeMessage(h hash.Hash, role string, content []byte, name, toolCallID string, toolCalls []byte, extra [][2][]byte) {
	writeField(h, "role", []byte(role))
	writeField(h, "content", content)
	writeField(h, "name", []byte(name))
	writeField(h, "tool_call_id", []byte(toolCallID))
	writeToolCalls(h, toolCalls)
	var buf bytes.Buffer
	for _, e := range extra {
		buf.Reset()
		writeField(h, "x:"+string(e[0]), compact(&buf, e[1]))
	}
	h.Write([]byte{0xff}) // end of message
}

// writeToolCalls hashes tool calls as id, type, function name and
// arguments; null and [] hash like none.
func writeToolCalls(h hash.Hash, v []byte) {
	if len(v) == 0 || jsonraw.IsNull(v) {
		return
	}
	_ = jsonraw.Elements(v, func(call []byte) error {
		var id, typ, name, args string
		_ = jsonraw.Members(call, func(k string, cv []byte) error {
			switch k {
			case "id":
				id, _ = jsonraw.String(cv)
			case "type":
				typ, _ = jsonraw.String(cv)
			case "function":
				_ = jsonraw.Members(cv, func(fk string, fv []byte) error {
					switch fk {
					case "name":
						name, _ = jsonraw.String(fv)
					case "arguments":
						args, _ = jsonraw.String(fv)
					}
					return nil
				})
			}
			return nil
		})
		if typ == "" {
			typ = "function"
		}
		writeField(h, "call.id", []byte(id))
		writeField(h, "call.type", []byte(typ))
		writeField(h, "call.name", []byte(name))
		writeField(h, "call.args", []byte(args))
		return nil
	})
}

// writeField writes a length-prefixed name and value, so no two different
// sequences of fields hash the same input.
func writeField(h hash.Hash, name string, v []byte) {
	var n [binary.MaxVarintLen64]byte
	h.Write(n[:binary.PutUvarint(n[:], uint64(len(name)))])
	h.Write([]byte(name))
	h.Write(n[:binary.PutUvarint(n[:], uint64(len(v)))])
	h.Write(v)
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
// the digest of the conversation up to and including it.
func chainConversation(req *Request, visit func(cur [32]byte, role string)) ([32]byte, error) {
	msgs, _ := req.Field("messages")
	cur := shapingDigest(req, "chat", chatShaping)
	err := jsonraw.Elements(msgs, func(m []byte) error {
		var role string
		var err error
		if cur, role, err = chainMessage(cur, m); err != nil {
			return err
		}
		if visit != nil {
			visit(cur, role)
		}
		return nil
	})
	return cur, err
}

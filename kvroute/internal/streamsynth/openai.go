package streamsynth

import (
	"fmt"
	"strconv"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// head is what every chunk of an OpenAI stream repeats from the answer,
// and what its last chunks carry, raw; nil when the answer has none.
type head struct {
	object                        string // the chunks' object
	id, created, model            []byte
	fingerprint, usage, promptIDs []byte
	promptTokens                  []byte // usage.prompt_tokens
}

// readHead reads the members the chunks repeat. Absent and null members
// stay nil; a created that is not a number or an id or model that is not
// a string is ErrMalformed.
func readHead(obj jsonraw.Object, object string) (head, error) {
	h := head{object: object}
	get := func(key string) []byte {
		v, ok := obj.Get(key)
		if !ok || jsonraw.IsNull(v) {
			return nil
		}
		return v
	}
	h.id, h.created, h.model = get("id"), get("created"), get("model")
	h.fingerprint, h.usage, h.promptIDs = get("system_fingerprint"), get("usage"), get("prompt_token_ids")
	for _, s := range [...]struct {
		name string
		v    []byte
	}{{"id", h.id}, {"model", h.model}, {"system_fingerprint", h.fingerprint}} {
		if s.v != nil && s.v[0] != '"' {
			return head{}, fmt.Errorf("%w: %s is not a string", ErrMalformed, s.name)
		}
	}
	if h.created != nil && !isNumber(h.created) {
		return head{}, fmt.Errorf("%w: created is not a number", ErrMalformed)
	}
	if h.usage != nil {
		if h.usage[0] != '{' {
			return head{}, fmt.Errorf("%w: usage is not an object", ErrMalformed)
		}
		if v, ok := jsonraw.Lookup(h.usage, "prompt_tokens"); ok && isNumber(v) {
			h.promptTokens = v
		}
	}
	return h, nil
}

// open writes the start of a chunk: "data: {" and the repeated members,
// up to the choices array's opening bracket.
func (h *head) open(o out) {
	o.s(`data: {`)
	if h.id != nil {
		o.s(`"id":`)
		o.raw(h.id)
		o.s(`,`)
	}
	o.s(`"object":"`)
	o.s(h.object)
	o.s(`"`)
	if h.created != nil {
		o.s(`,"created":`)
		o.raw(h.created)
	}
	if h.model != nil {
		o.s(`,"model":`)
		o.raw(h.model)
	}
	o.s(`,"choices":[`)
}

// close ends a chunk after its choices: continuous usage (prompt only on
// a choice's first chunk), the fingerprint when asked, the prompt's token
// ids when asked.
func (h *head) close(o out, opt Options, first, fingerprint, promptIDs bool) {
	o.s(`]`)
	if opt.ContinuousUsage && h.usage != nil {
		if first && h.promptTokens != nil {
			o.s(`,"usage":{"prompt_tokens":`)
			o.raw(h.promptTokens)
			o.s(`,"total_tokens":`)
			o.raw(h.promptTokens)
			o.s(`,"completion_tokens":0}`)
		} else if !first {
			o.s(`,"usage":`)
			o.raw(h.usage)
		}
	}
	if fingerprint && h.fingerprint != nil {
		o.s(`,"system_fingerprint":`)
		o.raw(h.fingerprint)
	}
	if promptIDs && h.promptIDs != nil {
		o.s(`,"prompt_token_ids":`)
		o.raw(h.promptIDs)
	}
	o.s("}\n\n")
}

// usageChunk reports whether the stream ends with a usage chunk, which
// then carries the fingerprint (else the finish chunks do, as in vLLM).
func (h *head) usageChunk(opt Options) bool { return opt.IncludeUsage && h.usage != nil }

// end writes the usage chunk when it is asked for ("choices": [], the
// answer's usage and fingerprint), then data: [DONE].
func (h *head) end(o out, opt Options) {
	if h.usageChunk(opt) {
		h.open(o)
		o.s(`],"usage":`)
		o.raw(h.usage)
		if h.fingerprint != nil {
			o.s(`,"system_fingerprint":`)
			o.raw(h.fingerprint)
		}
		o.s("}\n\n")
	}
	o.s("data: [DONE]\n\n")
}

// choiceIndex writes a choice's index: its own, or its position.
func choiceIndex(o out, raw []byte, pos int) {
	if raw != nil {
		o.raw(raw)
		return
	}
	_, _ = o.w.Write(strconv.AppendInt(o.w.AvailableBuffer(), int64(pos), 10))
}

// finishReason writes a choice's finish_reason: its own, or "stop" when it
// has none, as vLLM's streams do.
func finishReason(o out, raw []byte) { o.rawOr(raw, `"stop"`) }

// checks on raw values of a validated document.
func isNumber(v []byte) bool { return len(v) > 0 && (v[0] == '-' || (v[0] >= '0' && v[0] <= '9')) }
func isText(v []byte) bool   { return v == nil || jsonraw.IsNull(v) || v[0] == '"' }

// present reports whether v is there and not null.
func present(v []byte) bool { return v != nil && !jsonraw.IsNull(v) }

// choices returns the answer's choices array.
func choicesOf(obj jsonraw.Object) ([]byte, error) {
	v, ok := obj.Get("choices")
	if !ok || len(v) == 0 || v[0] != '[' {
		return nil, fmt.Errorf("%w: choices is not an array", ErrMalformed)
	}
	return v, nil
}

// indexOf validates a choice's index: absent, or an integer from 0.
func indexOf(v []byte) ([]byte, error) {
	if v == nil {
		return nil, nil
	}
	if n, ok := jsonraw.Int(v); !ok || n < 0 {
		return nil, fmt.Errorf("%w: a choice's index is not an integer from 0", ErrMalformed)
	}
	return v, nil
}

// uniqueIndex checks that the choice at position pos, whose index is raw
// (its position when nil), has an index no earlier choice has: a client
// merges the chunks of one index into one choice.
func uniqueIndex(raw []byte, pos int, indexAt func(int) []byte) error {
	effective := func(raw []byte, pos int) int64 {
		if raw == nil {
			return int64(pos)
		}
		n, _ := jsonraw.Int(raw)
		return n
	}
	n := effective(raw, pos)
	for i := range pos {
		if effective(indexAt(i), i) == n {
			return fmt.Errorf("%w: two choices with index %d", ErrMalformed, n)
		}
	}
	return nil
}

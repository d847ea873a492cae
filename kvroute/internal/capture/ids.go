package capture

import (
	"bytes"
	"slices"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/sse"
)

// The members in which vLLM returns token ids when a request sets
// return_token_ids (vLLM PR #22587): prompt_token_ids at the top level of a
// chat response (or its first stream chunk) and in each completions choice,
// token_ids in each choice.
const (
	PromptTokenIDsKey = "prompt_token_ids"
	TokenIDsKey       = "token_ids"
)

// WithTokenIDs makes the Chunks collect the token ids of choice 0: the
// prompt's (prompt_token_ids, top level or in the choice) and the generated
// ones (the choice's token_ids, concatenated over the stream's chunks), for
// Chunks.PromptTokenIDs and Chunks.TokenIDs. With strip, Forward also
// removes those members from every event, so that a client that did not ask
// for token ids never sees them.
func WithTokenIDs(strip bool) Option {
	return optionFunc(func(c *Chunks) { c.tokens, c.stripTokens = true, strip })
}

// UseIDBuffer makes the Chunks parse the prompt's token ids into buf
// (from buf[:0]; a larger slice is allocated when they do not fit), so a
// caller can reuse one slice across streams; PromptTokenIDs then returns
// buf's array. It has no effect once the prompt's ids were seen.
func (c *Chunks) UseIDBuffer(buf []uint32) {
	if !c.sawPromptIDs {
		c.promptIDs = buf[:0]
	}
}

// ExpectPromptIDs gives the Chunks the prompt's token ids the caller
// already has (ids) with the JSON text they were converted from (raw: an
// array of ids as a render answer spells it, from '[' to ']', which the
// caller has validated and converted to ids in full, for example with
// AppendTokenIDs). When the stream's first data event carries a
// prompt_token_ids (top level, or in choice 0) whose value is byte for
// byte raw, the value is not read again: PromptTokenIDs then returns ids
// itself, not a copy, and PromptIDsExpected reports it. Any other value
// (one id or one space different) is parsed as without this call. The
// Chunks keeps raw and ids only until that first data event: the caller
// must leave raw unchanged until Forward has returned for an event with
// data (or the Chunks is no longer used), and ids unchanged while it uses
// PromptTokenIDs. It has no effect once the prompt's ids were seen,
// without WithTokenIDs, or for no ids.
func (c *Chunks) ExpectPromptIDs(raw []byte, ids []uint32) {
	if !c.sawPromptIDs && c.tokens && len(ids) > 0 {
		c.knownRaw, c.knownIDs = raw, ids
	}
}

// PromptIDsExpected reports whether the prompt's token ids were those given
// to ExpectPromptIDs, taken without being parsed.
func (c *Chunks) PromptIDsExpected() bool { return c.knownUsed && c.sawPromptIDs }

// PromptTokenIDs returns the prompt's token ids seen so far (nil when the
// engine sent none). Only a Chunks made WithTokenIDs collects them.
func (c *Chunks) PromptTokenIDs() []uint32 {
	if !c.sawPromptIDs {
		return nil
	}
	return c.promptIDs
}

// TokenIDs returns choice 0's generated token ids seen so far, in order.
func (c *Chunks) TokenIDs() []uint32 { return c.genIDs }

// HasTokenIDs reports whether the engine sent both the prompt's and the
// generated token ids.
func (c *Chunks) HasTokenIDs() bool { return c.sawPromptIDs && c.sawGenIDs && !c.badIDs }

// mayHoldTokenIDs is the cheap test for a token-id member (see
// MayHoldHandle for the escape rule).
func mayHoldTokenIDs(d []byte) bool {
	return bytes.Contains(d, []byte(TokenIDsKey)) || bytes.Contains(d, []byte(`\u`))
}

// AppendTokenIDs appends the ids of a JSON array of non-negative integers
// below 2^32 to dst; ok is false (and dst is returned unchanged) for any
// other value.
func AppendTokenIDs(dst []uint32, arr []byte) ([]uint32, bool) {
	n := len(dst)
	if cap(dst)-n < len(arr)/2 {
		// At most one id per two bytes ("1,"): grow once, by the count.
		dst = slices.Grow(dst, bytes.Count(arr, []byte{','})+1)
	}
	out, end, ok := jsonraw.AppendUint32s(dst, arr, 0)
	if !ok || skipIDSpace(arr, end) != len(arr) {
		return dst[:n], false
	}
	return out, true
}

// skipIDSpace returns the index of the first byte at or after i that is
// not JSON whitespace.
func skipIDSpace(arr []byte, i int) int {
	for i < len(arr) && (arr[i] == ' ' || arr[i] == '\n' || arr[i] == '\r' || arr[i] == '\t') {
		i++
	}
	return i
}

// promptIDsParsed records the prompt_token_ids value that
// jsonraw.Object.ResetIDs converted while it validated the event.
func (c *Chunks) promptIDsParsed(ids []uint32) {
	c.promptIDs, c.sawPromptIDs = ids, true
}

// addPromptIDs records a prompt_token_ids value.
func (c *Chunks) addPromptIDs(v []byte) {
	if jsonraw.IsNull(v) {
		return
	}
	if c.knownRaw != nil && bytes.Equal(v, c.knownRaw) {
		c.takeKnown()
		return
	}
	buf := c.promptIDs
	if c.knownUsed {
		buf = c.spare // never into the caller's ids
	}
	ids, ok := AppendTokenIDs(buf[:0], v)
	if !ok {
		c.badIDs = true
		return
	}
	c.promptIDs, c.sawPromptIDs, c.knownUsed = ids, true, false
}

// takeKnown records the expected prompt ids as the prompt's, keeping the
// Chunks's own slice for a later value.
func (c *Chunks) takeKnown() {
	if !c.knownUsed {
		c.spare = c.promptIDs[:0]
	}
	c.promptIDs, c.sawPromptIDs, c.knownUsed = c.knownIDs, true, true
}

// addGenIDs appends a choice's token_ids value.
func (c *Chunks) addGenIDs(v []byte) {
	if jsonraw.IsNull(v) {
		return
	}
	ids, ok := AppendTokenIDs(c.genIDs, v)
	if !ok {
		c.badIDs = true
		return
	}
	c.genIDs, c.sawGenIDs = ids, true
}

// StripTokenIDs returns the JSON object data without prompt_token_ids at
// the top level and without prompt_token_ids and token_ids in the elements
// of its choices array. It returns data itself when there is nothing to
// remove, and an error when data is not a JSON object.
func StripTokenIDs(data []byte) ([]byte, error) {
	obj, err := jsonraw.Parse(data)
	if err != nil {
		return nil, err
	}
	var s stripScratch
	return s.strip(obj, false), nil
}

var (
	topTokenKeys    = []string{PromptTokenIDsKey}
	topAllKeys      = []string{sse.HandleKey, PromptTokenIDsKey}
	choiceTokenKeys = []string{PromptTokenIDsKey, TokenIDsKey}
)

// stripScratch holds the buffers of stripping token ids from one event
// after another (a Chunks's): what strip returns is valid until its next
// call.
type stripScratch struct {
	out, choices []byte
	elem         jsonraw.Object // one element of choices, its index reused
	set          [1]jsonraw.Member
}

// strip removes the token-id members from a parsed object, and the handle
// too when dropHandle is set. It returns obj's bytes when nothing changes.
func (s *stripScratch) strip(obj jsonraw.Object, dropHandle bool) []byte {
	set := s.set[:0]
	if choices, ok := obj.Get("choices"); ok && mayHoldTokenIDs(choices) {
		if edited, changed := s.stripChoices(choices); changed {
			set = append(set, jsonraw.Member{Key: "choices", Value: edited})
		}
	}
	del := topTokenKeys
	if dropHandle {
		del = topAllKeys
	}
	out, changed := obj.AppendEdit(s.out[:0], del, set...)
	s.set[0] = jsonraw.Member{} // holds no event bytes once done
	if !changed {
		return obj.Bytes()
	}
	s.out = out
	return out
}

// stripChoices rewrites a choices array without the token-id members of
// its elements, into s.choices.
func (s *stripScratch) stripChoices(arr []byte) ([]byte, bool) {
	out := append(slices.Grow(s.choices[:0], len(arr)), '[')
	changed := false
	n := 0
	err := jsonraw.Elements(arr, func(v []byte) error {
		if n > 0 {
			out = append(out, ',')
		}
		n++
		if err := s.elem.Reset(v); err != nil {
			out = append(out, v...)
			return nil
		}
		var ch bool
		out, ch = s.elem.AppendEdit(out, choiceTokenKeys)
		changed = changed || ch
		return nil
	})
	_ = s.elem.Reset(nil) // keeps its index's room, not the event's bytes
	s.choices = out
	if err != nil || !changed {
		return arr, false
	}
	out = append(out, ']')
	s.choices = out
	return out, true
}

package capture

import (
	"bytes"
	"slices"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/sse"
)

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

// mayHoldTokenIDs is the cheap test for a token-id member (see
// sse.MayHoldHandle for the escape rule).
func mayHoldTokenIDs(d []byte) bool {
	return bytes.Contains(d, []byte(TokenIDsKey)) || bytes.Contains(d, []byte(`\u`))
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

package capture

import (
	"bytes"
	"slices"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// The members in which vLLM returns token ids when a request sets
// return_token_ids (vLLM PR #22587): prompt_token_ids at the top level of a
// chat response (or its first stream chunk) and in each completions choice,
// token_ids in each choice.
const (
	PromptTokenIDsKey = "prompt_token_ids"
	TokenIDsKey       = "token_ids"
)

// tokenIDs collects the token ids of a chunk stream's choice 0 for a
// Chunks made WithTokenIDs. It owns the prompt's ids (parsed into the
// caller's buffer or its own slice, or the caller's own ids taken without
// being read), the generated ids concatenated over the chunks, whether
// each was seen and whether any could not be read, and the caller's
// expectation (Chunks.ExpectPromptIDs) until the stream's first data.
type tokenIDs struct {
	on                bool // WithTokenIDs: collect
	prompt, gen       []uint32
	sawPrompt, sawGen bool
	bad               bool
	// knownRaw and knownIDs (ExpectPromptIDs): the prompt's ids the
	// caller already has and their JSON text, until the first data event;
	// knownUsed records that the stream's prompt ids were taken as them,
	// and spare keeps the collection's own slice meanwhile.
	knownRaw  []byte
	knownIDs  []uint32
	knownUsed bool
	spare     []uint32
}

// useBuffer makes the prompt's ids be parsed into buf (see
// Chunks.UseIDBuffer).
func (t *tokenIDs) useBuffer(buf []uint32) {
	if !t.sawPrompt {
		t.prompt = buf[:0]
	}
}

// expect keeps the caller's prompt ids and their text (see
// Chunks.ExpectPromptIDs).
func (t *tokenIDs) expect(raw []byte, ids []uint32) {
	if !t.sawPrompt && t.on && len(ids) > 0 {
		t.knownRaw, t.knownIDs = raw, ids
	}
}

// expected reports whether the prompt's ids are the caller's, taken
// without being parsed.
func (t *tokenIDs) expected() bool { return t.knownUsed && t.sawPrompt }

// ids returns the prompt's ids (nil when none was seen), the generated
// ids, and whether both were sent and readable.
func (t *tokenIDs) ids() (prompt, generated []uint32, ok bool) {
	if t.sawPrompt {
		prompt = t.prompt
	}
	return prompt, t.gen, t.sawPrompt && t.sawGen && !t.bad
}

// reset validates and indexes a data event into obj while the prompt's ids
// are still to be seen, converting a top-level prompt_token_ids in the same
// pass or, when its text is the caller's expected text, not reading it at
// all. member is the index of that member (-1 when there is none), whose
// ids go to parsed.
func (t *tokenIDs) reset(obj *jsonraw.Object, d []byte) (ids []uint32, member int, err error) {
	ids, member, same, err := obj.ResetIDsKnown(d, PromptTokenIDsKey, t.prompt, t.knownRaw)
	switch {
	case same:
		t.takeKnown()
		ids = t.knownIDs
	case member < 0:
		t.prompt = ids[:0] // scratch; kept for its room
	}
	return ids, member, err
}

// parsed records the prompt_token_ids value that reset converted while it
// validated the event.
func (t *tokenIDs) parsed(ids []uint32) {
	t.prompt, t.sawPrompt = ids, true
}

// dataSeen forgets the caller's expectation: its text is compared with
// the first data only.
func (t *tokenIDs) dataSeen() {
	t.knownRaw, t.knownIDs = nil, nil
}

// addPrompt records a prompt_token_ids value.
func (t *tokenIDs) addPrompt(v []byte) {
	if jsonraw.IsNull(v) {
		return
	}
	if t.knownRaw != nil && bytes.Equal(v, t.knownRaw) {
		t.takeKnown()
		return
	}
	buf := t.prompt
	switch {
	case t.knownUsed:
		buf = t.spare // never into the caller's ids
	case t.sawPrompt:
		// A second prompt_token_ids (hostile: vLLM sends one): parsed
		// apart, so that a value that fails to parse leaves the first
		// one's ids as they were.
		buf = nil
	}
	ids, ok := AppendTokenIDs(buf[:0], v)
	if !ok {
		t.bad = true
		return
	}
	t.prompt, t.sawPrompt, t.knownUsed = ids, true, false
}

// takeKnown records the expected prompt ids as the prompt's, keeping the
// collection's own slice for a later value.
func (t *tokenIDs) takeKnown() {
	if !t.knownUsed {
		t.spare = t.prompt[:0]
	}
	t.prompt, t.sawPrompt, t.knownUsed = t.knownIDs, true, true
}

// addGen appends a choice's token_ids value.
func (t *tokenIDs) addGen(v []byte) {
	if jsonraw.IsNull(v) {
		return
	}
	ids, ok := AppendTokenIDs(t.gen, v)
	if !ok {
		t.bad = true
		return
	}
	t.gen, t.sawGen = ids, true
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

package capture

import (
	"cmp"
	"slices"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// Reply is what the engine answered for choice 0: the assistant message
// of a chat completion, the text of a completion, or the output of the
// Responses and Messages APIs, whether it came in one body or reassembled
// from a stream's chunks. kvroute.Reply is the same type.
type Reply struct {
	// Content is the assistant message content: the concatenated
	// delta.content of chat chunks, or text of completions chunks.
	Content string
	// Reasoning is the concatenated delta.reasoning (or, from engines that
	// use the older name, delta.reasoning_content).
	Reasoning string
	// ToolCalls is a JSON array of the tool calls in the shape of an OpenAI
	// assistant message's tool_calls ({"id", "type", "function": {"name",
	// "arguments"}}), ordered by index; nil when there were none.
	ToolCalls []byte
	// FinishReason is the last non-null finish_reason of choice 0.
	FinishReason string
	// StopReason is vLLM's stop_reason of choice 0 as raw JSON (null for
	// end of sequence, a number for a stop token, a string for a stop
	// string), nil when the engine sent none.
	StopReason []byte
	// Incomplete reports that tool-call fragments could not be reassembled:
	// a fragment without an index, or a call without an id or a name.
	Incomplete bool
}

// assembler reassembles the Reply of a chunk stream's choice 0. It owns
// the last non-null finish and stop reasons (always kept) and, for a
// Chunks made WithReply, the fragments: content, reasoning and tool calls
// merged by index.
type assembler struct {
	fragments bool // WithReply: keep content, reasoning and tool calls
	finish    string
	stop      []byte

	content    []byte
	reasoning  []byte
	calls      []toolCall
	incomplete bool
}

// choice records choice 0's members of one chunk (raw JSON values, nil
// when absent): delta of a chat chunk, text of a completions chunk, and
// the finish and stop reasons.
func (a *assembler) choice(delta, text, finish, stop []byte) {
	if finish != nil && !jsonraw.IsNull(finish) {
		a.finish = finishReason(finish)
		a.stop = append(a.stop[:0], stop...)
		if stop == nil {
			a.stop = nil
		}
	}
	if a.fragments {
		a.add(delta, text)
	}
}

// reply returns the reply reassembled so far.
func (a *assembler) reply() *Reply {
	r := &Reply{
		Content:      string(a.content),
		Reasoning:    string(a.reasoning),
		FinishReason: a.finish,
		StopReason:   a.stop,
		Incomplete:   a.incomplete,
	}
	if len(a.calls) > 0 {
		var incomplete bool
		r.ToolCalls, incomplete = a.toolCalls()
		r.Incomplete = r.Incomplete || incomplete
	}
	return r
}

// toolCall is one tool call, merged from the fragments with its index.
type toolCall struct {
	index     int64
	id        []byte
	typ       []byte
	name      []byte
	arguments []byte
}

// add records the delta of a chat chunk or the text of a completions chunk
// (raw JSON values, nil when absent).
func (a *assembler) add(delta, text []byte) {
	if text != nil {
		a.content, _ = jsonraw.AppendString(a.content, text)
	}
	if delta == nil {
		return
	}
	var content, reasoning, reasoningContent, calls []byte
	_ = jsonraw.Members(delta, func(key string, v []byte) error {
		switch key {
		case "content":
			content = v
		case "reasoning":
			reasoning = v
		case "reasoning_content":
			reasoningContent = v
		case "tool_calls":
			calls = v
		}
		return nil
	})
	a.content, _ = jsonraw.AppendString(a.content, content)
	// Engines in transition send both names with the same text: take one.
	if _, ok := jsonraw.String(reasoning); !ok {
		reasoning = reasoningContent
	}
	a.reasoning, _ = jsonraw.AppendString(a.reasoning, reasoning)
	if calls != nil && !jsonraw.IsNull(calls) {
		_ = jsonraw.Elements(calls, a.toolCallFragment)
	}
}

// toolCallFragment merges one element of delta.tool_calls.
func (a *assembler) toolCallFragment(frag []byte) error {
	var index, id, typ, function []byte
	_ = jsonraw.Members(frag, func(key string, v []byte) error {
		switch key {
		case "index":
			index = v
		case "id":
			id = v
		case "type":
			typ = v
		case "function":
			function = v
		}
		return nil
	})
	n, ok := jsonraw.Int(index)
	var tc *toolCall
	switch {
	case ok:
		for i := range a.calls {
			if a.calls[i].index == n {
				tc = &a.calls[i]
				break
			}
		}
		if tc == nil {
			a.calls = append(a.calls, toolCall{index: n})
			tc = &a.calls[len(a.calls)-1]
		}
	default:
		// Without an index the fragment cannot be placed with certainty.
		a.incomplete = true
		if len(a.calls) == 0 {
			a.calls = append(a.calls, toolCall{})
		}
		tc = &a.calls[len(a.calls)-1]
	}
	setOnce(&tc.id, id)
	setOnce(&tc.typ, typ)
	if function != nil {
		_ = jsonraw.Members(function, func(key string, v []byte) error {
			switch key {
			case "name":
				setOnce(&tc.name, v)
			case "arguments":
				tc.arguments, _ = jsonraw.AppendString(tc.arguments, v)
			}
			return nil
		})
	}
	return nil
}

// setOnce stores the decoded string v in *dst unless *dst is already set or
// v is not a non-empty string.
func setOnce(dst *[]byte, v []byte) {
	if len(*dst) > 0 {
		return
	}
	*dst, _ = jsonraw.AppendString((*dst)[:0], v)
}

// toolCalls returns the calls as a JSON array and whether any lacks an id
// or a name.
func (a *assembler) toolCalls() ([]byte, bool) {
	calls := slices.Clone(a.calls)
	slices.SortStableFunc(calls, func(x, y toolCall) int { return cmp.Compare(x.index, y.index) })
	incomplete := false
	out := []byte{'['}
	for i, tc := range calls {
		if len(tc.id) == 0 || len(tc.name) == 0 {
			incomplete = true
		}
		typ := string(tc.typ)
		if typ == "" {
			typ = "function"
		}
		if i > 0 {
			out = append(out, ',')
		}
		out = append(out, `{"id":`...)
		out = jsonraw.AppendQuote(out, string(tc.id))
		out = append(out, `,"type":`...)
		out = jsonraw.AppendQuote(out, typ)
		out = append(out, `,"function":{"name":`...)
		out = jsonraw.AppendQuote(out, string(tc.name))
		out = append(out, `,"arguments":`...)
		out = jsonraw.AppendQuote(out, string(tc.arguments))
		out = append(out, "}}"...)
	}
	return append(out, ']'), incomplete
}

// finishReason decodes a finish_reason without allocating for the values
// vLLM uses.
func finishReason(v []byte) string {
	switch string(v) {
	case `"stop"`:
		return "stop"
	case `"length"`:
		return "length"
	case `"tool_calls"`:
		return "tool_calls"
	case `"abort"`:
		return "abort"
	case `"error"`:
		return "error"
	}
	s, _ := jsonraw.String(v)
	return s
}

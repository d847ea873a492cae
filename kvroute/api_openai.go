package kvroute

import (
	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/capture"
)

// What the OpenAI-shaped APIs share: reading choice 0 of an answer, and
// building bodies from a request's members.

// choiceZero returns choice 0 of an OpenAI answer's choices, or nil.
func choiceZero(obj jsonraw.Object) []byte {
	choices, _ := obj.Get("choices")
	var c []byte
	_ = jsonraw.Elements(choices, func(v []byte) error { c = v; return errStop })
	if len(c) == 0 || c[0] != '{' {
		return nil
	}
	return c
}

// finishOf fills the finish and stop reasons of an OpenAI choice.
func finishOf(rep *Reply, c []byte) {
	if v, ok := jsonraw.Lookup(c, "finish_reason"); ok {
		rep.FinishReason, _ = jsonraw.String(v)
	}
	if v, ok := jsonraw.Lookup(c, "stop_reason"); ok {
		rep.StopReason = append([]byte(nil), v...)
	}
}

// pickMembers builds a JSON object of the request's members named in
// fields, in that order.
func pickMembers(req *Request, fields []string) []byte {
	set := make([]jsonraw.Member, 0, len(fields))
	for _, f := range fields {
		if v, ok := req.Field(f); ok {
			set = append(set, jsonraw.Member{Key: f, Value: v})
		}
	}
	return (jsonraw.Object{}).Edit(nil, set...)
}

// objectArray checks that member key is a non-empty array of objects.
func objectArray(obj jsonraw.Object, key string) error {
	v, ok := obj.Get(key)
	if !ok || len(v) == 0 || v[0] != '[' {
		return badRequest("%s must be a non-empty array", key)
	}
	n := 0
	if err := jsonraw.Elements(v, func(m []byte) error {
		if len(m) == 0 || m[0] != '{' {
			return badRequest("%s[%d] must be an object", key, n)
		}
		n++
		return nil
	}); err != nil {
		return err
	}
	if n == 0 {
		return badRequest("%s must be a non-empty array", key)
	}
	return nil
}

// choiceReply starts the reply of an OpenAI answer from its choice 0: the
// finish and stop reasons, and the choice itself (nil, with the reply
// marked incomplete, when there is none).
func choiceReply(obj jsonraw.Object) (*Reply, []byte) {
	rep := &Reply{}
	c := choiceZero(obj)
	if c == nil {
		rep.Incomplete = true
		return rep, nil
	}
	finishOf(rep, c)
	return rep, c
}

// chatAPI is POST /v1/chat/completions.
var chatAPI = &api{
	code:          1,
	kind:          twoLegs,
	path:          PathChatCompletions,
	prefillSet:    oneTokenLeg,
	prefillDrop:   openAIPrefillDrop,
	render:        PathChatCompletions + "/render",
	tokenIDs:      true,
	streamHandles: true,
	errors:        openAIErrors{},
	impl:          chat{},
}

type chat struct{}

func (chat) validate(obj jsonraw.Object) error { return objectArray(obj, "messages") }

// bodyReply reads choice 0's message: content, tool calls and reasoning
// (reasoning in current vLLM, reasoning_content in older engines).
func (chat) bodyReply(obj jsonraw.Object) *Reply {
	rep, c := choiceReply(obj)
	if c == nil {
		return rep
	}
	m, ok := jsonraw.Lookup(c, "message")
	if !ok || len(m) == 0 || m[0] != '{' {
		rep.Incomplete = true
		return rep
	}
	if v, ok := jsonraw.Lookup(m, "content"); ok {
		rep.Content, _ = jsonraw.String(v)
	}
	if v, ok := jsonraw.Lookup(m, "tool_calls"); ok && !jsonraw.IsNull(v) && len(v) > 2 {
		rep.ToolCalls = append([]byte(nil), v...)
	}
	for _, k := range [...]string{"reasoning_content", "reasoning"} {
		if v, ok := jsonraw.Lookup(m, k); ok {
			if s, _ := jsonraw.String(v); s != "" {
				rep.Reasoning = s
			}
		}
	}
	return rep
}

// The members of a chat body that /tokenize takes.
var tokenizeChat = []string{"model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs"}

func (chat) tokenizeFields() []string  { return tokenizeChat }
func (chat) tokenizable(*Request) bool { return true }

// completionsAPI is POST /v1/completions. The render answer is a list,
// one object per prompt.
var completionsAPI = &api{
	code:          2,
	kind:          twoLegs,
	path:          PathCompletions,
	prefillSet:    oneTokenLeg,
	prefillDrop:   openAIPrefillDrop,
	render:        PathCompletions + "/render",
	renderList:    true,
	tokenIDs:      true,
	streamHandles: true,
	errors:        openAIErrors{},
	impl:          completions{},
}

type completions struct{}

func (completions) validate(obj jsonraw.Object) error {
	if v, ok := obj.Get("prompt"); !ok || jsonraw.IsNull(v) {
		return badRequest("prompt is required")
	}
	return nil
}

// bodyReply reads choice 0's text.
func (completions) bodyReply(obj jsonraw.Object) *Reply {
	rep, c := choiceReply(obj)
	if c == nil {
		return rep
	}
	if v, ok := jsonraw.Lookup(c, "text"); ok {
		rep.Content, _ = jsonraw.String(v)
	}
	return rep
}

// The members of a completions body that /tokenize takes.
var tokenizeCompletion = []string{"model", "prompt", "add_special_tokens"}

func (completions) tokenizeFields() []string { return tokenizeCompletion }

// tokenizable: /tokenize takes one prompt string.
func (completions) tokenizable(req *Request) bool {
	p, ok := req.Field("prompt")
	return ok && len(p) > 0 && p[0] == '"'
}

// promptIDs reads a prompt given as token ids, or as a list holding one
// list of ids.
func (completions) promptIDs(req *Request) ([]uint32, bool) {
	p, ok := req.Field("prompt")
	if !ok {
		return nil, false
	}
	if ids, ok := capture.AppendTokenIDs(nil, p); ok {
		return ids, true
	}
	var inner []byte
	n := 0
	if jsonraw.Elements(p, func(v []byte) error { inner = v; n++; return nil }) != nil || n != 1 {
		return nil, false
	}
	return capture.AppendTokenIDs(nil, inner)
}

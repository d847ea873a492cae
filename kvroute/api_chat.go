package kvroute

import "github.com/bidikv/bidikv/internal/jsonraw"

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

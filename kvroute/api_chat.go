package kvroute

import "github.com/bidikv/bidikv/internal/jsonraw"

// chatAPI is POST /v1/chat/completions.
type chatAPI struct{ openAI }

func (chatAPI) path() string { return PathChatCompletions }

func (chatAPI) validate(obj jsonraw.Object) error { return objectArray(obj, "messages") }

func (chatAPI) prefillSet() []jsonraw.Member { return oneTokenLeg }
func (chatAPI) prefillDrop() []string        { return openAIPrefillDrop }

// bodyReply reads choice 0's message: content, tool calls and reasoning
// (reasoning in current vLLM, reasoning_content in older engines).
func (chatAPI) bodyReply(obj jsonraw.Object) *Reply {
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

func (chatAPI) renderPath() (string, bool) { return PathChatCompletions + "/render", false }

// The members of a chat body that /tokenize takes.
var tokenizeChat = []string{"model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs"}

func (chatAPI) tokenizeFields() []string  { return tokenizeChat }
func (chatAPI) tokenizable(*Request) bool { return true }

func (chatAPI) promptIDs(*Request) ([]uint32, bool) { return nil, false }

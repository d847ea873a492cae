package sim

import "encoding/json"

// Reasoning field names of Config.ReasoningField.
const (
	// ReasoningFieldReasoning is current vLLM's "reasoning" key.
	ReasoningFieldReasoning = "reasoning"
	// ReasoningFieldContent is older engines' "reasoning_content" key.
	ReasoningFieldContent = "reasoning_content"
	// ReasoningFieldBoth writes both keys with the same value, as engines
	// of the transition did.
	ReasoningFieldBoth = "both"
)

func (c *Config) reasoningKeys() (reasoning, reasoningContent bool) {
	switch c.ReasoningField {
	case ReasoningFieldContent:
		return false, true
	case ReasoningFieldBoth:
		return true, true
	default:
		return true, false
	}
}

// parsesReasoning reports whether a reasoning parser splits the reasoning
// out of chat replies.
func (c *Config) parsesReasoning() bool { return c.Reasoning && !c.InlineReasoning }

// thinkHead returns the text of g's thinking tokens: <think>, the reasoning,
// </think> and the blank line after it (as far as they were generated); ""
// when g did not think.
func thinkHead(g Generated) string {
	if len(g.Tokens) == 0 || g.Tokens[0].Text != TokThinkOpen {
		return ""
	}
	head := ""
	closed := false
	for _, t := range g.Tokens {
		if closed {
			if t.Text == "\n\n" {
				head += t.Text
			}
			break
		}
		head += t.Text
		closed = t.Text == TokThinkClose
	}
	return head
}

// ChatContent returns a chat reply's content and reasoning as an engine
// with configuration c returns them: with a reasoning parser the reasoning
// apart (nil when the model did not think, as with enable_thinking false);
// with InlineReasoning the think block stays in the content and reasoning
// is nil; without Reasoning there is none.
func (c *Config) ChatContent(g Generated) (content string, reasoning *string) {
	switch {
	case !c.Reasoning:
		return g.Content, nil
	case c.InlineReasoning:
		return thinkHead(g) + g.Content, nil
	case thinkHead(g) == "":
		return g.Content, nil
	default:
		r := g.Reasoning
		return g.Content, &r
	}
}

// chatMessage is vLLM's ChatMessage as model_dump writes it: tool_calls
// left out when empty, the reasoning key(s) per Config.ReasoningField.
type chatMessage struct {
	Role             string          `json:"role"`
	Content          *string         `json:"content"`
	Refusal          any             `json:"refusal"`
	Annotations      any             `json:"annotations"`
	Audio            any             `json:"audio"`
	FunctionCall     any             `json:"function_call"`
	ToolCalls        []any           `json:"tool_calls,omitempty"`
	Reasoning        json.RawMessage `json:"reasoning,omitempty"`
	ReasoningContent json.RawMessage `json:"reasoning_content,omitempty"`
}

// toolCall is a chat reply's tool call, as vLLM writes it.
type toolCall struct {
	ID       string       `json:"id"`
	Type     string       `json:"type"`
	Function toolFunction `json:"function"`
}

type toolFunction struct {
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

// deltaToolCall is a stream delta's tool call: the first of a call
// carries its id, type and name, the rest only arguments.
type deltaToolCall struct {
	Index    int    `json:"index"`
	ID       string `json:"id,omitempty"`
	Type     string `json:"type,omitempty"`
	Function struct {
		Name      string `json:"name,omitempty"`
		Arguments string `json:"arguments"`
	} `json:"function"`
}

// message is a reply message as vLLM's ChatMessage: content (null for an
// auto call with no text), the parsed tool calls (each with the id callID:
// a reply makes one call at most), the reasoning key(s).
func (c *Config) message(p Parsed, callID string) chatMessage {
	content := p.Content
	m := chatMessage{Role: "assistant", Content: &content}
	if p.ContentNull {
		m.Content = nil
	}
	for _, call := range p.Calls {
		m.ToolCalls = append(m.ToolCalls, toolCall{ID: callID, Type: "function", Function: toolFunction{Name: call.Name, Arguments: call.Arguments}})
	}
	v, _ := json.Marshal(p.Reasoning)
	r, rc := c.reasoningKeys()
	if r {
		m.Reasoning = v
	}
	if rc {
		m.ReasoningContent = v
	}
	return m
}

// reasoningDelta sets a stream delta's reasoning key(s) to text.
func (c *Config) reasoningDelta(d *delta, text string) {
	r, rc := c.reasoningKeys()
	if r {
		d.Reasoning = &text
	}
	if rc {
		d.ReasoningContent = &text
	}
}

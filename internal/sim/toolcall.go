package sim

import (
	"bytes"
	"encoding/json"
	"sort"
	"strings"
)

// Tool calls under tool_choice auto and required, as a vLLM server run
// with --enable-auto-tool-choice and a hermes-style tool parser answers
// them (vllm/entrypoints/openai/chat_completion/serving.py,
// chat_completion_full_generator and chat_completion_stream_generator;
// vllm/parser/abstract_parser.py, DelegatingParser._extract_tool_calls).
//
// The model's text is its tokens: a call is generated as tokens and held
// in the KV like any other output, and the parser reads it back.
//
//   - auto: where the reply would end (EOS allowed: max_tokens not hit,
//     min_tokens reached, no ignore_eos), the model ends its turn with a
//     call instead, with probability Config.ToolCallRate decided from the
//     KV: "\n<tool_call>\n{"name": NAME, "arguments": {ARG: "WORDS"}}\n
//     </tool_call>" and EOS, the call being one of the request's tools
//     (chosen from the KV). The parser returns the text before the call as
//     content (stripped, as the engine parsers do) and the call.
//   - required: guided decoding makes the whole reply (after any
//     reasoning) the JSON list [{"name": NAME, "parameters": {ARG:
//     "WORDS"}}], whose words continue while EOS is not allowed; the
//     parser returns content "" and the call.
//
// A call cut by max_tokens is dropped from the whole answer (the engine
// parsers drop incomplete markup); a stream has sent what it had of it. arguments are json.dumps of the parsed arguments ({"k": "v"}),
// ARG the first property of the tool's parameters (sorted), "input" when
// it has none, always given a string of words. The chat template renders an assistant tool call as Qwen3's does
// ("\n" before a call unless it is the first and the content is empty,
// then "<tool_call>\n{"name": …, "arguments": …}\n</tool_call>"), so the
// next turn's prompt holds exactly the tokens an auto call generated;
// required calls (JSON list) and named calls (arguments only) render
// otherwise than they were generated, as in vLLM.

// Tool choices a reply may make calls under (Request.ToolChoice).
const (
	ToolChoiceAuto     = "auto"
	ToolChoiceRequired = "required"
)

// Tool is a function tool of a request: its name and the argument the
// simulated model fills.
type Tool struct {
	Name string
	Arg  string
}

// Call is a tool call a reply generated.
type Call struct {
	Name string
	// Arguments is what vLLM's parser returns: json.dumps of the parsed
	// arguments, which is also the text the model generated for them.
	Arguments string
	// Required is the JSON-list format of tool_choice required.
	Required bool
	// Start is the index in Generated.Tokens of the call's first token,
	// End the index after its last (the EOS excluded).
	Start, End int
	// Complete reports that the call's text was generated whole (not cut
	// by max_tokens): only then does the parser return it.
	Complete bool
	// NameEnd and ArgsStart are byte offsets in the call's text: where
	// its name (and closing quote) ends, where its arguments start.
	NameEnd, ArgsStart int
}

// callGen generates one call's tokens, one at a time.
type callGen struct {
	call       *Call
	head, tail []Token
	nArgs      int
	args       []string
	i          int // the next head or tail token
	phase      int // 0 head, 1 argument words, 2 tail, 3 done
	eosOK      func(tail int) bool
}

// startCall begins a call of one of tools chosen from h, with sep before
// it ("\n" after content in the auto format).
func startCall(tools []Tool, required bool, h uint64, sep string, start int, eosOK func(int) bool) *callGen {
	t := tools[h%uint64(len(tools))]
	name, _ := json.Marshal(t.Name)
	arg, _ := json.Marshal(t.Arg)
	head := sep + "<tool_call>\n{\"name\": " + string(name) + ", \"arguments\": "
	tail := "\"}}\n</tool_call>"
	if required {
		head = "[{\"name\": " + string(name) + ", \"parameters\": "
		tail = "\"}}]"
	}
	nameEnd := strings.Index(head, string(name)) + len(name)
	c := &Call{Name: t.Name, Required: required, Start: start, NameEnd: nameEnd, ArgsStart: len(head)}
	return &callGen{call: c, head: Tokenize(head + "{" + string(arg) + ": \""), tail: Tokenize(tail),
		nArgs: 2 + int((h>>16)%5), eosOK: eosOK}
}

// next returns the call's next token (word picks an argument word), or
// false when the call is done.
func (g *callGen) next(word func(first bool) Token) (Token, bool) {
	for {
		switch g.phase {
		case 0:
			if g.i < len(g.head) {
				g.i++
				return g.head[g.i-1], true
			}
			g.phase, g.i = 1, 0
		case 1:
			if len(g.args) < g.nArgs || !g.eosOK(len(g.tail)) {
				t := word(len(g.args) == 0)
				g.args = append(g.args, t.Text)
				return t, true
			}
			g.phase = 2
		case 2:
			if g.i < len(g.tail) {
				g.i++
				return g.tail[g.i-1], true
			}
			g.phase = 3
		default:
			return Token{}, false
		}
	}
}

// finish fills the call once generation stopped, end being the number of
// tokens generated before the EOS (or all of them when cut).
func (g *callGen) finish(end int) *Call {
	c := g.call
	c.End, c.Complete = end, g.phase == 3
	var head strings.Builder
	for _, t := range g.head {
		head.WriteString(t.Text)
	}
	c.Arguments = head.String()[c.ArgsStart:] + strings.Join(g.args, "") + "\"}"
	return c
}

// callText is the text of g's call: its tokens' texts.
func callText(g Generated) string {
	var sb strings.Builder
	for _, t := range g.Tokens[g.Call.Start:g.Call.End] {
		sb.WriteString(t.Text)
	}
	return sb.String()
}

// toolList reads chat-shaped tools ([{type: function, function: {name,
// parameters}}]) as the simulated model sees them.
func toolList(raw json.RawMessage) []Tool {
	if !present(raw) {
		return nil
	}
	var list []struct {
		Type     string `json:"type"`
		Function struct {
			Name       string `json:"name"`
			Parameters struct {
				Properties map[string]json.RawMessage `json:"properties"`
			} `json:"parameters"`
		} `json:"function"`
	}
	if json.Unmarshal(raw, &list) != nil {
		return nil
	}
	var out []Tool
	for _, t := range list {
		if t.Type != "" && t.Type != "function" || t.Function.Name == "" {
			continue
		}
		arg := "input"
		if len(t.Function.Parameters.Properties) > 0 {
			keys := make([]string, 0, len(t.Function.Parameters.Properties))
			for k := range t.Function.Parameters.Properties {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			arg = keys[0]
		}
		out = append(out, Tool{Name: t.Function.Name, Arg: arg})
	}
	return out
}

// pyJSON writes compact JSON as Python's json.dumps does by default (and
// transformers' tojson): a space after every ':' and ',' outside strings.
func pyJSON(compact string) string {
	var b strings.Builder
	in, esc := false, false
	for i := 0; i < len(compact); i++ {
		ch := compact[i]
		b.WriteByte(ch)
		switch {
		case esc:
			esc = false
		case in && ch == '\\':
			esc = true
		case ch == '"':
			in = !in
		case !in && (ch == ':' || ch == ','):
			b.WriteByte(' ')
		}
	}
	return b.String()
}

// Parsed is a reply as the server's parsers return it for its request.
type Parsed struct {
	// Content is the message content; ContentNull marks a null one (an
	// auto call with no text before it).
	Content     string
	ContentNull bool
	// Reasoning is nil when the model did not think (see ChatContent).
	Reasoning *string
	// Calls are the tool calls, without ids (the reply draws them).
	Calls []ParsedCall
	// Finish is chat's finish_reason: "tool_calls" for an auto or required
	// call, else the generation's "stop" or "length".
	Finish string
}

// ParsedCall is a tool call as the parser returns it.
type ParsedCall struct{ Name, Arguments string }

// Parse reads generation g of request r as vLLM's chat serving does
// (streamed: as its stream generator decides the finish reason).
//
//   - named tool_choice: content "", the call's arguments the generated
//     text, finish the generation's ("stop" even with a call);
//   - required: content "", the call when complete, finish "tool_calls"
//     when the generation stopped (output.finish_reason "stop");
//   - auto: the text before the call as content (null when empty) and the
//     call when complete; finish "tool_calls" when a call was found
//     (non-streaming: auto_tools_called, whatever the generation's finish)
//     or, streamed, when a call was streamed and the generation stopped.
//
// Streamed, a call cut by max_tokens is what its deltas sent: its name
// once generated whole, and the arguments' text so far (finish "length");
// the whole answer drops it.
func (c *Config) Parse(g Generated, r *Request, streamed bool) Parsed {
	content, reasoning := c.ChatContent(g)
	p := Parsed{Content: content, Reasoning: reasoning, Finish: g.Finish}
	switch {
	case r.ToolName != "":
		p.Content, p.Calls = "", []ParsedCall{{Name: r.ToolName, Arguments: content}}
	case g.Call == nil:
	case g.Call.Required:
		p.Content, p.Calls = "", parsedCalls(g, streamed)
		if g.Finish == "stop" {
			p.Finish = "tool_calls"
		}
	default:
		p.Calls = parsedCalls(g, streamed)
		if g.Call.Complete {
			p.ContentNull = strings.TrimSpace(content) == ""
			if !streamed || g.Finish == "stop" {
				p.Finish = "tool_calls"
			}
		}
	}
	return p
}

// parsedCalls is g's call as the parser returns it: whole when complete;
// cut, nothing, or streamed what the stream sent of it.
func parsedCalls(g Generated, streamed bool) []ParsedCall {
	c := g.Call
	switch {
	case c.Complete:
		return []ParsedCall{{Name: c.Name, Arguments: c.Arguments}}
	case !streamed:
		return nil
	}
	text := callText(g)
	if len(text) < c.NameEnd {
		return nil
	}
	args := ""
	if len(text) > c.ArgsStart {
		args = text[c.ArgsStart:min(len(text), c.ArgsStart+len(c.Arguments))]
	}
	return []ParsedCall{{Name: c.Name, Arguments: args}}
}

// toolChoice reads a request's tool_choice in the shape of its API (chat:
// "none", "auto", "required" or {"type": "function", "function": {"name"}};
// Responses: the same strings or {"type": "function", "name"}; Messages:
// {"type": "auto" | "any" | "tool" | "none", "name"}, any being vLLM's
// required) against its tools: the mode (ToolChoiceAuto,
// ToolChoiceRequired or "") and a named tool. Absent, it is auto when
// tools are given (vLLM's check_tool_usage, and the Messages converter).
// A chat request naming a choice other than none needs tools, and a named
// one a tool of that name, as vLLM validates them.
func toolChoice(path string, choice json.RawMessage, rawTools json.RawMessage, tools []Tool) (mode, named string, err error) {
	choice = bytes.TrimSpace(choice)
	if !present(choice) {
		if len(tools) > 0 {
			return ToolChoiceAuto, "", nil
		}
		return "", "", nil
	}
	var s string
	if json.Unmarshal(choice, &s) == nil {
		switch {
		case s == "none":
			return "", "", nil
		case path == PathChat && !present(rawTools):
			return "", "", badRequest("When using `tool_choice`, `tools` must be set.")
		case (s == ToolChoiceAuto || s == ToolChoiceRequired) && len(tools) > 0:
			return s, "", nil
		}
		return "", "", nil
	}
	var obj struct {
		Type     string `json:"type"`
		Name     string `json:"name"`
		Function *struct {
			Name string `json:"name"`
		} `json:"function"`
	}
	if json.Unmarshal(choice, &obj) != nil {
		return "", "", nil
	}
	switch {
	case path == PathChat:
		named, err := namedToolChoice(choice, rawTools)
		return "", named, err
	case path == PathMessages && obj.Type == "auto" && len(tools) > 0:
		return ToolChoiceAuto, "", nil
	case path == PathMessages && obj.Type == "any" && len(tools) > 0:
		return ToolChoiceRequired, "", nil
	case path == PathMessages && obj.Type == "tool", path == PathResponses && obj.Type == "function":
		return "", obj.Name, nil
	}
	return "", "", nil
}

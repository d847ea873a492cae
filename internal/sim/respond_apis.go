package sim

import "encoding/json"

// Responses and Messages replies, written as vLLM's
// vllm/entrypoints/openai/responses/serving.py and
// vllm/entrypoints/anthropic/serving.py write them. Both take the chat
// reply: non-streaming from the generated tokens, streaming from the chat
// chunks (as vLLM's converters consume the chat generator).

// Responses output item and usage shapes (openai.types.responses, dumped in
// full: null fields included).
type outputText struct {
	Annotations []any           `json:"annotations"`
	Text        string          `json:"text"`
	Type        string          `json:"type"`
	Logprobs    json.RawMessage `json:"logprobs"`
}

type outputMessage struct {
	ID      string       `json:"id"`
	Content []outputText `json:"content"`
	Role    string       `json:"role"`
	Status  string       `json:"status"`
	Type    string       `json:"type"`
	// Annotations and Logprobs are the extra keys vLLM's stream passes
	// to the message of response.output_item.done (and the OpenAI model
	// keeps); nil elsewhere.
	Annotations json.RawMessage `json:"annotations,omitempty"`
	Logprobs    json.RawMessage `json:"logprobs,omitempty"`
}

type reasoningText struct {
	Text string `json:"text"`
	Type string `json:"type"`
}

type reasoningItem struct {
	ID               string          `json:"id"`
	Summary          []any           `json:"summary"`
	Type             string          `json:"type"`
	Content          []reasoningText `json:"content"`
	EncryptedContent any             `json:"encrypted_content"`
	Status           *string         `json:"status"`
}

type responsesUsage struct {
	InputTokens        int `json:"input_tokens"`
	InputTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"input_tokens_details"`
	OutputTokens        int `json:"output_tokens"`
	OutputTokensDetails struct {
		ReasoningTokens int `json:"reasoning_tokens"`
	} `json:"output_tokens_details"`
	TotalTokens int `json:"total_tokens"`
}

// responsesBody is vLLM's ResponsesResponse as model_dump(mode="json")
// writes it.
type responsesBody struct {
	ID                 string          `json:"id"`
	CreatedAt          int64           `json:"created_at"`
	IncompleteDetails  any             `json:"incomplete_details"`
	Instructions       json.RawMessage `json:"instructions"`
	Metadata           json.RawMessage `json:"metadata"`
	Model              string          `json:"model"`
	Object             string          `json:"object"`
	Output             []any           `json:"output"`
	ParallelToolCalls  json.RawMessage `json:"parallel_tool_calls"`
	Temperature        json.RawMessage `json:"temperature"`
	ToolChoice         json.RawMessage `json:"tool_choice"`
	Tools              json.RawMessage `json:"tools"`
	TopP               json.RawMessage `json:"top_p"`
	Background         json.RawMessage `json:"background"`
	MaxOutputTokens    int             `json:"max_output_tokens"`
	MaxToolCalls       json.RawMessage `json:"max_tool_calls"`
	PreviousResponseID json.RawMessage `json:"previous_response_id"`
	Prompt             json.RawMessage `json:"prompt"`
	Reasoning          json.RawMessage `json:"reasoning"`
	ServiceTier        json.RawMessage `json:"service_tier"`
	Status             string          `json:"status"`
	Text               json.RawMessage `json:"text"`
	TopLogprobs        json.RawMessage `json:"top_logprobs"`
	Truncation         json.RawMessage `json:"truncation"`
	Usage              *responsesUsage `json:"usage"`
	User               json.RawMessage `json:"user"`
	InputMessages      json.RawMessage `json:"input_messages"`
	OutputMessages     json.RawMessage `json:"output_messages"`
	// KVTransferParams is null without a handle, and not there at all on
	// an engine older than PR #37424 (Config.NoResponsesKV).
	KVTransferParams json.RawMessage `json:"kv_transfer_params,omitempty"`
}

// uuidHex is a random_uuid(): 32 hex digits.
func uuidHex() string { return randHex(16) }

// newID returns the reply's next item id (a bare uuid, as vLLM's stream
// item ids are). The ids are drawn once per reply: events rebuilds a stream
// when the handle arrives, and the rebuilt events keep the ids the client
// already saw.
func (o *reply) newID() string {
	if o.nextID == len(o.ids) {
		o.ids = append(o.ids, uuidHex())
	}
	o.nextID++
	return o.ids[o.nextID-1]
}

// reasoningObject echoes the request's reasoning as the Reasoning model
// dumps it, null when absent.
func reasoningObject(raw json.RawMessage) json.RawMessage {
	if !present(raw) {
		return json.RawMessage("null")
	}
	m, err := decodeObject(raw)
	if err != nil {
		return json.RawMessage("null")
	}
	out, _ := json.Marshal(map[string]json.RawMessage{
		"effort":           rawOr(m, "effort", "null"),
		"generate_summary": rawOr(m, "generate_summary", "null"),
		"summary":          rawOr(m, "summary", "null"),
	})
	return out
}

// maxOutputTokens is the sampling max_tokens: the request's, or what the
// model length leaves.
func (o *reply) maxOutputTokens() int {
	if o.t.req.MaxTokens > 0 {
		return o.t.req.MaxTokens
	}
	return max(o.e.maxModelLen()-len(o.t.toks), 1)
}

// responsesOutput is the output list of a finished reply (fresh item ids),
// as the parser's extract_response_outputs builds it: a reasoning item
// when there was reasoning (with a reasoning parser), a message item when
// there is text, a function_call item per tool call (id "fc_" and a uuid,
// call_id the chat call id). Without a reasoning parser and without calls,
// always one message item (its content empty when there is no text), as
// vLLM's fallback without a parser.
func (o *reply) responsesOutput() []any {
	p := o.e.cfg.Parse(o.t.gens[0], o.t.req, false)
	msg := func() outputMessage {
		m := outputMessage{ID: "msg_" + o.newID(), Content: []outputText{}, Role: "assistant", Status: "completed", Type: "message"}
		if p.Content != "" {
			m.Content = append(m.Content, outputText{Annotations: []any{}, Text: p.Content, Type: "output_text", Logprobs: json.RawMessage("null")})
		}
		return m
	}
	if !o.e.cfg.parsesReasoning() && len(p.Calls) == 0 {
		return []any{msg()}
	}
	out := []any{}
	if o.e.cfg.parsesReasoning() && p.Reasoning != nil && *p.Reasoning != "" {
		out = append(out, reasoningItem{ID: "rs_" + o.newID(), Summary: []any{}, Type: "reasoning",
			Content: []reasoningText{{Text: *p.Reasoning, Type: "reasoning_text"}}})
	}
	if p.Content != "" {
		out = append(out, msg())
	}
	for _, c := range p.Calls {
		out = append(out, functionCallItem{ID: "fc_" + o.newID(), CallID: o.toolCallID(0), Type: "function_call",
			Status: "completed", Name: c.Name, Arguments: c.Arguments})
	}
	return out
}

// reasoningTokens counts the generated tokens inside the think block, as
// the reasoning parser's count_reasoning_tokens does (0 without a parser).
func (o *reply) reasoningTokens() int {
	if !o.e.cfg.parsesReasoning() {
		return 0
	}
	n, in := 0, false
	for _, t := range o.t.gens[0].Tokens {
		switch {
		case t.Text == TokThinkOpen:
			in = true
		case t.Text == TokThinkClose:
			return n
		case in:
			n++
		}
	}
	return n
}

// responsesObject is the response object: final (output, usage, status
// completed or incomplete on max_output_tokens, and the handle) or the
// initial one of a stream (status in_progress, no output, no usage, no
// handle). withKV puts the handle in a final object.
func (o *reply) responsesObject(withKV bool) responsesBody {
	return o.responsesObjectAt(true, withKV)
}

func (o *reply) responsesObjectAt(final, withKV bool) responsesBody {
	m := o.t.req.Raw
	// def is the body's value, or vLLM's default when absent or null
	def := func(key, d string) json.RawMessage {
		if v := m[key]; present(v) {
			return v
		}
		return json.RawMessage(d)
	}
	b := responsesBody{
		ID: o.id, CreatedAt: o.created, IncompleteDetails: nil,
		Instructions: def("instructions", "null"), Metadata: def("metadata", "null"),
		Model: o.model(), Object: "response", Output: []any{},
		ParallelToolCalls: def("parallel_tool_calls", "true"), Temperature: def("temperature", "1.0"),
		ToolChoice: def("tool_choice", `"auto"`), Tools: def("tools", "[]"), TopP: def("top_p", "1.0"),
		Background: def("background", "false"), MaxOutputTokens: o.maxOutputTokens(),
		MaxToolCalls: def("max_tool_calls", "null"), PreviousResponseID: def("previous_response_id", "null"),
		Prompt: json.RawMessage("null"), Reasoning: reasoningObject(m["reasoning"]),
		ServiceTier: def("service_tier", `"auto"`), Status: "in_progress", Text: def("text", "null"),
		TopLogprobs: json.RawMessage("null"), Truncation: def("truncation", `"disabled"`),
		User: def("user", "null"), InputMessages: json.RawMessage("null"), OutputMessages: json.RawMessage("null"),
		KVTransferParams: json.RawMessage("null"),
	}
	if o.e.cfg.NoResponsesKV {
		b.KVTransferParams = nil
	}
	if !final {
		return b
	}
	g := o.t.gens[0]
	b.Output = o.responsesOutput()
	b.Status = "completed"
	if g.Finish == "length" {
		b.Status = "incomplete"
		b.IncompleteDetails = map[string]string{"reason": "max_output_tokens"}
	}
	n, c := o.t.rec.PromptTokens, o.t.rec.CompletionTokens
	u := &responsesUsage{InputTokens: n, OutputTokens: c, TotalTokens: n + c}
	u.InputTokensDetails.CachedTokens = o.t.rec.CachedTokens + o.t.rec.PulledTokens
	u.OutputTokensDetails.ReasoningTokens = o.reasoningTokens()
	b.Usage = u
	if withKV && o.kv != nil {
		b.KVTransferParams = o.kv
	}
	return b
}

// chatDelta is what the converters read of a chat chunk.
type chatDelta struct {
	done      bool // the [DONE] event
	usageOnly bool // the include_usage chunk (no choices)
	reasoning *string
	content   *string
	call      *deltaToolCall // the delta's tool call, nil when none
	finish    *string        // the chunk's finish_reason
	steps     int
}

// chatDeltas reads the chat events back, as vLLM's converters parse the
// chat generator's chunks.
func chatDeltas(evs []event) []chatDelta {
	out := make([]chatDelta, 0, len(evs))
	for _, ev := range evs {
		if string(ev.data) == "[DONE]" {
			out = append(out, chatDelta{done: true, steps: ev.steps})
			continue
		}
		var c struct {
			Choices []struct {
				Delta *struct {
					Content          *string         `json:"content"`
					Reasoning        *string         `json:"reasoning"`
					ReasoningContent *string         `json:"reasoning_content"`
					ToolCalls        []deltaToolCall `json:"tool_calls"`
				} `json:"delta"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
		}
		_ = json.Unmarshal(ev.data, &c)
		d := chatDelta{steps: ev.steps}
		if len(c.Choices) == 0 {
			d.usageOnly = true
		} else if dl := c.Choices[0].Delta; dl != nil {
			d.content, d.reasoning = dl.Content, dl.Reasoning
			if d.reasoning == nil {
				d.reasoning = dl.ReasoningContent
			}
			if len(dl.ToolCalls) > 0 {
				d.call = &dl.ToolCalls[0]
			}
		}
		if len(c.Choices) > 0 {
			d.finish = c.Choices[0].FinishReason
		}
		out = append(out, d)
	}
	return out
}

// sse collects converted events, carrying the decode steps of chunks that
// produced no event to the next event.
type sse struct {
	out     []event
	pending int
}

func (s *sse) add(name string, v any) {
	b, _ := json.Marshal(v)
	s.out = append(s.out, event{data: b, name: name, steps: s.pending})
	s.pending = 0
}

func ptr[T any](v T) *T { return &v }

// Anthropic shapes, as pydantic dumps them.
type anthropicUsage struct {
	InputTokens  int `json:"input_tokens"`
	OutputTokens int `json:"output_tokens"`
}

type anthropicContent struct {
	Type      string          `json:"type"`
	Text      *string         `json:"text,omitempty"`
	ID        string          `json:"id,omitempty"`
	Name      string          `json:"name,omitempty"`
	Input     json.RawMessage `json:"input,omitempty"`
	Thinking  *string         `json:"thinking,omitempty"`
	Signature *string         `json:"signature,omitempty"`
}

// messagesBody is vLLM's AnthropicMessagesResponse as
// model_dump(exclude_none=True) writes it: stop_sequence (never set by
// vLLM) and a null kv_transfer_params left out.
type messagesBody struct {
	ID               string             `json:"id"`
	Type             string             `json:"type"`
	Role             string             `json:"role"`
	Content          []anthropicContent `json:"content"`
	Model            string             `json:"model"`
	StopReason       string             `json:"stop_reason,omitempty"`
	Usage            anthropicUsage     `json:"usage"`
	KVTransferParams json.RawMessage    `json:"kv_transfer_params,omitempty"`
}

// anthropicStopReason maps a finish reason as vLLM's stop_reason_map.
func anthropicStopReason(finish string) string {
	switch finish {
	case "length":
		return "max_tokens"
	case "tool_calls":
		return "tool_use"
	default:
		return "end_turn"
	}
}

// messagesObject is the message vLLM's messages_full_converter makes of
// the chat answer: thinking, text and tool_use blocks (id the chat call
// id, input the parsed arguments), the stop reason mapped from the chat
// finish reason.
func (o *reply) messagesObject() messagesBody {
	p := o.e.cfg.Parse(o.t.gens[0], o.t.req, false)
	b := messagesBody{ID: o.id, Type: "message", Role: "assistant", Content: []anthropicContent{}, Model: o.model(),
		StopReason: anthropicStopReason(p.Finish), Usage: anthropicUsage{o.t.rec.PromptTokens, o.t.rec.CompletionTokens}, KVTransferParams: o.kv}
	if p.Reasoning != nil && *p.Reasoning != "" {
		b.Content = append(b.Content, anthropicContent{Type: "thinking", Thinking: p.Reasoning, Signature: ptr(o.newID())})
	}
	if p.Content != "" {
		b.Content = append(b.Content, anthropicContent{Type: "text", Text: &p.Content})
	}
	for _, c := range p.Calls {
		b.Content = append(b.Content, anthropicContent{Type: "tool_use", ID: o.toolCallID(0), Name: c.Name, Input: toolInput(c.Arguments)})
	}
	return b
}

// toolInput is a tool_use block's input: the arguments' JSON object
// (json.loads), compacted; a named call's words, which are no JSON, as
// {"input": words}.
func toolInput(args string) json.RawMessage {
	var obj map[string]json.RawMessage
	if json.Unmarshal([]byte(args), &obj) != nil {
		b, _ := json.Marshal(map[string]string{"input": args})
		return b
	}
	b, _ := json.Marshal(obj)
	return b
}

// anthropicEvent is vLLM's AnthropicStreamEvent as
// model_dump_json(exclude_unset=True) writes it.
type anthropicEvent struct {
	Type         string            `json:"type"`
	Message      *anthropicStart   `json:"message,omitempty"`
	Delta        *anthropicDelta   `json:"delta,omitempty"`
	ContentBlock *anthropicContent `json:"content_block,omitempty"`
	Index        *int              `json:"index,omitempty"`
	Usage        *anthropicUsage   `json:"usage,omitempty"`
}

// anthropicStart is message_start's message: only the fields vLLM sets
// (no type, role or kv_transfer_params).
type anthropicStart struct {
	ID           string             `json:"id"`
	Content      []anthropicContent `json:"content"`
	Model        string             `json:"model"`
	StopReason   *string            `json:"stop_reason"`
	StopSequence *string            `json:"stop_sequence"`
	Usage        anthropicUsage     `json:"usage"`
}

type anthropicDelta struct {
	Type        string  `json:"type,omitempty"`
	PartialJSON *string `json:"partial_json,omitempty"`
	Text        *string `json:"text,omitempty"`
	Thinking    *string `json:"thinking,omitempty"`
	Signature   *string `json:"signature,omitempty"`
	StopReason  string  `json:"stop_reason,omitempty"`
}

// messagesEvents converts the chat stream (with include_usage, as vLLM
// asks for it) into vLLM's Anthropic stream: message_start (from the role
// chunk: usage input_tokens, output_tokens 0), then per block
// content_block_start, content_block_delta… (thinking_delta for reasoning,
// text_delta for text, input_json_delta for a tool_use block, which starts
// with the call's id, name and input {}; a thinking block ends with a
// signature_delta), content_block_stop; then message_delta (stop_reason
// mapped from the chat stream's finish reason, usage) from the usage chunk
// and message_stop from [DONE]. No ping, and no handle anywhere
// (vLLM's converter drops the chunks' kv_transfer_params).
func (o *reply) messagesEvents(chat []event) []event {
	s := &sse{}
	emit := func(ev anthropicEvent) { s.add(ev.Type, ev) }
	first := true
	block, index := "", 0
	signed := false
	stop := func() {
		if block == "" {
			return
		}
		i := index
		if block == "thinking" && !signed {
			emit(anthropicEvent{Type: "content_block_delta", Delta: &anthropicDelta{Type: "signature_delta", Signature: ptr(o.newID())}, Index: &i})
		}
		emit(anthropicEvent{Type: "content_block_stop", Index: &i})
		block, signed = "", false
		index++
	}
	start := func(cb *anthropicContent) {
		stop()
		i := index
		switch cb.Type {
		case "thinking":
			cb.Thinking = ptr("")
		case "text":
			cb.Text = ptr("")
		}
		emit(anthropicEvent{Type: "content_block_start", ContentBlock: cb, Index: &i})
		block = cb.Type
	}
	finish, toolID := "", "" // the chat stream's finish reason, the open tool_use block's id
	for _, d := range chatDeltas(chat) {
		s.pending += d.steps
		if d.finish != nil && !first {
			finish = *d.finish
		}
		switch {
		case d.done:
			emit(anthropicEvent{Type: "message_stop"})
			continue
		case first:
			first = false
			emit(anthropicEvent{Type: "message_start", Message: &anthropicStart{ID: o.id, Content: []anthropicContent{},
				Model: o.model(), Usage: anthropicUsage{InputTokens: o.t.rec.PromptTokens}}})
			continue
		case d.usageOnly:
			stop()
			if finish == "" {
				finish = "stop"
			}
			emit(anthropicEvent{Type: "message_delta", Delta: &anthropicDelta{StopReason: anthropicStopReason(finish)},
				Usage: &anthropicUsage{o.t.rec.PromptTokens, o.t.rec.CompletionTokens}})
			continue
		}
		if d.reasoning != nil && *d.reasoning != "" {
			if block != "thinking" {
				start(&anthropicContent{Type: "thinking"})
			}
			i := index
			emit(anthropicEvent{Type: "content_block_delta", Delta: &anthropicDelta{Type: "thinking_delta", Thinking: d.reasoning}, Index: &i})
		}
		if d.content != nil && *d.content != "" {
			if block != "text" {
				start(&anthropicContent{Type: "text"})
			}
			i := index
			emit(anthropicEvent{Type: "content_block_delta", Delta: &anthropicDelta{Type: "text_delta", Text: d.content}, Index: &i})
		}
		if c := d.call; c != nil {
			if c.ID != "" && c.ID != toolID && c.Function.Name != "" {
				start(&anthropicContent{Type: "tool_use", ID: c.ID, Name: c.Function.Name, Input: json.RawMessage("{}")})
				toolID = c.ID
			}
			if args := c.Function.Arguments; args != "" && toolID != "" && block == "tool_use" {
				i := index
				emit(anthropicEvent{Type: "content_block_delta", Delta: &anthropicDelta{Type: "input_json_delta", PartialJSON: &args}, Index: &i})
			}
		}
	}
	return s.out
}

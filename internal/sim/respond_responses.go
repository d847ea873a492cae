package sim

import (
	"encoding/json"
	"strings"
)

// functionCallItem is a Responses function_call output item
// (openai.types.responses.ResponseFunctionToolCall).
type functionCallItem struct {
	Arguments string `json:"arguments"`
	CallID    string `json:"call_id"`
	Name      string `json:"name"`
	Type      string `json:"type"`
	ID        string `json:"id"`
	Status    string `json:"status"`
}

// responsesStream converts the chat stream into vLLM's Responses stream as
// its simple streaming event processor does
// (vllm/entrypoints/openai/responses/simple_streaming_events.py,
// process_simple_stream): response.created and response.in_progress (the
// initial object: in_progress, no output, no usage, kv_transfer_params
// null), then for reasoning response.output_item.added (a reasoning item),
// response.content_part.added (reasoning_text),
// response.reasoning_text.delta…, response.reasoning_text.done,
// response.content_part.done, response.output_item.done; for text the
// same with a message item, output_text parts and
// response.output_text.delta / .done; for a tool call
// response.output_item.added (a function_call item, status in_progress,
// id a bare uuid, call_id "call_" and a uuid),
// response.function_call_arguments.delta…,
// response.function_call_arguments.done and response.output_item.done;
// then response.completed wrapping the final response object, which
// carries the handle as the non-streaming body does (PR #37424;
// protocol.md, "Other APIs"): stock engines too, StreamHandles (#40186) is
// about chat and completions streams only. Every event has
// sequence_number, counting from 0. The stream's item ids are bare uuids;
// the final object's items have fresh "rs_"/"msg_"/"fc_" ids and the
// calls the chat call id, as in vLLM.
type responsesStream struct {
	o            *reply
	s            sse
	seq          int
	outIdx       int
	itemID       string
	callID, name string
	started      bool // the event stream started (its first item added)
	callStarted  bool
	prev         []chatDelta // previous_delta_messages
}

func (o *reply) responsesEvents(chat []event) []event {
	r := &responsesStream{o: o}
	initial := o.responsesObjectAt(false, false)
	r.emit("response.created", map[string]any{"response": initial})
	r.emit("response.in_progress", map[string]any{"response": initial})
	for _, d := range chatDeltas(chat) {
		r.s.pending += d.steps
		if d.content != nil && *d.content == "" {
			d.content = nil
		}
		if d.reasoning != nil && *d.reasoning == "" {
			d.reasoning = nil
		}
		if d.content == nil && d.reasoning == nil && d.call == nil {
			continue
		}
		r.delta(d)
	}
	r.end()
	r.emit("response.completed", map[string]any{"response": o.responsesObjectAt(true, !o.e.cfg.NoResponsesKV)})
	return r.s.out
}

func (r *responsesStream) emit(typ string, fields map[string]any) {
	fields["type"] = typ
	fields["sequence_number"] = r.seq
	r.seq++
	r.s.add(typ, fields)
}

// delta handles one parsed delta.
func (r *responsesStream) delta(d chatDelta) {
	if !r.started {
		switch {
		case d.call != nil:
			if d.call.Function.Name == "" {
				return
			}
			r.addCall(d.call)
		case d.reasoning != nil:
			r.itemID = r.o.newID()
			r.addReasoning()
		default:
			r.itemID = r.o.newID()
			r.addMessage()
		}
		r.started = true
	}
	last := chatDelta{}
	if n := len(r.prev); n > 0 {
		last = r.prev[n-1]
	}
	switch {
	case last.reasoning != nil && d.content != nil:
		text := r.join(true)
		if d.reasoning != nil {
			r.reasoningDelta(*d.reasoning)
			text += *d.reasoning
			d.reasoning = nil
		}
		r.reasoningDone(text)
		r.outIdx++
		r.prev = nil
		r.itemID = r.o.newID()
		r.addMessage()
		r.textDelta(*d.content)
	case d.call != nil:
		if last.reasoning != nil || last.content != nil {
			if last.reasoning != nil {
				r.reasoningDone(r.join(true))
				r.outIdx++
			}
			if last.content != nil {
				r.textDone(r.join(false))
				r.outIdx++
			}
			r.prev = nil
		}
		if d.call.Function.Name != "" && !r.callStarted {
			r.addCall(d.call)
		}
		if d.call.Function.Arguments != "" {
			r.emit("response.function_call_arguments.delta", map[string]any{"output_index": r.outIdx, "item_id": r.itemID,
				"delta": d.call.Function.Arguments})
		}
	case d.reasoning != nil:
		r.reasoningDelta(*d.reasoning)
	default:
		r.textDelta(*d.content)
	}
	r.prev = append(r.prev, d)
}

// end finalizes the open item.
func (r *responsesStream) end() {
	n := len(r.prev)
	switch {
	case n == 0:
	case r.prev[n-1].call != nil:
		var args strings.Builder
		for _, d := range r.prev {
			if d.call != nil {
				args.WriteString(d.call.Function.Arguments)
			}
		}
		r.emit("response.function_call_arguments.done", map[string]any{"output_index": r.outIdx, "item_id": r.itemID,
			"arguments": args.String(), "name": r.name})
		r.emit("response.output_item.done", map[string]any{"output_index": r.outIdx, "item": functionCallItem{Type: "function_call",
			Name: r.name, Arguments: args.String(), Status: "completed", ID: r.itemID, CallID: r.callID}})
	case r.prev[n-1].reasoning != nil:
		r.reasoningDone(r.join(true))
	default:
		r.textDone(r.join(false))
	}
}

func (r *responsesStream) addCall(c *deltaToolCall) {
	r.callStarted = true
	r.itemID, r.callID, r.name = r.o.newID(), "call_"+r.o.newID(), c.Function.Name
	r.emit("response.output_item.added", map[string]any{"output_index": r.outIdx, "item": functionCallItem{Type: "function_call",
		ID: r.itemID, CallID: r.callID, Name: r.name, Arguments: c.Function.Arguments, Status: "in_progress"}})
}

func (r *responsesStream) addReasoning() {
	r.emit("response.output_item.added", map[string]any{"output_index": r.outIdx, "item": reasoningItem{ID: r.itemID,
		Summary: []any{}, Type: "reasoning", Status: ptr("in_progress")}})
	r.emit("response.content_part.added", map[string]any{"output_index": r.outIdx, "item_id": r.itemID, "content_index": 0,
		"part": reasoningText{Text: "", Type: "reasoning_text"}})
}

func (r *responsesStream) addMessage() {
	r.emit("response.output_item.added", map[string]any{"output_index": r.outIdx, "item": outputMessage{ID: r.itemID,
		Content: []outputText{}, Role: "assistant", Status: "in_progress", Type: "message"}})
	r.emit("response.content_part.added", map[string]any{"output_index": r.outIdx, "item_id": r.itemID, "content_index": 0,
		"part": outputText{Annotations: []any{}, Text: "", Type: "output_text", Logprobs: json.RawMessage("[]")}})
}

// join is the reasoning (reason) or text of the deltas since the item began.
func (r *responsesStream) join(reason bool) string {
	var sb strings.Builder
	for _, d := range r.prev {
		if reason && d.reasoning != nil {
			sb.WriteString(*d.reasoning)
		}
		if !reason && d.content != nil {
			sb.WriteString(*d.content)
		}
	}
	return sb.String()
}

func (r *responsesStream) reasoningDelta(text string) {
	r.emit("response.reasoning_text.delta", map[string]any{"content_index": 0, "output_index": r.outIdx,
		"item_id": r.itemID, "delta": text})
}

func (r *responsesStream) reasoningDone(text string) {
	r.emit("response.reasoning_text.done", map[string]any{"item_id": r.itemID, "output_index": r.outIdx, "content_index": 0, "text": text})
	r.emit("response.content_part.done", map[string]any{"item_id": r.itemID, "output_index": r.outIdx, "content_index": 0,
		"part": reasoningText{Text: text, Type: "reasoning_text"}})
	r.emit("response.output_item.done", map[string]any{"output_index": r.outIdx, "item": reasoningItem{ID: r.itemID,
		Summary: []any{}, Type: "reasoning", Content: []reasoningText{{Text: text, Type: "reasoning_text"}}, Status: ptr("completed")}})
}

func (r *responsesStream) textDelta(text string) {
	r.emit("response.output_text.delta", map[string]any{"content_index": 0, "output_index": r.outIdx, "item_id": r.itemID,
		"delta": text, "logprobs": []any{}})
}

func (r *responsesStream) textDone(text string) {
	r.emit("response.output_text.done", map[string]any{"item_id": r.itemID, "output_index": r.outIdx, "content_index": 0,
		"text": text, "logprobs": []any{}})
	r.emit("response.content_part.done", map[string]any{"item_id": r.itemID, "output_index": r.outIdx, "content_index": 0,
		"part": outputText{Annotations: []any{}, Text: text, Type: "output_text", Logprobs: json.RawMessage("null")}})
	r.emit("response.output_item.done", map[string]any{"output_index": r.outIdx, "item": outputMessage{ID: r.itemID,
		Content: []outputText{{Annotations: []any{}, Text: text, Type: "output_text", Logprobs: json.RawMessage("null")}},
		Role:    "assistant", Status: "completed", Type: "message",
		Annotations: json.RawMessage("[]"), Logprobs: json.RawMessage("[]")}})
}

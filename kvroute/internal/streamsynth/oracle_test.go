package streamsynth_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"reflect"

	"github.com/bidikv/bidikv/kvroute/internal/streamsynth"
	"github.com/bidikv/bidikv/sse"
)

// The oracle: it reads a synthesized stream with the repository's SSE
// reader, checks the API's event grammar, reassembles the answer the way
// clients do (deltas concatenated, tool calls merged by index, Messages'
// content blocks built from their start and deltas as the Anthropic SDK
// does), and compares it with the answer body decoded by encoding/json.
// It knows nothing of how the synthesizer works.

// decode decodes JSON with numbers kept as written.
func decode(b []byte) (any, error) {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		return nil, err
	}
	if _, err := d.Token(); err != io.EOF {
		return nil, fmt.Errorf("trailing data after %q", b)
	}
	return v, nil
}

// events reads a stream with sse.Reader: every block complete, no
// comments.
func events(stream []byte) ([]sse.Event, error) {
	r := sse.NewReader(bytes.NewReader(stream), sse.WithMaxEventSize(len(stream)+1))
	var out []sse.Event
	for {
		e, err := r.Next()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		if e.Incomplete || e.Comment || !e.HasData {
			return nil, fmt.Errorf("event %d is not a complete data event: %q", len(out), e.Raw)
		}
		e.Data = bytes.Clone(e.Data)
		out = append(out, e)
	}
}

// want and got are the reassembled forms both sides are brought to.
type obj = map[string]any

func str(v any) (string, bool) { s, ok := v.(string); return s, ok }

// reassembleOpenAI reads a chat (chat true) or completions stream into
// {"id","created","model","system_fingerprint","usage","prompt_token_ids",
// "choices": {index: {...}}}, checking the grammar: data events only,
// every chunk of the right object with the same id, created and model, at
// most one choice per chunk, nothing for a choice after its finish chunk,
// the usage chunk with no choices just before data: [DONE], which ends the
// stream.
func reassembleOpenAI(stream []byte, chat bool) (obj, error) {
	evs, err := events(stream)
	if err != nil {
		return nil, err
	}
	if len(evs) == 0 || string(evs[len(evs)-1].Data) != "[DONE]" {
		return nil, errors.New("the stream does not end with data: [DONE]")
	}
	object := "text_completion"
	if chat {
		object = "chat.completion.chunk"
	}
	out := obj{}
	choices := map[string]obj{}
	finished := map[string]bool{}
	for n, e := range evs[:len(evs)-1] {
		if e.Name != "" {
			return nil, fmt.Errorf("event %d is named %q", n, e.Name)
		}
		v, err := decode(e.Data)
		if err != nil {
			return nil, fmt.Errorf("event %d: %w", n, err)
		}
		c, ok := v.(obj)
		if !ok || c["object"] != object {
			return nil, fmt.Errorf("event %d is not a %s: %s", n, object, e.Data)
		}
		for _, k := range []string{"id", "created", "model"} {
			if w, seen := out[k]; seen && !reflect.DeepEqual(w, c[k]) {
				return nil, fmt.Errorf("event %d: %s changed", n, k)
			}
			if x, ok := c[k]; ok {
				out[k] = x
			}
		}
		for _, k := range []string{"system_fingerprint", "prompt_token_ids"} {
			if x, ok := c[k]; ok {
				out[k] = x
			}
		}
		list, ok := c["choices"].([]any)
		if !ok || len(list) > 1 {
			return nil, fmt.Errorf("event %d: choices is not a list of at most one: %s", n, e.Data)
		}
		if len(list) == 0 {
			if n != len(evs)-2 {
				return nil, fmt.Errorf("event %d: a chunk without choices before the last", n)
			}
			out["usage"] = c["usage"]
			continue
		}
		ch := list[0].(obj)
		idx := fmt.Sprint(ch["index"])
		if finished[idx] {
			return nil, fmt.Errorf("event %d: choice %s after its finish chunk", n, idx)
		}
		a := choices[idx]
		if a == nil {
			a = obj{"index": ch["index"]}
			choices[idx] = a
			if chat && (ch["delta"] == nil || ch["delta"].(obj)["role"] == nil) {
				return nil, fmt.Errorf("event %d: choice %s starts without its role", n, idx)
			}
		}
		if lp := ch["logprobs"]; lp != nil {
			if a["logprobs"] != nil {
				return nil, fmt.Errorf("event %d: choice %s has logprobs twice", n, idx)
			}
			a["logprobs"] = lp
		}
		if ids, ok := ch["token_ids"].([]any); ok {
			prev, _ := a["token_ids"].([]any)
			// a client's list: [] stays an empty list, not null
			a["token_ids"] = append(append(make([]any, 0, len(prev)+len(ids)), prev...), ids...)
		}
		if ids, ok := ch["prompt_token_ids"]; ok {
			a["prompt_token_ids"] = ids
		}
		if x, ok := ch["stop_reason"]; ok && x != nil {
			a["stop_reason"] = x
		}
		if fr := ch["finish_reason"]; fr != nil {
			a["finish_reason"] = fr
			a["stop_reason"] = ch["stop_reason"]
			finished[idx] = true
		}
		if !chat {
			t, ok := str(ch["text"])
			if !ok {
				return nil, fmt.Errorf("event %d: text is not a string", n)
			}
			prev, _ := str(a["text"])
			a["text"] = prev + t
			continue
		}
		delta, _ := ch["delta"].(obj)
		for k, x := range delta {
			switch k {
			case "role":
				a["role"] = x
			case "content", "reasoning", "reasoning_content":
				s, ok := str(x)
				if !ok {
					return nil, fmt.Errorf("event %d: %s is not a string", n, k)
				}
				prev, _ := str(a[k])
				a[k] = prev + s
			case "tool_calls":
				calls, _ := a["tool_calls"].(map[string]obj)
				if calls == nil {
					calls = map[string]obj{}
					a["tool_calls"] = calls
				}
				for _, f := range x.([]any) {
					f := f.(obj)
					ti := fmt.Sprint(f["index"])
					tc := calls[ti]
					if tc == nil {
						tc = obj{"index": f["index"], "arguments": ""}
						calls[ti] = tc
					}
					for _, k := range []string{"id", "type"} {
						if x, ok := f[k]; ok {
							tc[k] = x
						}
					}
					if fn, ok := f["function"].(obj); ok {
						if x, ok := fn["name"]; ok {
							tc["name"] = x
						}
						if x, ok := str(fn["arguments"]); ok {
							tc["arguments"] = tc["arguments"].(string) + x
						}
					}
				}
			default:
				return nil, fmt.Errorf("event %d: unknown delta member %q", n, k)
			}
		}
	}
	for idx := range choices {
		if !finished[idx] {
			return nil, fmt.Errorf("choice %s has no finish chunk", idx)
		}
	}
	out["choices"] = choices
	return out, nil
}

// expectOpenAI is the body in reassembleOpenAI's form: what a client must
// end up with.
func expectOpenAI(body []byte, chat bool, opt streamsynth.Options) (obj, error) {
	v, err := decode(body)
	if err != nil {
		return nil, err
	}
	b := v.(obj)
	out := obj{}
	for _, k := range []string{"id", "created", "model", "system_fingerprint", "prompt_token_ids"} {
		if x, ok := b[k]; ok && x != nil && (chat || k != "prompt_token_ids") {
			out[k] = x
		}
	}
	usageChunk := false
	if u, ok := b["usage"]; ok && u != nil && opt.IncludeUsage {
		out["usage"] = u
		usageChunk = true
	}
	if len(b["choices"].([]any)) == 0 && !usageChunk {
		clear(out) // no chunk at all but data: [DONE]
	}
	if len(b["choices"].([]any)) == 0 {
		delete(out, "prompt_token_ids") // it rides on the choices' first chunks
	}
	choices := map[string]obj{}
	for pos, c := range b["choices"].([]any) {
		c := c.(obj)
		idx, ok := c["index"]
		if !ok {
			idx = json.Number(fmt.Sprint(pos))
		}
		a := obj{"index": idx, "finish_reason": "stop", "stop_reason": nil}
		if fr := c["finish_reason"]; fr != nil {
			a["finish_reason"] = fr
		}
		if x := c["stop_reason"]; x != nil {
			a["stop_reason"] = x
		}
		if x := c["logprobs"]; x != nil {
			a["logprobs"] = x
		}
		if x := c["token_ids"]; x != nil {
			a["token_ids"] = x
		}
		choices[fmt.Sprint(idx)] = a
		if !chat {
			if x := c["prompt_token_ids"]; x != nil {
				a["prompt_token_ids"] = x
			}
			a["text"] = ""
			if t, ok := str(c["text"]); ok {
				a["text"] = t
			}
			continue
		}
		m, _ := c["message"].(obj)
		a["role"] = "assistant"
		if r, ok := str(m["role"]); ok {
			a["role"] = r
		}
		a["content"] = "" // vLLM's first chunk: content ""
		if s, ok := str(m["content"]); ok {
			a["content"] = s
		}
		for _, k := range []string{"reasoning", "reasoning_content"} {
			if s, ok := str(m[k]); ok && s != "" {
				a[k] = s
			}
		}
		if list, ok := m["tool_calls"].([]any); ok && len(list) > 0 {
			calls := map[string]obj{}
			for k, tc := range list {
				tc := tc.(obj)
				fn := tc["function"].(obj)
				t := obj{"index": json.Number(fmt.Sprint(k)), "type": "function", "name": fn["name"], "arguments": ""}
				if x, ok := tc["id"]; ok && x != nil {
					t["id"] = x
				}
				if x, ok := str(tc["type"]); ok {
					t["type"] = x
				}
				if x, ok := str(fn["arguments"]); ok {
					t["arguments"] = x
				}
				calls[fmt.Sprint(k)] = t
			}
			a["tool_calls"] = calls
		}
	}
	out["choices"] = choices
	return out, nil
}

// reassembleMessages reads a Messages stream as the Anthropic SDK's
// MessageStream does, checking the grammar: every event named as its
// data's type; message_start; for each content block in index order
// content_block_start, deltas of its kind, content_block_stop; one
// message_delta; message_stop, last.
func reassembleMessages(stream []byte) (obj, error) {
	evs, err := events(stream)
	if err != nil {
		return nil, err
	}
	var msg obj
	var content []any
	open := -1 // the block between its start and stop
	jsonBuf := map[int]string{}
	state := "start"
	for n, e := range evs {
		v, err := decode(e.Data)
		if err != nil {
			return nil, fmt.Errorf("event %d: %w", n, err)
		}
		ev, ok := v.(obj)
		if !ok || ev["type"] != e.Name {
			return nil, fmt.Errorf("event %d: named %q, data %s", n, e.Name, e.Data)
		}
		index := func() (int, error) {
			i, err := ev["index"].(json.Number).Int64()
			if err != nil {
				return 0, fmt.Errorf("event %d: index %v", n, ev["index"])
			}
			return int(i), nil
		}
		switch e.Name {
		case "message_start":
			if state != "start" {
				return nil, fmt.Errorf("event %d: message_start in state %s", n, state)
			}
			msg = ev["message"].(obj)
			if c, ok := msg["content"].([]any); !ok || len(c) != 0 {
				return nil, fmt.Errorf("message_start's content is not empty: %s", e.Data)
			}
			state = "blocks"
		case "content_block_start":
			i, err := index()
			if err != nil || state != "blocks" || open != -1 || i != len(content) {
				return nil, fmt.Errorf("event %d: content_block_start %d out of order (%v)", n, i, err)
			}
			content = append(content, maps.Clone(ev["content_block"].(obj)))
			open = i
		case "content_block_delta":
			i, err := index()
			if err != nil || i != open {
				return nil, fmt.Errorf("event %d: a delta for block %d while %d is open", n, i, open)
			}
			b := content[i].(obj)
			d := ev["delta"].(obj)
			switch d["type"] {
			case "text_delta":
				if b["type"] != "text" {
					return nil, fmt.Errorf("event %d: text_delta for a %v block", n, b["type"])
				}
				b["text"] = b["text"].(string) + d["text"].(string)
			case "thinking_delta":
				if b["type"] != "thinking" {
					return nil, fmt.Errorf("event %d: thinking_delta for a %v block", n, b["type"])
				}
				b["thinking"] = b["thinking"].(string) + d["thinking"].(string)
			case "signature_delta":
				if b["type"] != "thinking" {
					return nil, fmt.Errorf("event %d: signature_delta for a %v block", n, b["type"])
				}
				b["signature"] = d["signature"]
			case "input_json_delta":
				if b["type"] != "tool_use" {
					return nil, fmt.Errorf("event %d: input_json_delta for a %v block", n, b["type"])
				}
				jsonBuf[i] += d["partial_json"].(string)
			default:
				return nil, fmt.Errorf("event %d: delta type %v", n, d["type"])
			}
		case "content_block_stop":
			i, err := index()
			if err != nil || i != open {
				return nil, fmt.Errorf("event %d: stop of block %d while %d is open", n, i, open)
			}
			if s, ok := jsonBuf[i]; ok {
				in, err := decode([]byte(s))
				if err != nil {
					return nil, fmt.Errorf("block %d: partial_json %q: %w", i, s, err)
				}
				content[i].(obj)["input"] = in
			}
			open = -1
		case "message_delta":
			if state != "blocks" || open != -1 {
				return nil, fmt.Errorf("event %d: message_delta in state %s", n, state)
			}
			d := ev["delta"].(obj)
			msg["stop_reason"], msg["stop_sequence"] = d["stop_reason"], d["stop_sequence"]
			u := msg["usage"].(obj)
			maps.Copy(u, ev["usage"].(obj))
			state = "delta"
		case "message_stop":
			if state != "delta" || n != len(evs)-1 {
				return nil, fmt.Errorf("event %d: message_stop in state %s", n, state)
			}
			state = "stopped"
		default:
			return nil, fmt.Errorf("event %d: unknown event %q", n, e.Name)
		}
	}
	if state != "stopped" {
		return nil, fmt.Errorf("the stream ended in state %s", state)
	}
	if content == nil {
		content = []any{}
	}
	msg["content"] = content
	return msg, nil
}

// expectMessages is the body as the Anthropic SDK's final message must be:
// the body itself, with the members a stream always sets (stop_reason,
// stop_sequence and usage's tokens) where it lacks them.
func expectMessages(body []byte) (obj, error) {
	v, err := decode(body)
	if err != nil {
		return nil, err
	}
	m := v.(obj)
	for _, k := range []string{"stop_reason", "stop_sequence"} {
		if _, ok := m[k]; !ok {
			m[k] = nil
		}
	}
	u, ok := m["usage"].(obj)
	if !ok {
		u = obj{"input_tokens": json.Number("0")}
		m["usage"] = u
	}
	if _, ok := u["output_tokens"]; !ok {
		u["output_tokens"] = json.Number("0")
	}
	return m, nil
}

// roundTrip writes body as api's stream and checks it with the oracle;
// it returns the stream.
func roundTrip(api streamsynth.API, body []byte, opt streamsynth.Options) ([]byte, error) {
	var buf bytes.Buffer
	if err := api.Write(&buf, body, opt); err != nil {
		return nil, err
	}
	var got, want obj
	var err error
	switch api {
	case streamsynth.Messages:
		if got, err = reassembleMessages(buf.Bytes()); err == nil {
			want, err = expectMessages(body)
		}
	default:
		chat := api == streamsynth.ChatCompletions
		if got, err = reassembleOpenAI(buf.Bytes(), chat); err == nil {
			want, err = expectOpenAI(body, chat, opt)
		}
	}
	if err != nil {
		return buf.Bytes(), fmt.Errorf("%w\nstream:\n%s", err, buf.Bytes())
	}
	if !reflect.DeepEqual(got, want) {
		g, _ := json.Marshal(got)
		w, _ := json.Marshal(want)
		return buf.Bytes(), fmt.Errorf("reassembled:\n%s\nwant:\n%s\nstream:\n%s", g, w, buf.Bytes())
	}
	return buf.Bytes(), nil
}

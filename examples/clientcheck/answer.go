package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"strings"
)

// reply is what an answer says, whatever its form (a body or a stream):
// its text, its tool calls (name and arguments or input, in order) and
// how it ended (finish_reason, stop_reason, or the Responses output's last
// item type). Ids and timestamps are left out: two engines draw their own.
type reply struct {
	text, calls, end string
}

// answerOf reads the reply of an answer on path.
func answerOf(path string, b []byte) reply {
	var r reply
	var calls strings.Builder
	if !bytes.HasPrefix(bytes.TrimSpace(b), []byte("{")) {
		// A stream: each data line in order.
		sc := bufio.NewScanner(bytes.NewReader(b))
		sc.Buffer(make([]byte, 0, 64<<10), 64<<20)
		var args []string // chat: each call's arguments, by index
		var names []string
		for sc.Scan() {
			data, ok := strings.CutPrefix(sc.Text(), "data:")
			if !ok || strings.TrimSpace(data) == "[DONE]" {
				continue
			}
			event(path, []byte(data), &r, &names, &args)
		}
		for i := range names {
			if names[i] == "" {
				continue // a Messages text block
			}
			if path == "/v1/messages" {
				args[i] = compact(json.RawMessage(args[i])) // as a body's input
			}
			calls.WriteString(names[i] + "(" + args[i] + ");")
		}
		if calls.Len() > 0 {
			r.calls = calls.String()
		}
		return r
	}
	var m map[string]json.RawMessage
	if json.Unmarshal(b, &m) != nil {
		return reply{text: string(b)}
	}
	whole(path, m, &r)
	return r
}

// whole reads a non-streaming answer (or Responses' final response).
func whole(path string, m map[string]json.RawMessage, r *reply) {
	var calls strings.Builder
	switch path {
	case "/v1/chat/completions", "/v1/completions":
		var ch []struct {
			Text    string
			Message struct {
				Content   *string
				ToolCalls []struct {
					Function struct{ Name, Arguments string }
				} `json:"tool_calls"`
			}
			FinishReason string `json:"finish_reason"`
		}
		_ = json.Unmarshal(m["choices"], &ch)
		if len(ch) > 0 {
			r.text, r.end = ch[0].Text, ch[0].FinishReason
			if ch[0].Message.Content != nil {
				r.text += *ch[0].Message.Content
			}
			for _, c := range ch[0].Message.ToolCalls {
				calls.WriteString(c.Function.Name + "(" + c.Function.Arguments + ");")
			}
		}
	case "/v1/responses":
		var out []struct {
			Type, Name, Arguments string
			Content               []struct{ Text string }
		}
		_ = json.Unmarshal(m["output"], &out)
		for _, it := range out {
			switch it.Type {
			case "message":
				for _, c := range it.Content {
					r.text += c.Text
				}
			case "function_call":
				calls.WriteString(it.Name + "(" + it.Arguments + ");")
			}
			r.end = it.Type
		}
		var status string
		_ = json.Unmarshal(m["status"], &status)
		r.end += "/" + status
	case "/v1/messages":
		var content []struct {
			Type, Text, Name string
			Input            json.RawMessage
		}
		_ = json.Unmarshal(m["content"], &content)
		for _, c := range content {
			switch c.Type {
			case "text":
				r.text += c.Text
			case "tool_use":
				calls.WriteString(c.Name + "(" + compact(c.Input) + ");")
			}
		}
		_ = json.Unmarshal(m["stop_reason"], &r.end)
	}
	r.calls = calls.String()
}

// event reads one data line of a stream into r; names and args gather
// streamed calls (chat's by index, Messages' by content block).
func event(path string, data []byte, r *reply, names, args *[]string) {
	var ev struct {
		Type     string
		Response map[string]json.RawMessage
		Choices  []struct {
			Text  string
			Delta struct {
				Content   string
				ToolCalls []struct {
					Index    int
					Function struct{ Name, Arguments string }
				} `json:"tool_calls"`
			}
			FinishReason *string `json:"finish_reason"`
		}
		Index        int
		ContentBlock struct{ Type, Name, Text string } `json:"content_block"`
		Delta        struct {
			Type, Text  string
			PartialJSON string `json:"partial_json"`
			StopReason  string `json:"stop_reason"`
		}
	}
	if json.Unmarshal(data, &ev) != nil {
		return
	}
	grow := func(i int) {
		for len(*names) <= i {
			*names, *args = append(*names, ""), append(*args, "")
		}
	}
	switch path {
	case "/v1/chat/completions", "/v1/completions":
		for _, c := range ev.Choices {
			r.text += c.Text + c.Delta.Content
			for _, tc := range c.Delta.ToolCalls {
				grow(tc.Index)
				(*names)[tc.Index] += tc.Function.Name
				(*args)[tc.Index] += tc.Function.Arguments
			}
			if c.FinishReason != nil {
				r.end = *c.FinishReason
			}
		}
	case "/v1/responses":
		if ev.Type == "response.completed" || ev.Type == "response.incomplete" {
			whole(path, ev.Response, r)
		}
	case "/v1/messages":
		switch ev.Type {
		case "content_block_start":
			if ev.ContentBlock.Type == "tool_use" {
				grow(ev.Index)
				(*names)[ev.Index] = ev.ContentBlock.Name
			}
			r.text += ev.ContentBlock.Text
		case "content_block_delta":
			r.text += ev.Delta.Text
			if ev.Delta.PartialJSON != "" {
				grow(ev.Index)
				(*args)[ev.Index] += ev.Delta.PartialJSON
			}
		case "message_delta":
			r.end = ev.Delta.StopReason
		}
	}
}

// compact returns JSON without insignificant space (the input as text
// when it is not JSON).
func compact(b json.RawMessage) string {
	var buf bytes.Buffer
	if json.Compact(&buf, b) != nil {
		return string(b)
	}
	return buf.String()
}

// lastInput says what a request ends with: a tool's result or a user's
// text (or the last item's type).
func lastInput(path string, b []byte) string {
	var m struct {
		Messages []struct {
			Role    string
			Content json.RawMessage
		}
		Input  json.RawMessage
		Prompt json.RawMessage
	}
	if json.Unmarshal(b, &m) != nil {
		return "unparsed"
	}
	switch path {
	case "/v1/responses":
		var items []struct{ Type, Role string }
		if json.Unmarshal(m.Input, &items) != nil || len(items) == 0 {
			return "user_text"
		}
		last := items[len(items)-1]
		if last.Type == "function_call_output" {
			return "tool_result"
		}
		return "user_text"
	case "/v1/completions":
		return "prompt"
	}
	if len(m.Messages) == 0 {
		return "none"
	}
	last := m.Messages[len(m.Messages)-1]
	if last.Role == "tool" || bytes.Contains(last.Content, []byte(`"tool_result"`)) {
		return "tool_result"
	}
	return "user_text"
}

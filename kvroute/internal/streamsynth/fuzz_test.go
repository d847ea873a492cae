package streamsynth_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"testing"

	"github.com/bidikv/bidikv/kvroute/internal/streamsynth"
)

// FuzzWrite: for any body, Write either refuses it as ErrMalformed having
// written nothing, or writes a stream that the repository's SSE reader
// parses, that follows the API's event grammar and that reassembles, the
// way clients reassemble, to the body's content (the oracle decodes the
// body with encoding/json, independently of the synthesizer).
func FuzzWrite(f *testing.F) {
	for _, c := range chatCases {
		f.Add(uint8(streamsynth.ChatCompletions), []byte(c.body), true, false)
	}
	for _, c := range completionCases {
		f.Add(uint8(streamsynth.Completions), []byte(c.body), false, false)
	}
	for _, c := range messagesCases {
		f.Add(uint8(streamsynth.Messages), []byte(c.body), false, false)
	}
	f.Add(uint8(streamsynth.ChatCompletions), []byte(`{"choices":[{"message":{"content":"a\u0000\ud800b"}}],"usage":{"prompt_tokens":1}}`), true, true)
	f.Add(uint8(streamsynth.Messages), []byte(`{"con\u0074ent":[{"type":"tool_use","input":"\u2028 \"x\" \\"}],"usage":null}`), false, false)
	f.Fuzz(func(t *testing.T, api uint8, body []byte, usage, continuous bool) {
		a := streamsynth.API(api%3 + 1)
		opt := streamsynth.Options{IncludeUsage: usage, ContinuousUsage: continuous}
		var buf bytes.Buffer
		err := a.Write(&buf, body, opt)
		if err != nil {
			if !errors.Is(err, streamsynth.ErrMalformed) {
				t.Fatalf("%v: %v", a, err)
			}
			if buf.Len() != 0 {
				t.Fatalf("%v refused %q but wrote %q", a, body, buf.Bytes())
			}
			return
		}
		if _, err := roundTrip(a, body, opt); err != nil {
			t.Fatalf("%v %q: %v", a, body, err)
		}
	})
}

// FuzzWriteShapes builds valid answers of every shape from the fuzzer's
// bytes (choices, reasoning, tool calls, logprobs, token ids, content
// blocks of each type, usage or none) around its text, which lands in
// every member a stream carries as text, and checks each with the oracle:
// no valid answer may be refused or reassemble differently.
func FuzzWriteShapes(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 4, 5, 6, 7}, "Listing the files.")
	f.Add([]byte{255, 254, 3, 9, 17, 33, 65, 129}, "a\nb\t\"c\" \\ \u00e9 \U0001F600 \u2028 </script>")
	f.Add([]byte{7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7}, `{"path": "pkg/", "n": [1, 2.5e3]}`)
	f.Add([]byte{1}, "")
	f.Fuzz(func(t *testing.T, shape []byte, text string) {
		next := func() byte {
			if len(shape) == 0 {
				return 0
			}
			b := shape[0]
			shape = shape[1:]
			return b
		}
		for _, a := range []streamsynth.API{streamsynth.ChatCompletions, streamsynth.Completions, streamsynth.Messages} {
			body := genBody(a, next, text)
			for _, opt := range []streamsynth.Options{{}, {IncludeUsage: true}, {IncludeUsage: true, ContinuousUsage: true}} {
				if _, err := roundTrip(a, body, opt); err != nil {
					t.Fatalf("%v %s: %v", a, body, err)
				}
			}
		}
	})
}

// genBody builds a valid answer of api from the choices next makes.
func genBody(a streamsynth.API, next func() byte, text string) []byte {
	pick := func(vals ...any) any { return vals[int(next())%len(vals)] }
	// asJSON is text when it is JSON, else an object holding it.
	asJSON := func() any {
		var v any
		if json.Unmarshal([]byte(text), &v) == nil {
			return v
		}
		return map[string]any{"text": text, "n": 1}
	}
	usage := map[string]any{"prompt_tokens": 812, "total_tokens": 830, "completion_tokens": 18}
	var body map[string]any
	switch a {
	case streamsynth.ChatCompletions, streamsynth.Completions:
		body = map[string]any{"id": "x-" + text, "created": 1767225600, "model": pick("m", text)}
		if next()%4 != 0 {
			body["usage"] = usage
		}
		if next()%3 == 0 {
			body["system_fingerprint"] = "fp"
		}
		var choices []any
		n := int(next()%3) + 1
		for i := range n {
			c := map[string]any{"index": i, "finish_reason": pick("stop", "length", "tool_calls", nil), "stop_reason": pick(nil, 151645, text)}
			if next()%4 == 0 {
				c["logprobs"] = map[string]any{"content": []any{map[string]any{"token": text, "logprob": -0.5}}}
			}
			if next()%4 == 0 {
				c["token_ids"] = []int{1, 2, 3}
			}
			if a == streamsynth.Completions {
				c["text"] = pick(text, "", nil)
				if next()%4 == 0 {
					c["prompt_token_ids"] = []int{4, 5}
				}
			} else {
				m := map[string]any{"role": "assistant", "content": pick(text, "", nil)}
				switch next() % 4 {
				case 1:
					m["reasoning"] = text
				case 2:
					m["reasoning_content"] = text
				case 3:
					m["reasoning"], m["reasoning_content"] = text, text
				}
				var calls []any
				for k := range int(next() % 4) {
					fn := map[string]any{"name": pick("ls", text)}
					if next()%5 != 0 {
						args, _ := json.Marshal(asJSON())
						fn["arguments"] = pick(string(args), text, "")
					}
					tc := map[string]any{"id": fmt.Sprint("call_", k), "type": "function", "function": fn}
					if next()%5 == 0 {
						delete(tc, "type")
					}
					calls = append(calls, tc)
				}
				if calls != nil {
					m["tool_calls"] = calls
				}
				c["message"] = m
			}
			choices = append(choices, c)
		}
		body["choices"] = choices
		if next()%5 == 0 && a == streamsynth.ChatCompletions {
			body["prompt_token_ids"] = []int{9, 8}
		}
	case streamsynth.Messages:
		body = map[string]any{"id": "msg-" + text, "type": "message", "role": "assistant", "model": "m",
			"stop_reason": pick("end_turn", "max_tokens", "tool_use", "stop_sequence", nil), "stop_sequence": pick(nil, text)}
		switch next() % 3 {
		case 0:
			body["usage"] = map[string]any{"input_tokens": 5, "output_tokens": 9}
		case 1:
			body["usage"] = map[string]any{"input_tokens": 5, "cache_read_input_tokens": 3, "output_tokens": 9}
		}
		content := []any{}
		for range int(next() % 5) {
			switch next() % 4 {
			case 0:
				content = append(content, map[string]any{"type": "text", "text": text})
			case 1:
				b := map[string]any{"type": "thinking", "thinking": text}
				if next()%3 != 0 {
					b["signature"] = pick("sig", text, "")
				}
				content = append(content, b)
			case 2:
				content = append(content, map[string]any{"type": "tool_use", "id": "t", "name": "Bash", "input": asJSON()})
			case 3:
				content = append(content, map[string]any{"type": "redacted_thinking", "data": text})
			}
		}
		body["content"] = content
	}
	b, err := json.Marshal(body)
	if err != nil {
		panic(err)
	}
	return b
}

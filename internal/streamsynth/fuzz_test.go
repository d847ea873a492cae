package streamsynth_test

import (
	"bytes"
	"errors"
	"testing"

	"github.com/bidikv/bidikv/internal/streamsynth"
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

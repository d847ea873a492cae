package streamsynth_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/internal/streamsynth"
)

// answers of size ~n bytes per API, with the members vLLM's answers have:
// a long content with reasoning and two tool calls (chat), a long text
// (completions), thinking, text and two tool_use blocks (messages).
func benchBody(a streamsynth.API, n int) []byte {
	const phrase = "Listing the directory first, then the tests. "
	text := strings.Repeat(phrase, n/len(phrase)+1)[:n]
	var body any
	switch a {
	case streamsynth.ChatCompletions:
		body = map[string]any{"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
			"choices": []any{map[string]any{"index": 0, "finish_reason": "tool_calls", "stop_reason": nil, "logprobs": nil,
				"token_ids": nil, "routed_experts": nil,
				"message": map[string]any{"role": "assistant", "content": text, "reasoning": text[:n/4],
					"refusal": nil, "annotations": nil, "audio": nil, "function_call": nil,
					"tool_calls": []any{
						map[string]any{"id": "a", "type": "function", "function": map[string]any{"name": "read", "arguments": `{"file":"a.go"}`}},
						map[string]any{"id": "b", "type": "function", "function": map[string]any{"name": "read", "arguments": `{"file":"b.go"}`}},
					}}}},
			"usage": map[string]any{"prompt_tokens": 812, "total_tokens": 830, "completion_tokens": 18}}
	case streamsynth.Completions:
		body = map[string]any{"id": "cmpl-1", "created": 1, "model": "m",
			"choices": []any{map[string]any{"index": 0, "text": text, "finish_reason": "stop", "stop_reason": nil,
				"logprobs": nil, "prompt_logprobs": nil, "routed_experts": nil}},
			"usage": map[string]any{"prompt_tokens": 4, "total_tokens": 8, "completion_tokens": 4}}
	case streamsynth.Messages:
		body = map[string]any{"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
			"stop_reason": "tool_use", "stop_sequence": nil, "usage": map[string]any{"input_tokens": 2048, "output_tokens": 37},
			"content": []any{
				map[string]any{"type": "thinking", "thinking": text[:n/4], "signature": "9c1e"},
				map[string]any{"type": "text", "text": text},
				map[string]any{"type": "tool_use", "id": "t1", "name": "Bash", "input": map[string]any{"command": "go test ./..."}},
				map[string]any{"type": "tool_use", "id": "t2", "name": "Read", "input": map[string]any{"file_path": "/a.go"}},
			}}
	}
	b, err := json.Marshal(body)
	if err != nil {
		panic(err)
	}
	return b
}

var apis = []streamsynth.API{streamsynth.ChatCompletions, streamsynth.Completions, streamsynth.Messages}

// The allocations of Write do not grow with the answer: the answer is
// held once, in its body. Measured for answers of 1 KiB and 1 MiB, into a
// writer that keeps nothing, and into a *bufio.Writer the caller reuses
// (the package's own buffer is then not needed).
func TestWriteAllocations(t *testing.T) {
	for _, a := range apis {
		small, large := benchBody(a, 1<<10), benchBody(a, 1<<20)
		opt := streamsynth.Options{IncludeUsage: true}
		allocs := func(body []byte, w io.Writer) float64 {
			return testing.AllocsPerRun(20, func() {
				require.NoError(t, a.Write(w, body, opt))
			})
		}
		s, l := allocs(small, io.Discard), allocs(large, io.Discard)
		assert.Equal(t, s, l, "%v: allocations grow with the answer", a)
		assert.LessOrEqual(t, l, 2.0, "%v", a)
		bw := bufio.NewWriterSize(io.Discard, 8<<10)
		s2, l2 := allocs(small, bw), allocs(large, bw)
		assert.Equal(t, s2, l2, "%v: allocations grow with the answer", a)
		assert.Less(t, l2, l, "%v: a caller's bufio.Writer saves the buffer", a)
		t.Logf("%v: %.0f allocations per answer (%.0f with the caller's bufio.Writer)", a, l, l2)
	}
}

// BenchmarkWrite: per answer, into io.Discard.
//
//	go test -run '^$' -bench BenchmarkWrite -benchmem ./kvroute/internal/streamsynth
func BenchmarkWrite(b *testing.B) {
	for _, a := range apis {
		for _, n := range []int{4 << 10, 256 << 10} {
			body := benchBody(a, n)
			b.Run(fmt.Sprintf("%s/%dKiB", strings.TrimPrefix(a.String(), "/v1/"), n>>10), func(b *testing.B) {
				b.ReportAllocs()
				b.SetBytes(int64(len(body)))
				for b.Loop() {
					if err := a.Write(io.Discard, body, streamsynth.Options{IncludeUsage: true}); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

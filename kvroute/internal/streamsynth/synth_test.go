package streamsynth_test

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/internal/capture"
	"github.com/bidikv/bidikv/kvroute/internal/streamsynth"
	"github.com/bidikv/bidikv/sse"
)

// Chat completion bodies as vLLM answers them (non-streaming, the handle
// already stripped).
const (
	chatHead = `{"id":"chatcmpl-7f3","object":"chat.completion","created":1767225600,"model":"Qwen/Qwen3-32B",`
	chatTail = `,"service_tier":null,"system_fingerprint":null,"usage":{"prompt_tokens":812,"total_tokens":830,"completion_tokens":18,"prompt_tokens_details":null},"prompt_logprobs":null,"prompt_token_ids":null}`
)

func chatBody(choices string) string { return chatHead + `"choices":[` + choices + `]` + chatTail }

func chatChoice(message, finish string) string {
	return `{"index":0,"message":` + message + `,"logprobs":null,"finish_reason":` + finish + `,"stop_reason":null,"token_ids":null}`
}

// One table per API: each case is a body; every case runs with usage off
// and on (and continuous usage), and must round-trip through the oracle.
var chatCases = []struct{ name, body string }{
	{"text", chatBody(chatChoice(`{"role":"assistant","content":"Listing the directory first.","refusal":null,"annotations":null,"audio":null,"function_call":null,"tool_calls":[],"reasoning":null}`, `"stop"`))},
	{"text with escapes and unicode", chatBody(chatChoice(`{"role":"assistant","content":"line 1\nline 2\t\"q\" \\ \u00e9 \ud83d\ude00 </script>","tool_calls":[]}`, `"stop"`))},
	{"reasoning", chatBody(chatChoice(`{"role":"assistant","content":"The tests fail in m3.","tool_calls":[],"reasoning":"The user wants\nthe failing module."}`, `"stop"`))},
	{"reasoning_content (older engines)", chatBody(chatChoice(`{"role":"assistant","content":"ok","reasoning_content":"thinking"}`, `"stop"`))},
	{"reasoning in both members (engines in transition)", chatBody(chatChoice(`{"role":"assistant","content":"ok","reasoning":"r","reasoning_content":"r"}`, `"stop"`))},
	{"one tool call", chatBody(chatChoice(`{"role":"assistant","content":null,"tool_calls":[{"id":"chatcmpl-tool-1","type":"function","function":{"name":"list_files","arguments":"{\"path\": \"pkg/\", \"depth\": 2}"}}],"reasoning":null}`, `"tool_calls"`))},
	{"parallel tool calls", chatBody(chatChoice(`{"role":"assistant","content":"Reading both.","tool_calls":[{"id":"a","type":"function","function":{"name":"read","arguments":"{\"f\":\"a.go\"}"}},{"id":"b","type":"function","function":{"name":"read","arguments":"{\"f\":\"b.go\"}"}},{"id":"c","type":"function","function":{"name":"run_tests","arguments":""}}]}`, `"tool_calls"`))},
	{"tool call with reasoning", chatBody(chatChoice(`{"role":"assistant","content":"","reasoning":"need ls","tool_calls":[{"id":"x","type":"function","function":{"name":"ls","arguments":"{}"}}]}`, `"tool_calls"`))},
	{"empty content", chatBody(chatChoice(`{"role":"assistant","content":"","tool_calls":[]}`, `"stop"`))},
	{"null content, no message members", chatBody(chatChoice(`{"role":"assistant","content":null}`, `"stop"`))},
	{"length finish", chatBody(`{"index":0,"message":{"role":"assistant","content":"truncat"},"logprobs":null,"finish_reason":"length","stop_reason":null}`)},
	{"stop string", chatBody(`{"index":0,"message":{"role":"assistant","content":"done"},"logprobs":null,"finish_reason":"stop","stop_reason":"</done>"}`)},
	{"stop token", chatBody(`{"index":0,"message":{"role":"assistant","content":"done"},"logprobs":null,"finish_reason":"stop","stop_reason":151645}`)},
	{"logprobs", chatBody(`{"index":0,"message":{"role":"assistant","content":"Hi there"},"logprobs":{"content":[{"token":"Hi","logprob":-0.01,"bytes":[72,105],"top_logprobs":[]},{"token":" there","logprob":-0.2,"bytes":null,"top_logprobs":[]}]},"finish_reason":"stop","stop_reason":null}`)},
	{"token ids asked for", chatHead + `"choices":[{"index":0,"message":{"role":"assistant","content":"Hi"},"logprobs":null,"finish_reason":"stop","stop_reason":null,"token_ids":[9707,151645]}],"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2},"prompt_token_ids":[1,2,3]}`},
	{"n = 2", chatBody(`{"index":0,"message":{"role":"assistant","content":"one"},"finish_reason":"stop","stop_reason":null},{"index":1,"message":{"role":"assistant","content":"two","tool_calls":[{"id":"t","type":"function","function":{"name":"f","arguments":"{}"}}]},"finish_reason":"tool_calls","stop_reason":null}`)},
	{"fingerprint", chatHead + `"choices":[{"index":0,"message":{"role":"assistant","content":"x"},"finish_reason":"stop"}],"system_fingerprint":"fp_1","usage":{"prompt_tokens":1,"total_tokens":2,"completion_tokens":1}}`},
	{"no choices", chatHead + `"choices":[],"usage":{"prompt_tokens":1,"total_tokens":1,"completion_tokens":0}}`},
	{"pretty-printed", "{\n  \"id\": \"c\",\n  \"created\": 1,\r\n  \"model\": \"m\",\n  \"choices\": [\n    {\n      \"index\": 0,\n      \"message\": {\"role\": \"assistant\", \"content\": \"a\\nb\"},\n      \"logprobs\": {\n\"content\": []\n},\n      \"finish_reason\": \"stop\"\n    }\n  ],\n  \"usage\": {\n    \"prompt_tokens\": 1,\n    \"total_tokens\": 2,\n    \"completion_tokens\": 1\n  }\n}\n"},
}

var completionCases = []struct{ name, body string }{
	{"text", `{"id":"cmpl-1","object":"text_completion","created":1767225600,"model":"m","choices":[{"index":0,"text":" world.\nNext","logprobs":null,"finish_reason":"length","stop_reason":null,"prompt_logprobs":null}],"usage":{"prompt_tokens":4,"total_tokens":8,"completion_tokens":4},"system_fingerprint":null}`},
	{"empty text", `{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"stop","stop_reason":151643}],"usage":{"prompt_tokens":4,"total_tokens":5,"completion_tokens":1}}`},
	{"logprobs and token ids", `{"id":"cmpl-1","created":1,"model":"m","choices":[{"index":0,"text":"ab","logprobs":{"text_offset":[0,1],"token_logprobs":[-0.1,-0.2],"tokens":["a","b"],"top_logprobs":[null,null]},"finish_reason":"stop","stop_reason":null,"prompt_token_ids":[5,6],"token_ids":[7,8]}],"usage":{"prompt_tokens":2,"total_tokens":4,"completion_tokens":2}}`},
	{"two prompts", `{"id":"cmpl-1","created":1,"model":"m","choices":[{"index":0,"text":"x","finish_reason":"stop"},{"index":1,"text":"y","finish_reason":"length"}],"usage":{"prompt_tokens":2,"total_tokens":4,"completion_tokens":2}}`},
}

// Messages bodies as vLLM's Anthropic endpoint answers them.
const msgHead = `{"id":"chatcmpl-9a1","type":"message","role":"assistant","content":[`

func msgBody(content, stop, usage string) string {
	return msgHead + content + `],"model":"claude-sonnet-4-5","stop_reason":` + stop + `,"stop_sequence":null,"usage":` + usage + `}`
}

const msgUsage = `{"input_tokens":2048,"output_tokens":37}`

var messagesCases = []struct{ name, body string }{
	{"text", msgBody(`{"type":"text","text":"I'll list the files first."}`, `"end_turn"`, msgUsage)},
	{"thinking and text", msgBody(`{"type":"thinking","thinking":"The user wants\nthe tests.","signature":"5f0e1c7a9b2d4e8f"},{"type":"text","text":"Running them."}`, `"end_turn"`, msgUsage)},
	{"tool_use with JSON input", msgBody(`{"type":"text","text":"Let me look."},{"type":"tool_use","id":"chatcmpl-tool-1","name":"Bash","input":{"command":"go test ./...","timeout":120000,"nested":{"a":[1,2.50,"x\"y"],"b":null,"u":"\u00e9\ud83d\ude00"}}}`, `"tool_use"`, msgUsage)},
	{"parallel tool_use", msgBody(`{"type":"tool_use","id":"a","name":"Read","input":{"file_path":"/a.go"}},{"type":"tool_use","id":"b","name":"Read","input":{"file_path":"/b.go"}}`, `"tool_use"`, msgUsage)},
	{"tool_use with empty input", msgBody(`{"type":"tool_use","id":"a","name":"TodoRead","input":{}}`, `"tool_use"`, msgUsage)},
	{"thinking, text, tool_use", msgBody(`{"type":"thinking","thinking":"plan","signature":"s"},{"type":"text","text":"ok"},{"type":"tool_use","id":"t","name":"Edit","input":{"old":"a\nb","new":"c"}}`, `"tool_use"`, msgUsage)},
	{"empty content", msgBody(``, `"end_turn"`, `{"input_tokens":10,"output_tokens":1}`)},
	{"max_tokens", msgBody(`{"type":"text","text":"truncat"}`, `"max_tokens"`, msgUsage)},
	{"stop_sequence", msgHead + `{"type":"text","text":"done"}],"model":"m","stop_reason":"stop_sequence","stop_sequence":"</answer>","usage":` + msgUsage + `}`},
	{"thinking without signature, empty text", msgBody(`{"type":"thinking","thinking":"t"},{"type":"text","text":""}`, `"end_turn"`, msgUsage)},
	{"a block of another type", msgBody(`{"type":"redacted_thinking","data":"EmwKAhgB"},{"type":"text","text":"x","citations":null}`, `"end_turn"`, msgUsage)},
	{"usage with cache counts", msgBody(`{"type":"text","text":"x"}`, `"end_turn"`, `{"input_tokens":5,"cache_creation_input_tokens":0,"cache_read_input_tokens":2000,"output_tokens":3}`)},
	{"no usage, no stop members", `{"id":"m","type":"message","role":"assistant","content":[{"type":"text","text":"x"}],"model":"m"}`},
	{"pretty-printed", "{\n \"id\": \"m\",\n \"type\": \"message\",\n \"content\": [\n  {\"type\": \"tool_use\", \"id\": \"t\", \"name\": \"n\", \"input\": {\n   \"a\": [1,\r\n 2]\n  }}\n ],\n \"stop_reason\": \"tool_use\",\n \"usage\": {\"input_tokens\": 1,\n \"output_tokens\": 2}\n}"},
}

var optionSets = []struct {
	name string
	opt  streamsynth.Options
}{
	{"usage off", streamsynth.Options{}},
	{"usage on", streamsynth.Options{IncludeUsage: true}},
	{"continuous usage", streamsynth.Options{IncludeUsage: true, ContinuousUsage: true}},
}

func TestChatCompletions(t *testing.T) {
	for _, c := range chatCases {
		for _, o := range optionSets {
			t.Run(c.name+"/"+o.name, func(t *testing.T) {
				stream, err := roundTrip(streamsynth.ChatCompletions, []byte(c.body), o.opt)
				require.NoError(t, err)
				usageChunks := strings.Count(string(stream), `"choices":[],"usage"`)
				if o.opt.IncludeUsage && !strings.Contains(c.body, `"usage":null`) {
					assert.Equal(t, 1, usageChunks, "one usage chunk")
				} else {
					assert.Zero(t, usageChunks, "no usage chunk unless asked")
				}
				checkCapture(t, stream, c.body)
			})
		}
	}
}

func TestCompletions(t *testing.T) {
	for _, c := range completionCases {
		for _, o := range optionSets {
			t.Run(c.name+"/"+o.name, func(t *testing.T) {
				stream, err := roundTrip(streamsynth.Completions, []byte(c.body), o.opt)
				require.NoError(t, err)
				assert.Equal(t, o.opt.IncludeUsage, strings.Contains(string(stream), `"choices":[],"usage"`))
			})
		}
	}
}

func TestMessages(t *testing.T) {
	for _, c := range messagesCases {
		t.Run(c.name, func(t *testing.T) {
			_, err := roundTrip(streamsynth.Messages, []byte(c.body), streamsynth.Options{})
			require.NoError(t, err)
		})
	}
}

// The stream of a chat answer is what the router's own stream capture
// reads back: the same reply as the body (capture.Chunks with WithReply,
// as kvroute reads decode streams).
func checkCapture(t *testing.T, stream []byte, body string) {
	t.Helper()
	want, err := expectOpenAI([]byte(body), true, streamsynth.Options{})
	require.NoError(t, err)
	c0, ok := want["choices"].(map[string]obj)["0"]
	if !ok {
		return
	}
	c := capture.NewChunks(capture.WithReply())
	r := sse.NewReader(bytes.NewReader(stream))
	for {
		e, err := r.Next()
		if err != nil {
			break
		}
		_, err = c.Forward(e)
		require.NoError(t, err)
	}
	rep := c.Reply()
	assert.Equal(t, c0["content"], rep.Content)
	reasoning, _ := c0["reasoning"].(string)
	if reasoning == "" {
		reasoning, _ = c0["reasoning_content"].(string)
	}
	assert.Equal(t, reasoning, rep.Reasoning)
	assert.Equal(t, c0["finish_reason"], rep.FinishReason)
	assert.False(t, rep.Incomplete)
	if calls, ok := c0["tool_calls"].(map[string]obj); ok {
		assert.Equal(t, len(calls), strings.Count(string(rep.ToolCalls), `"function":`))
	}
}

// Malformed answers: nothing is written, the error is ErrMalformed.
func TestMalformed(t *testing.T) {
	for _, c := range []struct {
		api  streamsynth.API
		body string
	}{
		{streamsynth.ChatCompletions, `not json`},
		{streamsynth.ChatCompletions, `{"choices":[{"message":{"content":"a"}}]} trailing`},
		{streamsynth.ChatCompletions, `[]`},
		{streamsynth.ChatCompletions, `{"id":"x"}`},
		{streamsynth.ChatCompletions, `{"choices":{}}`},
		{streamsynth.ChatCompletions, `{"choices":[1]}`},
		{streamsynth.ChatCompletions, `{"choices":[{"message":{"content":["a"]}}]}`},
		{streamsynth.ChatCompletions, `{"choices":[{"message":{"reasoning":1}}]}`},
		{streamsynth.ChatCompletions, `{"choices":[{"message":{"tool_calls":[{"function":{"arguments":"{}"}}]}}]}`},
		{streamsynth.ChatCompletions, `{"choices":[{"message":{"tool_calls":[{"function":{"name":"f","arguments":{}}}]}}]}`},
		{streamsynth.ChatCompletions, `{"choices":[{"message":{"tool_calls":{}}}]}`},
		{streamsynth.ChatCompletions, `{"choices":[{"index":"0","message":{}}]}`},
		{streamsynth.ChatCompletions, `{"choices":[{"index":-1,"message":{}}]}`},
		{streamsynth.ChatCompletions, `{"choices":[{"index":1,"message":{}},{"message":{}}]}`},
		{streamsynth.ChatCompletions, `{"choices":[{"message":{}, "finish_reason":1}]}`},
		{streamsynth.ChatCompletions, `{"id":1,"choices":[]}`},
		{streamsynth.ChatCompletions, `{"created":"now","choices":[]}`},
		{streamsynth.ChatCompletions, `{"usage":[],"choices":[]}`},
		{streamsynth.Completions, `{"choices":[{"text":1}]}`},
		{streamsynth.Completions, `{"choices":[{"index":0},{"index":0}]}`},
		{streamsynth.Messages, `{"content":"text"}`},
		{streamsynth.Messages, `{"content":[{"text":"no type"}]}`},
		{streamsynth.Messages, `{"content":[{"type":"text"}]}`},
		{streamsynth.Messages, `{"content":[{"type":"thinking","thinking":"t","signature":1}]}`},
		{streamsynth.Messages, `{"content":[],"stop_reason":1}`},
		{streamsynth.Messages, `{"content":[],"usage":"x"}`},
	} {
		var buf bytes.Buffer
		err := c.api.Write(&buf, []byte(c.body), streamsynth.Options{IncludeUsage: true})
		assert.ErrorIs(t, err, streamsynth.ErrMalformed, "%v %s", c.api, c.body)
		assert.Zero(t, buf.Len(), "%v %s: nothing written", c.api, c.body)
	}
}

func TestForPath(t *testing.T) {
	for path, want := range map[string]streamsynth.API{
		"/v1/chat/completions": streamsynth.ChatCompletions,
		"/v1/completions":      streamsynth.Completions,
		"/v1/messages":         streamsynth.Messages,
	} {
		a, ok := streamsynth.ForPath(path)
		assert.True(t, ok, path)
		assert.Equal(t, want, a)
		assert.Equal(t, path, a.String())
	}
	_, ok := streamsynth.ForPath("/v1/responses")
	assert.False(t, ok, "Responses streams carry the handle: never buffered")
	assert.Error(t, streamsynth.API(0).Write(&bytes.Buffer{}, []byte(`{}`), streamsynth.Options{}))
}

// errWriter fails every write after n bytes.
type errWriter struct{ n int }

var errBroken = errors.New("client gone")

func (w *errWriter) Write(p []byte) (int, error) {
	if len(p) > w.n {
		return 0, errBroken
	}
	w.n -= len(p)
	return len(p), nil
}

// A client that goes away: Write returns the writer's error.
func TestWriteError(t *testing.T) {
	body := []byte(chatBody(chatChoice(`{"role":"assistant","content":"`+strings.Repeat("x", 10000)+`"}`, `"stop"`)))
	for _, n := range []int{0, 100, 5000} {
		err := streamsynth.ChatCompletions.Write(&errWriter{n: n}, body, streamsynth.Options{})
		assert.ErrorIs(t, err, errBroken)
	}
}

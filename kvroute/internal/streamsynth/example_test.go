package streamsynth_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"

	"github.com/bidikv/bidikv/kvroute/internal/streamsynth"
)

// A chat answer, as the decode engine gave it to a non-streaming leg,
// written to a client that asked for a stream with usage.
func ExampleAPI_Write_chat() {
	body := []byte(`{"id":"chatcmpl-1","object":"chat.completion","created":1767225600,"model":"m",` +
		`"choices":[{"index":0,"message":{"role":"assistant","content":"Listing the files.",` +
		`"tool_calls":[{"id":"call_1","type":"function","function":{"name":"ls","arguments":"{\"path\":\".\"}"}}]},` +
		`"logprobs":null,"finish_reason":"tool_calls","stop_reason":null}],` +
		`"usage":{"prompt_tokens":812,"total_tokens":830,"completion_tokens":18}}`)
	if err := streamsynth.ChatCompletions.Write(os.Stdout, body, streamsynth.Options{IncludeUsage: true}); err != nil {
		fmt.Println(err)
	}
	// Output:
	// data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1767225600,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}
	//
	// data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1767225600,"model":"m","choices":[{"index":0,"delta":{"content":"Listing the files."},"logprobs":null,"finish_reason":null}]}
	//
	// data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1767225600,"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"ls","arguments":""}}]},"logprobs":null,"finish_reason":null}]}
	//
	// data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1767225600,"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"path\":\".\"}"}}]},"logprobs":null,"finish_reason":null}]}
	//
	// data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1767225600,"model":"m","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"tool_calls","stop_reason":null}]}
	//
	// data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1767225600,"model":"m","choices":[],"usage":{"prompt_tokens":812,"total_tokens":830,"completion_tokens":18}}
	//
	// data: [DONE]
}

// A Messages answer with thinking and a tool call, written as Anthropic's
// event stream.
func ExampleAPI_Write_messages() {
	body := []byte(`{"id":"msg_1","type":"message","role":"assistant","content":[` +
		`{"type":"thinking","thinking":"Run the tests.","signature":"9c1e"},` +
		`{"type":"tool_use","id":"toolu_1","name":"Bash","input":{"command":"go test ./..."}}],` +
		`"model":"m","stop_reason":"tool_use","stop_sequence":null,"usage":{"input_tokens":2048,"output_tokens":37}}`)
	if err := streamsynth.Messages.Write(os.Stdout, body, streamsynth.Options{}); err != nil {
		fmt.Println(err)
	}
	// Output:
	// event: message_start
	// data: {"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],"model":"m","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":2048,"output_tokens":0}}}
	//
	// event: content_block_start
	// data: {"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":"","signature":""}}
	//
	// event: content_block_delta
	// data: {"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"Run the tests."}}
	//
	// event: content_block_delta
	// data: {"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"9c1e"}}
	//
	// event: content_block_stop
	// data: {"type":"content_block_stop","index":0}
	//
	// event: content_block_start
	// data: {"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_1","name":"Bash","input":{}}}
	//
	// event: content_block_delta
	// data: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"command\":\"go test ./...\"}"}}
	//
	// event: content_block_stop
	// data: {"type":"content_block_stop","index":1}
	//
	// event: message_delta
	// data: {"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"input_tokens":2048,"output_tokens":37}}
	//
	// event: message_stop
	// data: {"type":"message_stop"}
}

// How a router answers a streaming client from a non-streaming decode
// leg: the answer's headers, made a stream's, then the events.
func ExampleSetHeader() {
	answer := []byte(`{"id":"c","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}`)
	rec := httptest.NewRecorder()
	rec.Header().Set("Content-Type", "application/json")
	rec.Header().Set("Content-Length", "128")
	streamsynth.SetHeader(rec.Header())
	rec.WriteHeader(http.StatusOK)
	_ = streamsynth.ChatCompletions.Write(rec, answer, streamsynth.Options{})
	fmt.Println(rec.Header().Get("Content-Type"), rec.Header().Get("Content-Length") == "", rec.Flushed)
	// Output: text/event-stream; charset=utf-8 true true
}

package jsonraw

// intern converts a raw (escape-free) key to a string without allocating for
// the keys of OpenAI-style request bodies and messages and of Anthropic's
// messages and answers.
func intern(b []byte) string {
	switch string(b) {
	case "role":
		return "role"
	case "content":
		return "content"
	case "name":
		return "name"
	case "type":
		return "type"
	case "text":
		return "text"
	case "id":
		return "id"
	case "tool_calls":
		return "tool_calls"
	case "tool_call_id":
		return "tool_call_id"
	case "function":
		return "function"
	case "arguments":
		return "arguments"
	case "reasoning_content":
		return "reasoning_content"
	case "reasoning":
		return "reasoning"
	case "image_url":
		return "image_url"
	case "url":
		return "url"
	case "index":
		return "index"
	case "model":
		return "model"
	case "messages":
		return "messages"
	case "prompt":
		return "prompt"
	case "stream":
		return "stream"
	case "max_tokens":
		return "max_tokens"
	case "choices":
		return "choices"
	case "delta":
		return "delta"
	case "finish_reason":
		return "finish_reason"
	case "stop_reason":
		return "stop_reason"
	case "token_ids":
		return "token_ids"
	case "prompt_token_ids":
		return "prompt_token_ids"
	case "usage":
		return "usage"
	case "logprobs":
		return "logprobs"
	case "object":
		return "object"
	case "created":
		return "created"
	case "kv_transfer_params":
		return "kv_transfer_params"
	// Members of vLLM's answers (often null).
	case "refusal":
		return "refusal"
	case "annotations":
		return "annotations"
	case "audio":
		return "audio"
	case "function_call":
		return "function_call"
	case "routed_experts":
		return "routed_experts"
	case "prompt_logprobs":
		return "prompt_logprobs"
	// Anthropic's messages and answers.
	case "message":
		return "message"
	case "thinking":
		return "thinking"
	case "signature":
		return "signature"
	case "input":
		return "input"
	case "stop_sequence":
		return "stop_sequence"
	case "input_tokens":
		return "input_tokens"
	case "output_tokens":
		return "output_tokens"
	}
	return string(b)
}

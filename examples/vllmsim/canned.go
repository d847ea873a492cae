package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/bidikv/bidikv/internal/toytok"
)

// Canned mode (--canned prefill or --canned decode) is for router overhead
// runs only (examples/bench --overhead): the engine simulates nothing. It
// answers every request at once with fixed bytes and no KV, so that nearly
// all the CPU of a run is the router's and the client's:
//
//   - prefill: POST /v1/chat/completions gets a one-token completion with
//     a P handle; POST /v1/chat/completions/render gets the prompt's ids
//     under a toy tokenizer (internal/toytok).
//   - decode: a three-event stream ("Done, the tests pass.") whose final
//     chunk carries a D handle. With return_token_ids the first chunk
//     carries the prompt's toy ids and the others the reply's.
//
// Handles are the size vLLM's are: P's holds the prompt's blocks and D's
// the prompt's and reply's less the last token, one block id per
// --block-size tokens (16 by default, the router's default) in each of
// --kv-groups lists, counted with the toy tokenizer (toytok.PromptTokens,
// which reads the body without decoding it into values).
//
// An honest next turn (the messages, the reply, a new user message)
// renders to ids that begin with the handle's, so token verification
// passes. The toy tokenizer and template are internal/toytok's.
const (
	// cannedReply is the decode engine's reply.
	cannedReply = "Done, the tests pass."
)

// cannedKV is the canned engines' KV layout: the block size and KV groups
// of their handles,
// and the pool's size they report (num_gpu_blocks, the router's capacity).
type cannedKV struct{ blockSize, groups, poolBlocks int }

// cannedHandler returns the canned engine of role "prefill" or "decode".
func cannedHandler(role, model string, kv cannedKV) (http.Handler, error) {
	if kv.poolBlocks == 0 {
		kv.poolBlocks = toytok.PoolBlocks
	}
	if kv.blockSize < 1 || kv.groups < 1 {
		return nil, fmt.Errorf("canned engine: block size %d and KV groups %d must be at least 1", kv.blockSize, kv.groups)
	}
	var seq atomic.Int64
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) {})
	// The block size as vLLM exports it, so that the router checks the
	// canned handles' block counts as it checks a real engine's.
	start := time.Now().Unix()
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		fmt.Fprintf(w, "process_start_time_seconds %d\n", start)
		fmt.Fprintf(w, "vllm:cache_config_info{block_size=\"%d\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"%d\"} 1.0\n", kv.blockSize, kv.poolBlocks)
	})
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model","owned_by":"vllmsim"}]}`, model)
	})
	switch role {
	case "prefill":
		mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
			body, err := io.ReadAll(r.Body)
			if err != nil {
				return
			}
			prompt, err := toytok.PromptTokens(body)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			n := seq.Add(1)
			handle := toytok.GroupHandle(n, prompt, kv.blockSize, kv.groups, true)
			out := fmt.Appendf(make([]byte, 0, len(handle)+512), `{"id":"cmpl-p%d","object":"chat.completion","created":1,"model":%q,"choices":[{"index":0,"message":{"role":"assistant","content":"x"},"finish_reason":"length"}],"usage":{"prompt_tokens":%d,"completion_tokens":1,"total_tokens":%d},"kv_transfer_params":`,
				n, model, prompt, prompt+1)
			writeJSON(w, append(append(out, handle...), '}'))
		})
		mux.HandleFunc("POST /v1/chat/completions/render", func(w http.ResponseWriter, r *http.Request) {
			req, ok := toytok.ReadRequest(w, r)
			if !ok {
				return
			}
			ids := toytok.Chat(req.Messages)
			out := make([]byte, 0, 7*len(ids)+16)
			writeJSON(w, append(toytok.AppendJSON(append(out, `{"token_ids":`...), ids), '}'))
		})
	case "decode":
		mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
			body, err := io.ReadAll(r.Body)
			if err != nil {
				return
			}
			var req toytok.Request
			prompt := 0
			if bytes.Contains(body, []byte(`"return_token_ids"`)) {
				err = json.Unmarshal(body, &req)
			} else {
				prompt, err = toytok.PromptTokens(body)
			}
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			cannedStream(w, seq.Add(1), model, req, prompt, kv)
		})
	default:
		return nil, fmt.Errorf("--canned %q: use prefill or decode", role)
	}
	return mux, nil
}

// cannedStream writes the canned decode stream: the first event flushed
// alone, the content and final events together. promptTokens is the
// prompt's length when req (without return_token_ids) was not decoded.
func cannedStream(w http.ResponseWriter, n int64, model string, req toytok.Request, promptTokens int, kv cannedKV) {
	var prompt []uint32
	gen := toytok.Reply(cannedReply)
	if req.ReturnTokenIDs {
		prompt = toytok.Chat(req.Messages)
		promptTokens = len(prompt)
	}
	// D holds the prompt and the reply but its last token (vLLM's
	// num_computed_tokens at the finish).
	handle := toytok.GroupHandle(n, promptTokens+len(gen)-1, kv.blockSize, kv.groups, false)

	w.Header().Set("Content-Type", "text/event-stream")
	out := make([]byte, 0, 7*len(prompt)+len(handle)+1024)
	out = fmt.Appendf(out, `data: {"id":"cmpl-d%d","object":"chat.completion.chunk","created":1,"model":%q,"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]`, n, model)
	if req.ReturnTokenIDs {
		out = toytok.AppendJSON(append(out, `,"prompt_token_ids":`...), prompt)
	}
	out = append(out, "}\n\n"...)
	_, _ = w.Write(out)
	_ = http.NewResponseController(w).Flush()
	out = fmt.Appendf(out[:0], `data: {"id":"cmpl-d%d","object":"chat.completion.chunk","created":1,"model":%q,"choices":[{"index":0,"delta":{"content":%q},"logprobs":null,"finish_reason":null`, n, model, cannedReply)
	if req.ReturnTokenIDs {
		out = toytok.AppendJSON(append(out, `,"token_ids":`...), gen[:len(gen)-1])
	}
	out = append(out, "}]}\n\n"...)
	out = fmt.Appendf(out, `data: {"id":"cmpl-d%d","object":"chat.completion.chunk","created":1,"model":%q,"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop","stop_reason":null`, n, model)
	if req.ReturnTokenIDs {
		out = toytok.AppendJSON(append(out, `,"token_ids":`...), gen[len(gen)-1:])
	}
	out = append(out, `}],"kv_transfer_params":`...)
	out = append(out, handle...)
	out = append(out, "}\n\ndata: [DONE]\n\n"...)
	_, _ = w.Write(out)
}

// writeJSON writes a JSON answer with its Content-Length, as vLLM's API
// server (Starlette's JSONResponse) does.
func writeJSON(w http.ResponseWriter, b []byte) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	_, _ = w.Write(b)
}

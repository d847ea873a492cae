package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync/atomic"

	"github.com/bidikv/bidikv/internal/toytok"
)

// Canned mode (--canned prefill or --canned decode) is for router overhead
// runs only (examples/bench --overhead): the engine simulates nothing. It
// answers every request at once with fixed bytes and no KV, so that nearly
// all the CPU of a run is the router's and the client's:
//
//   - prefill: POST /v1/chat/completions gets a one-token completion with
//     a P handle; POST /v1/chat/completions/render gets the prompt's ids
//     under a toy tokenizer (internal/toytok), the only request it tokenizes.
//   - decode: a three-event stream ("Done, the tests pass.") whose final
//     chunk carries a D handle. With return_token_ids the first chunk
//     carries the prompt's toy ids and the others the reply's, and the
//     handle's remote_num_tokens covers them; without it the request is
//     not decoded at all and the handle says 5000 tokens.
//
// An honest next turn (the messages, the reply, a new user message)
// renders to ids that begin with the handle's, so token verification
// passes. The toy tokenizer and template are internal/toytok's.
const (
	// cannedReply is the decode engine's reply.
	cannedReply = "Done, the tests pass."
	// cannedBlockSize is the block size of canned D handles (kvroute's
	// default).
	cannedBlockSize = 16
)

// cannedHandler returns the canned engine of role "prefill" or "decode".
func cannedHandler(role, model string) (http.Handler, error) {
	var seq atomic.Int64
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) {})
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model","owned_by":"vllmsim"}]}`, model)
	})
	switch role {
	case "prefill":
		mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			n := seq.Add(1)
			writeJSON(w, fmt.Appendf(nil, `{"id":"cmpl-p%d","object":"chat.completion","created":1,"model":%q,"choices":[{"index":0,"message":{"role":"assistant","content":"x"},"finish_reason":"length"}],"usage":{"prompt_tokens":100,"completion_tokens":1,"total_tokens":101},"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2,3,4,5,6,7]],"remote_engine_id":"p-engine","remote_request_id":"p-%d","remote_host":"10.0.0.1","remote_port":5600,"tp_size":1}}`, n, model, n))
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
			if bytes.Contains(body, []byte(`"return_token_ids"`)) {
				if err := json.Unmarshal(body, &req); err != nil {
					http.Error(w, err.Error(), http.StatusBadRequest)
					return
				}
			}
			cannedStream(w, seq.Add(1), model, req)
		})
	default:
		return nil, fmt.Errorf("--canned %q: use prefill or decode", role)
	}
	return mux, nil
}

// cannedStream writes the canned decode stream: the first event flushed
// alone, the content and final events together.
func cannedStream(w http.ResponseWriter, n int64, model string, req toytok.Request) {
	var prompt, gen []uint32
	tokens := 5000
	if req.ReturnTokenIDs {
		prompt = toytok.Chat(req.Messages)
		gen = toytok.Reply(cannedReply)
		tokens = len(prompt) + len(gen) - 1
	}
	handle := toytok.Handle(n, tokens, cannedBlockSize)

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

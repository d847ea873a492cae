// Package toytok is the toy tokenizer and chat template of the canned
// engines that router overhead runs use (examples/vllmsim --canned and the
// in-process engines of kvroute's overhead benchmarks). It tokenizes
// cheaply and deterministically, so that a run's CPU is the router's, and
// renders an honest next turn to ids that begin with the previous turn's
// prompt and reply, so that token verification passes.
//
// Each message's content is split at whitespace and each word into pieces
// of at most Piece bytes; a piece's id is its FNV-32a hash modulo Vocab.
// The template adds a role id ("<|role|>") and an end-of-turn id
// ("<|im_end|>") per message and ends with the assistant role id (the
// generation prompt). On English text this gives about 4 bytes of content
// per token.
package toytok

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
)

const (
	// Piece is the longest piece of a word that is one token, in bytes.
	Piece = 5
	// Vocab is the vocabulary size ids are reduced to (Qwen3's).
	Vocab = 151936
)

// Message is one chat message as the template reads it.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// ID is the id of one piece (or special token) s.
func ID(s string) uint32 {
	h := uint32(2166136261)
	for i := 0; i < len(s); i++ {
		h ^= uint32(s[i])
		h *= 16777619
	}
	return h % Vocab
}

// End is the end-of-turn id, which also ends a generated reply.
var End = ID("<|im_end|>")

func space(c byte) bool { return c == ' ' || c == '\n' || c == '\t' || c == '\r' }

// Text appends the ids of text's pieces to dst.
func Text(dst []uint32, text string) []uint32 {
	for i := 0; i < len(text); {
		for i < len(text) && space(text[i]) {
			i++
		}
		j := i
		for j < len(text) && !space(text[j]) && j-i < Piece {
			j++
		}
		if j > i {
			dst = append(dst, ID(text[i:j]))
		}
		i = j
	}
	return dst
}

// Chat renders msgs with the template, generation prompt included: the
// prompt an engine computes for them.
func Chat(msgs []Message) []uint32 {
	n := 1
	for _, m := range msgs {
		n += 2 + len(m.Content)/3
	}
	ids := make([]uint32, 0, n)
	for _, m := range msgs {
		ids = append(ids, ID("<|"+m.Role+"|>"))
		ids = Text(ids, m.Content)
		ids = append(ids, End)
	}
	return append(ids, ID("<|assistant|>"))
}

// Reply returns the ids an engine generates for reply: its pieces and the
// end-of-turn id, sampled last.
func Reply(reply string) []uint32 { return append(Text(nil, reply), End) }

// AppendJSON appends ids to b as a JSON array.
func AppendJSON(b []byte, ids []uint32) []byte {
	b = append(b, '[')
	for i, id := range ids {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendUint(b, uint64(id), 10)
	}
	return append(b, ']')
}

// Request is what the canned engines read of a chat request.
type Request struct {
	Messages       []Message `json:"messages"`
	ReturnTokenIDs bool      `json:"return_token_ids"`
}

// ReadRequest decodes r's body as a Request; when it cannot, it answers
// 400 and reports false.
func ReadRequest(w http.ResponseWriter, r *http.Request) (Request, bool) {
	var req Request
	body, err := io.ReadAll(r.Body)
	if err == nil {
		err = json.Unmarshal(body, &req)
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return req, false
	}
	return req, true
}

// Handle is the canned decode engine's kv_transfer_params for its n-th
// turn holding tokens tokens in blocks of blockSize: NIXL's shape, one KV
// group of ceil(tokens/blockSize) block ids that differ from turn to turn.
func Handle(n int64, tokens, blockSize int) []byte {
	blocks := (tokens + blockSize - 1) / blockSize
	h := []byte(`{"do_remote_prefill":false,"do_remote_decode":true,"remote_block_ids":[[`)
	for i := range blocks {
		if i > 0 {
			h = append(h, ',')
		}
		h = strconv.AppendInt(h, 10000+(n*int64(blocks)+int64(i))%90000, 10)
	}
	return fmt.Appendf(h, `]],"remote_engine_id":"d-engine","remote_request_id":"d-%d","remote_host":"10.0.0.2","remote_port":5601,"tp_size":1,"remote_num_tokens":%d,"remote_blocks_expiry_time":12345.5}`, n, tokens)
}

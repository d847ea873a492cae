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
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"

	"github.com/bidikv/bidikv/internal/jsonraw"
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

// PoolBlocks is the size of the canned engines' KV block pool: their block
// ids are below it (vLLM's ids index the engine's pool, 0 to
// num_gpu_blocks-1; 100,000 blocks of 16 tokens are 1.6M tokens, an 8B
// model on an 80 GB GPU).
const PoolBlocks = 100000

// Handle is the canned decode engine's kv_transfer_params for its n-th
// turn holding tokens tokens in blocks of blockSize, as vLLM's NIXL
// connector emits it (nixl/pull_scheduler.py request_finished): every key
// in its order, one KV group of ceil(tokens/blockSize) block ids (a dense
// model), ids in the pool that differ from turn to turn.
func Handle(n int64, tokens, blockSize int) []byte {
	return GroupHandle(n, tokens, blockSize, 1, false)
}

// PrefillHandle is the canned prefill engine's kv_transfer_params for its
// n-th request, whose prompt is tokens tokens: do_remote_prefill true, the
// prompt's ceil(tokens/blockSize) blocks, remote_num_tokens the computed
// tokens (the prompt: the sampled token has no KV yet) and no expiry
// time, as vLLM's connector emits it for a prefill node.
func PrefillHandle(n int64, tokens, blockSize int) []byte {
	return GroupHandle(n, tokens, blockSize, 1, true)
}

// GroupHandle is Handle (prefill false) or PrefillHandle with groups KV
// groups, each a full-attention group of ceil(tokens/blockSize) blocks of
// its own (one pool serves every group).
func GroupHandle(n int64, tokens, blockSize, groups int, prefill bool) []byte {
	blocks := (tokens + blockSize - 1) / blockSize
	h := make([]byte, 0, 6*blocks*groups+400)
	role, expiry := "d", "12345.5"
	if prefill {
		role, expiry = "p", "null"
		h = append(h, `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[`...)
	} else {
		h = append(h, `{"do_remote_prefill":false,"do_remote_decode":true,"remote_block_ids":[`...)
	}
	const first = PoolBlocks / 10 // five-digit ids, the common width
	next := n * int64(blocks*groups)
	for g := range groups {
		if g > 0 {
			h = append(h, ',')
		}
		h = append(h, '[')
		for i := range blocks {
			if i > 0 {
				h = append(h, ',')
			}
			h = strconv.AppendInt(h, first+next%(PoolBlocks-first), 10)
			next++
		}
		h = append(h, ']')
	}
	return fmt.Appendf(h, `],"remote_engine_id":"%s-engine","remote_request_id":"%s-%d","remote_host":"10.0.0.2","remote_port":5601,"tp_size":1,"dcp_size":1,"pp_size":1,"remote_num_tokens":%d,"remote_blocks_expiry_time":%s,"transfer_mode":"pull"}`,
		role, role, n, tokens, expiry)
}

// PromptTokens returns the number of ids Chat renders the messages of a
// chat request body to, without decoding the body into values: what a
// canned engine that does not return token ids needs for its handle's
// size. It fails on a body that is not a JSON object with a messages list
// of objects whose role and content are strings (or absent).
func PromptTokens(body []byte) (int, error) {
	obj, err := jsonraw.Parse(body)
	if err != nil {
		return 0, err
	}
	msgs, ok := obj.Get("messages")
	if !ok {
		return 0, errors.New("toytok: no messages")
	}
	n := 1 // the generation prompt
	err = jsonraw.Elements(msgs, func(m []byte) error {
		c, ok := jsonraw.Lookup(m, "content")
		if ok && !jsonraw.IsNull(c) {
			var p pieceCounter
			if !jsonraw.StringPiecesTrusted(c, p.add) {
				return errors.New("toytok: content is not a string")
			}
			n += p.n
		}
		n += 2
		return nil
	})
	return n, err
}

// pieceCounter counts the ids Text appends for text given in pieces.
type pieceCounter struct {
	n   int // pieces begun
	run int // non-space bytes since the last space
}

func (p *pieceCounter) add(b []byte) {
	for _, c := range b {
		if space(c) {
			p.run = 0
			continue
		}
		if p.run%Piece == 0 {
			p.n++
		}
		p.run++
	}
}

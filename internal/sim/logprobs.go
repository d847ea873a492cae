package sim

import (
	"bytes"
	"encoding/json"
	"math"
	"strconv"
	"unicode/utf8"
)

// Logprobs, as vLLM's OpenAI server returns them
// (vllm/entrypoints/openai/chat_completion/serving.py, _create_chat_logprobs
// and _get_top_logprobs; vllm/entrypoints/openai/completion/serving.py,
// _create_completion_logprobs). The engine gives each generated position a
// dict of token logprobs: the sampled token first, then the most likely
// tokens in rank order, one entry per distinct token
// (vllm/v1/engine/logprobs.py, _make_logprob_dict). The simulator samples
// the most likely token, so the dict holds max(k, 1) tokens for k
// requested: the sampled one, then k-1 alternatives.
//
// Chat (logprobs true, top_logprobs k, default 0): choices[].logprobs is
// {"content": [{"token", "logprob", "bytes", "top_logprobs": [the dict's
// first k entries, each {"token", "logprob", "bytes"}]}]}, one entry per
// generated token (a final EOS included). Completions (logprobs k):
// {"text_offset", "token_logprobs", "tokens", "top_logprobs": [the dict's
// first k+1 entries as {token: logprob}]}. Streamed, each chunk carries
// the entries of its tokens (a token a parser swallows without a chunk
// takes its logprobs with it); completions offsets continue from the text
// streamed so far. Without logprobs the key is null. A token's text is its
// decoding with special tokens kept (convert_ids_list_to_tokens: EOS is
// "<|im_end|>"); bytes its UTF-8.
//
// Values are a function of the KV the position is computed from, like the
// tokens: a wrong read changes them too, and Reference reproduces them.

// MaxLogprobs is vLLM's default --max-logprobs (ModelConfig.max_logprobs):
// a request asking for more logprobs per position gets 400.
const MaxLogprobs = 20

// vocabSize is what a logprobs value of -1 (the whole vocabulary) asks
// for: Qwen3's vocabulary.
const vocabSize = 151936

// parseChatLogprobs reads chat's logprobs and top_logprobs as
// ChatCompletionRequest.check_logprobs validates them.
func (r *Request) parseChatLogprobs(m map[string]json.RawMessage) error {
	on, err := laxBool(m, "logprobs", false)
	if err != nil {
		return err
	}
	top, set, err := laxIntPtr(m, "top_logprobs")
	if err != nil {
		return err
	}
	if set {
		if top < 0 && top != -1 {
			return badRequest("`top_logprobs` must be a positive value or -1.")
		}
		if (top == -1 || top > 0) && !on {
			return badRequest("when using `top_logprobs`, `logprobs` must be set to true.")
		}
	}
	r.Logprobs, r.TopLogprobs = on, top
	return r.checkMaxLogprobs()
}

// parseCompletionLogprobs reads completions' logprobs as
// CompletionRequest.check_logprobs validates it.
func (r *Request) parseCompletionLogprobs(m map[string]json.RawMessage) error {
	n, set, err := laxIntPtr(m, "logprobs")
	if err != nil || !set {
		return err
	}
	if n < 0 && n != -1 {
		return badRequest("`logprobs` must be a positive value or -1.")
	}
	r.Logprobs, r.TopLogprobs = true, n
	return r.checkMaxLogprobs()
}

// checkMaxLogprobs refuses more logprobs than MaxLogprobs, as the engine's
// input processor does (_validate_logprobs; -1 asks for the vocabulary).
func (r *Request) checkMaxLogprobs() error {
	if !r.Logprobs {
		return nil
	}
	n := r.TopLogprobs
	if n == -1 {
		n = vocabSize
	}
	if n > MaxLogprobs {
		return badRequest("Requested sample logprobs of %d, which is greater than max allowed: %d", n, MaxLogprobs)
	}
	return nil
}

// samplingLogprobs is SamplingParams.logprobs for the request: the number
// of top logprobs, or null.
func (r *Request) samplingLogprobs() json.RawMessage {
	if !r.Logprobs {
		return json.RawMessage("null")
	}
	return json.RawMessage(strconv.Itoa(r.TopLogprobs))
}

// candidate is one entry of a position's logprob dict.
type candidate struct {
	text    string
	logprob float64
}

// positionDict is the logprob dict of generated token j of g: max(k, 1)
// entries, the sampled token first and most likely, then alternatives in
// decreasing probability, drawn from the KV token j was computed from.
func positionDict(g Generated, j, k int) []candidate {
	ctx := g.From
	if j > 0 {
		ctx = g.KV[j-1]
	}
	h := splitmix(ctx ^ 0x1095)
	lp := -(0.0002 + 0.9*unit(h))
	out := make([]candidate, 0, max(k, 1))
	out = append(out, candidate{text: logprobText(g.Tokens[j]), logprob: float32Logprob(lp)})
	for i := 1; len(out) < k; i++ {
		h = splitmix(h + uint64(i))
		w := words[h%uint64(len(words))]
		if h>>40&1 == 1 {
			w = " " + w
		}
		if dictHas(out, w) {
			continue
		}
		lp -= 0.05 + 2.5*unit(h>>8)
		out = append(out, candidate{text: w, logprob: float32Logprob(lp)})
	}
	return out
}

func dictHas(d []candidate, text string) bool {
	for _, c := range d {
		if c.text == text {
			return true
		}
	}
	return false
}

// unit maps h to [0, 1).
func unit(h uint64) float64 { return float64(h%1_000_000) / 1_000_000 }

// float32Logprob rounds a logprob to float32, as vLLM's tensors hold it,
// keeping it off integers (Python prints -2.0 where Go prints -2).
func float32Logprob(x float64) float64 {
	f := float64(float32(x))
	if f == math.Trunc(f) {
		f = float64(math.Nextafter32(float32(f), 0))
	}
	return f
}

// logprobText is a token's text in logprobs: its decoding with special
// tokens kept (EOS renders nothing in the reply, but is "<|im_end|>" here).
func logprobText(t Token) string {
	if t.Text == "" {
		return tokenOfID(t.ID).Text
	}
	return t.Text
}

// textBytes is Python's list(text.encode("utf-8")): never null.
func textBytes(s string) []int {
	out := make([]int, len(s))
	for i := range len(s) {
		out[i] = int(s[i])
	}
	return out
}

// chatLogprob is ChatCompletionLogProb.
type chatLogprob struct {
	Token   string  `json:"token"`
	Logprob float64 `json:"logprob"`
	Bytes   []int   `json:"bytes"`
}

// chatLogprobEntry is ChatCompletionLogProbsContent.
type chatLogprobEntry struct {
	Token       string        `json:"token"`
	Logprob     float64       `json:"logprob"`
	Bytes       []int         `json:"bytes"`
	TopLogprobs []chatLogprob `json:"top_logprobs"`
}

// chatLogprobs is ChatCompletionLogProbs for tokens from to to of g.
func (r *Request) chatLogprobs(g Generated, from, to int) any {
	if !r.Logprobs {
		return nil
	}
	k := r.TopLogprobs
	content := make([]chatLogprobEntry, 0, to-from)
	for j := from; j < to; j++ {
		d := positionDict(g, j, k)
		e := chatLogprobEntry{Token: d[0].text, Logprob: d[0].logprob, Bytes: textBytes(d[0].text), TopLogprobs: []chatLogprob{}}
		for i, c := range d {
			if i < k {
				e.TopLogprobs = append(e.TopLogprobs, chatLogprob{Token: c.text, Logprob: c.logprob, Bytes: textBytes(c.text)})
			}
		}
		content = append(content, e)
	}
	return struct {
		Content []chatLogprobEntry `json:"content"`
	}{content}
}

// completionLogprobs is CompletionLogProbs for tokens from to to of g, the
// first text offset at offset.
func (r *Request) completionLogprobs(g Generated, from, to, offset int) any {
	if !r.Logprobs {
		return nil
	}
	k := r.TopLogprobs
	out := struct {
		TextOffset    []int      `json:"text_offset"`
		TokenLogprobs []float64  `json:"token_logprobs"`
		Tokens        []string   `json:"tokens"`
		TopLogprobs   []logprobs `json:"top_logprobs"`
	}{[]int{}, []float64{}, []string{}, []logprobs{}}
	for j := from; j < to; j++ {
		d := positionDict(g, j, k)
		out.TextOffset = append(out.TextOffset, offset)
		offset += utf8.RuneCountInString(d[0].text) // Python's len(token)
		out.Tokens = append(out.Tokens, d[0].text)
		out.TokenLogprobs = append(out.TokenLogprobs, d[0].logprob)
		var top logprobs
		for i, c := range d {
			if i <= k {
				top = append(top, c)
			}
		}
		out.TopLogprobs = append(out.TopLogprobs, top)
	}
	return out
}

// logprobs is a {token: logprob} dict in insertion order, as Python writes
// it.
type logprobs []candidate

// MarshalJSON writes the dict's keys in order (a Go map would sort them).
func (l logprobs) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, c := range l {
		if i > 0 {
			b.WriteByte(',')
		}
		k, err := json.Marshal(c.text)
		if err != nil {
			return nil, err
		}
		v, err := json.Marshal(c.logprob)
		if err != nil {
			return nil, err
		}
		b.Write(k)
		b.WriteByte(':')
		b.Write(v)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

// ChoiceLogprobs returns the logprobs value of a non-streaming answer's
// choice generated as g for req: chat's or completions' shape, null when
// the request did not ask for logprobs.
func ChoiceLogprobs(req *Request, g Generated) json.RawMessage {
	var v any
	if req.Path == PathCompletions {
		v = req.completionLogprobs(g, 0, len(g.Tokens), 0)
	} else {
		v = req.chatLogprobs(g, 0, len(g.Tokens))
	}
	b, _ := json.Marshal(v)
	return b
}

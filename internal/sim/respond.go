package sim

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"net/http"
	"strings"
	"unicode/utf8"
)

// reply writes a finished turn as vLLM's OpenAI server does.
type reply struct {
	e       *Engine
	t       *turn
	id      string
	created int64
	kv      json.RawMessage // the handle, nil when none
	ids     []string        // item ids drawn so far (newID)
	nextID  int             // the next of ids a build takes
}

type usage struct {
	PromptTokens        int            `json:"prompt_tokens"`
	TotalTokens         int            `json:"total_tokens"`
	CompletionTokens    int            `json:"completion_tokens"`
	PromptTokensDetails *promptDetails `json:"prompt_tokens_details"`
}

type promptDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

func (o *reply) usage() usage {
	rec := o.t.rec
	n, c := rec.PromptTokens, rec.CompletionTokens
	u := usage{PromptTokens: n, TotalTokens: n + c, CompletionTokens: c}
	if o.e.cfg.PromptTokensDetails {
		u.PromptTokensDetails = &promptDetails{CachedTokens: rec.CachedTokens + rec.PulledTokens + rec.TierTokens}
	}
	return u
}

func (o *reply) chat() bool { return chatLike(o.t.req.Path) }

func (o *reply) model() string { return o.e.cfg.Model }

func nullable(raw json.RawMessage) json.RawMessage {
	if raw == nil {
		return json.RawMessage("null")
	}
	return raw
}

func stopReason(g Generated) any {
	if g.StopString != "" {
		return g.StopString
	}
	return nil
}

// RawText is the completions text: every generated token, cut at the stop
// string.
func RawText(g Generated) string {
	var sb strings.Builder
	for _, t := range g.Tokens {
		sb.WriteString(t.Text)
	}
	s := sb.String()
	if g.StopString != "" {
		if i := strings.LastIndex(s, g.StopString); i >= 0 {
			s = s[:i]
		}
	}
	return s
}

// promptIDs is the prompt_token_ids value: the prompt's ids with
// return_token_ids, null without (vLLM writes the key either way).
func (o *reply) promptIDs() []uint32 {
	if !o.t.req.ReturnTokenIDs {
		return nil
	}
	return append([]uint32{}, o.t.toks...)
}

// tokenIDs is a choice's token_ids value for toks, null without
// return_token_ids.
func (o *reply) tokenIDs(toks []Token) []uint32 {
	if !o.t.req.ReturnTokenIDs {
		return nil
	}
	return append([]uint32{}, ids(toks)...)
}

// rawIDs is tokenIDs as a raw value for chunks, where the key is present
// (null or a list) only when set.
func (o *reply) rawIDs(toks []Token) json.RawMessage {
	b, _ := json.Marshal(o.tokenIDs(toks))
	return b
}

func (o *reply) json(w http.ResponseWriter) {
	var body any
	switch {
	case o.t.req.Path == PathResponses:
		body = o.responsesObject(true)
	case o.t.req.Path == PathMessages:
		body = o.messagesObject()
	case o.chat():
		type choice struct {
			Index        int         `json:"index"`
			Message      chatMessage `json:"message"`
			Logprobs     any         `json:"logprobs"`
			FinishReason string      `json:"finish_reason"`
			StopReason   any         `json:"stop_reason"`
			TokenIDs     []uint32    `json:"token_ids"`
		}
		choices := make([]choice, len(o.t.gens))
		for i, g := range o.t.gens {
			p := o.e.cfg.Parse(g, o.t.req, false)
			callID := "" // drawn only for a tool call
			if len(p.Calls) > 0 {
				callID = o.toolCallID(i)
			}
			choices[i] = choice{Index: i, Message: o.e.cfg.message(p, callID), Logprobs: o.t.req.chatLogprobs(g, 0, len(g.Tokens)),
				FinishReason: p.Finish, StopReason: stopReason(g), TokenIDs: o.tokenIDs(g.Tokens)}
		}
		body = struct {
			ID                string          `json:"id"`
			Object            string          `json:"object"`
			Created           int64           `json:"created"`
			Model             string          `json:"model"`
			Choices           []choice        `json:"choices"`
			SystemFingerprint json.RawMessage `json:"system_fingerprint,omitempty"`
			Usage             usage           `json:"usage"`
			PromptLogprobs    any             `json:"prompt_logprobs"`
			PromptTokenIDs    []uint32        `json:"prompt_token_ids"`
			KVTransferParams  json.RawMessage `json:"kv_transfer_params"`
		}{o.id, "chat.completion", o.created, o.model(), choices, o.e.cfg.fingerprintJSON(), o.usage(), nil, o.promptIDs(), nullable(o.kv)}
	default:
		type choice struct {
			Index          int      `json:"index"`
			Text           string   `json:"text"`
			Logprobs       any      `json:"logprobs"`
			FinishReason   string   `json:"finish_reason"`
			StopReason     any      `json:"stop_reason"`
			TokenIDs       []uint32 `json:"token_ids"`
			PromptLogprobs any      `json:"prompt_logprobs"`
			PromptTokenIDs []uint32 `json:"prompt_token_ids"`
		}
		choices := make([]choice, len(o.t.gens))
		for i, g := range o.t.gens {
			choices[i] = choice{Index: i, Text: RawText(g), Logprobs: o.t.req.completionLogprobs(g, 0, len(g.Tokens), 0),
				FinishReason: g.Finish, StopReason: stopReason(g), TokenIDs: o.tokenIDs(g.Tokens), PromptTokenIDs: o.promptIDs()}
		}
		body = struct {
			ID                string          `json:"id"`
			Object            string          `json:"object"`
			Created           int64           `json:"created"`
			Model             string          `json:"model"`
			Choices           []choice        `json:"choices"`
			SystemFingerprint json.RawMessage `json:"system_fingerprint,omitempty"`
			Usage             usage           `json:"usage"`
			KVTransferParams  json.RawMessage `json:"kv_transfer_params"`
		}{o.id, "text_completion", o.created, o.model(), choices, o.e.cfg.fingerprintJSON(), o.usage(), nullable(o.kv)}
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	_ = json.NewEncoder(w).Encode(body)
}

// delta is a chat stream delta.
type delta struct {
	Role             string          `json:"role,omitempty"`
	Content          *string         `json:"content,omitempty"`
	ToolCalls        []deltaToolCall `json:"tool_calls,omitempty"`
	Reasoning        *string         `json:"reasoning,omitempty"`
	ReasoningContent *string         `json:"reasoning_content,omitempty"`
}

type streamChoice struct {
	Index        int     `json:"index"`
	Delta        *delta  `json:"delta,omitempty"`
	Text         *string `json:"text,omitempty"`
	Logprobs     any     `json:"logprobs"`
	FinishReason *string `json:"finish_reason"`
	StopReason   any     `json:"stop_reason,omitempty"`
	// TokenIDs and PromptTokenIDs are raw so that a chunk can carry the key
	// as null (vLLM sets it explicitly), a list, or not at all.
	TokenIDs       json.RawMessage `json:"token_ids,omitempty"`
	PromptTokenIDs json.RawMessage `json:"prompt_token_ids,omitempty"`
}

type chunk struct {
	ID      string         `json:"id"`
	Object  string         `json:"object"`
	Created int64          `json:"created"`
	Model   string         `json:"model"`
	Choices []streamChoice `json:"choices"`
	Usage   *usage         `json:"usage,omitempty"`
	// SystemFingerprint is set on finish chunks, or on the usage chunk
	// when one follows them (vLLM stamps only the final message).
	SystemFingerprint *string         `json:"system_fingerprint,omitempty"`
	PromptTokenIDs    json.RawMessage `json:"prompt_token_ids,omitempty"`
	KVTransferParams  json.RawMessage `json:"kv_transfer_params,omitempty"`
}

// event is one SSE event: its data payload, its event name ("" writes no
// event: line) and the number of decode steps before it.
type event struct {
	data  []byte
	name  string
	steps int
}

// events builds the stream of the request's API. Responses and Messages
// streams are converted from the chat stream (respond_apis.go), as vLLM's
// converters consume the chat generator. The chat and completions stream:
// role chunks (chat), one chunk per generated token
// with text (the last one of a choice carries finish_reason; tokens that
// render nothing, like <think>, are skipped unless return_token_ids asks for
// every token), a usage chunk when include_usage, then [DONE]. With stream
// handles (#40186) the last finish chunk carries the top-level
// kv_transfer_params. A system fingerprint (not null) goes on every finish
// chunk, or only on the usage chunk when include_usage.
//
// As vLLM's exclude_unset serialization does: chat role chunks carry a
// top-level prompt_token_ids (null without return_token_ids) and no
// token_ids; chat delta and finish chunks carry choices[].token_ids (null
// without return_token_ids); completions chunks carry both per choice, the
// prompt ids on each choice's first chunk only.
func (o *reply) events() []event {
	o.nextID = 0 // a rebuild draws the same ids
	switch o.t.req.Path {
	case PathResponses:
		return o.responsesEvents(o.chatEvents())
	case PathMessages:
		return o.messagesEvents(o.chatEvents())
	}
	return o.chatEvents()
}

// chatEvents builds the chat (or completions) stream described at events.
func (o *reply) chatEvents() []event {
	obj := "text_completion"
	if o.chat() {
		obj = "chat.completion.chunk"
	}
	mk := func(c streamChoice) chunk {
		return chunk{ID: o.id, Object: obj, Created: o.created, Model: o.model(), Choices: []streamChoice{c}}
	}
	var out []event
	skipped := 0 // tokens that rendered nothing since the last chunk: still decode steps
	add := func(c chunk, token bool) {
		b, _ := json.Marshal(c)
		out = append(out, event{data: b, steps: b2i(token) + skipped})
		skipped = 0
	}
	promptIDs, _ := json.Marshal(o.promptIDs())
	every := o.t.req.ReturnTokenIDs
	fp, _ := o.e.cfg.SystemFingerprint() // nil: no key in chunks
	if o.chat() {
		for i := range o.t.gens {
			empty := ""
			c := mk(streamChoice{Index: i, Delta: &delta{Role: "assistant", Content: &empty}})
			c.PromptTokenIDs = promptIDs
			add(c, false)
		}
	}
	for i, g := range o.t.gens {
		inThink, afterThink := false, false
		target, _ := o.e.cfg.ChatContent(g) // all the text that may be sent
		sent := ""                          // text sent so far
		if !o.chat() {
			target = RawText(g)
		}
		firstChunk, called := true, false
		streamed := "" // completions text sent in chunks so far
		calls := o.callDeltas(i, g)
		for j, tok := range g.Tokens {
			last := j == len(g.Tokens)-1
			text := tok.Text
			isReason := false
			if o.chat() && o.e.cfg.parsesReasoning() {
				switch {
				case tok.Text == TokThinkOpen:
					inThink, text = true, ""
				case tok.Text == TokThinkClose:
					inThink, afterThink, text = false, true, ""
				case afterThink && tok.Text == "\n\n":
					afterThink, text = false, ""
				case inThink:
					isReason = true
				}
			}
			if !isReason {
				// never send text beyond a stop string
				switch {
				case len(sent) >= len(target):
					text = ""
				case len(sent)+len(text) > len(target):
					text = target[len(sent):]
				}
				sent += text
			}
			tc := calls[j]
			if text == "" && tc == nil && !last && !every {
				skipped++ // <think>, a call's markup and the like: a step, no chunk
				continue
			}
			c := streamChoice{Index: i, TokenIDs: o.rawIDs(g.Tokens[j : j+1])}
			if o.chat() {
				c.Logprobs = o.t.req.chatLogprobs(g, j, j+1)
			} else {
				// the offsets continue from the text streamed so far
				c.Logprobs = o.t.req.completionLogprobs(g, j, j+1, utf8.RuneCountInString(streamed))
				streamed += text
			}
			if o.chat() {
				d := &delta{}
				switch {
				case isReason:
					o.e.cfg.reasoningDelta(d, text)
				case o.t.req.ToolName != "" && (text != "" || last):
					// a named tool choice streams the call's arguments
					tc := deltaToolCall{Index: 0}
					if !called {
						tc.ID, tc.Type, tc.Function.Name, called = o.toolCallID(i), "function", o.t.req.ToolName, true
					}
					tc.Function.Arguments = text
					d.ToolCalls = []deltaToolCall{tc}
				case tc != nil:
					d.ToolCalls = []deltaToolCall{*tc}
				case text != "" || (last && g.Call == nil):
					d.Content = &text
				}
				c.Delta = d
			} else {
				c.Text = &text
				c.PromptTokenIDs = json.RawMessage("null")
				if firstChunk {
					c.PromptTokenIDs = promptIDs
				}
			}
			firstChunk = false
			ch := mk(c)
			if last {
				f := o.e.cfg.Parse(g, o.t.req, true).Finish
				ch.Choices[0].FinishReason = &f
				ch.Choices[0].StopReason = stopReason(g)
				if !o.t.req.IncludeUsage {
					ch.SystemFingerprint = fp
				}
				if i == len(o.t.gens)-1 && o.e.cfg.StreamHandles && o.kv != nil {
					ch.KVTransferParams = o.kv
				}
			}
			add(ch, true)
		}
	}
	if o.t.req.IncludeUsage {
		u := o.usage()
		c := chunk{ID: o.id, Object: obj, Created: o.created, Model: o.model(), Choices: []streamChoice{}, Usage: &u,
			SystemFingerprint: fp}
		b, _ := json.Marshal(c)
		out = append(out, event{data: b})
	}
	out = append(out, event{data: []byte("[DONE]")})
	return out
}

// stream writes the events, the decode steps of a chunk's tokens (those that
// rendered nothing since the previous chunk too) before each token chunk. The
// request completes (its hold starts and its handle is known) with its last
// decode step, before the event that carries the handle is written. A cut
// (CutStreamAfter) or a client that goes away aborts the request: its
// blocks are freed and no handle survives.
func (o *reply) stream(ctx context.Context, w http.ResponseWriter) {
	e, rec := o.e, o.t.rec
	e.mu.Lock()
	cut := e.cutAfter
	e.cutAfter = -1
	e.mu.Unlock()

	w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	_ = rc.Flush()
	evs := o.events()
	total := 0
	for _, ev := range evs {
		total += ev.steps
	}
	stepped, completed := 0, false
	for k := 0; k < len(evs); k++ {
		if k == cut {
			e.abort(o.t)
			e.finish(rec, http.StatusOK, "stream cut")
			panic(errCut)
		}
		ev := evs[k]
		if ev.steps > 0 || (k == len(evs)-1 && !completed) {
			e.mu.Lock()
			err := e.decode(ctx, o.t, ev.steps)
			stepped += ev.steps
			if err == nil && stepped >= total && !completed {
				o.kv, completed = e.complete(o.t), true
			}
			e.mu.Unlock()
			if errors.Is(err, errEngineRestarted) {
				e.mu.Lock()
				e.finishTurn(o.t, false)
				e.mu.Unlock()
				e.finish(rec, http.StatusOK, engineDead)
				panic(errCut)
			}
			if err != nil {
				e.abort(o.t)
				e.finish(rec, 499, "client disconnected")
				return
			}
			if completed && o.kv != nil {
				// the same events, now with the handle where it goes
				evs = o.events()
				ev = evs[k]
			}
		}
		var line []byte
		if ev.name != "" {
			line = append(append(append(line, "event: "...), ev.name...), '\n')
		}
		line = append(append(append(line, "data: "...), ev.data...), '\n', '\n')
		if _, err := w.Write(line); err != nil {
			e.abort(o.t)
			e.finish(rec, 499, "client disconnected")
			return
		}
		if err := rc.Flush(); err != nil {
			e.abort(o.t)
			e.finish(rec, 499, "client disconnected")
			return
		}
	}
	e.finish(rec, http.StatusOK, "")
}

// callDeltas maps the tokens of choice i's auto or required call (g.Call)
// to the tool-call deltas they stream, as vLLM's tool parsers stream a
// call: the token that completes the name sends the call's index, id,
// type and name (arguments ""), the tokens of the arguments send their
// text; the markup sends nothing (a nil delta).
func (o *reply) callDeltas(i int, g Generated) map[int]*deltaToolCall {
	if g.Call == nil || o.t.req.ToolName != "" || !o.chat() {
		return nil
	}
	c := g.Call
	text := callText(g)
	argsEnd := min(c.ArgsStart+len(c.Arguments), len(text))
	out := make(map[int]*deltaToolCall, c.End-c.Start)
	off := 0
	for j := c.Start; j < c.End; j++ {
		end := off + len(g.Tokens[j].Text)
		var d *deltaToolCall
		if off < c.NameEnd && c.NameEnd <= end {
			d = &deltaToolCall{Index: 0, ID: o.toolCallID(i), Type: "function"}
			d.Function.Name = c.Name
		}
		if lo, hi := max(off, c.ArgsStart), min(end, argsEnd); lo < hi {
			if d == nil {
				d = &deltaToolCall{Index: 0}
			}
			d.Function.Arguments = text[lo:hi]
		}
		out[j] = d
		off = end
	}
	return out
}

// toolCallID is choice i's tool call id: vLLM's "chatcmpl-tool-" and 32
// hex digits, drawn from the reply's id so that a rebuilt stream and the
// whole answer agree.
func (o *reply) toolCallID(i int) string {
	h := fnv.New128a()
	fmt.Fprintf(h, "%s/%d", o.id, i)
	return "chatcmpl-tool-" + hex.EncodeToString(h.Sum(nil))
}

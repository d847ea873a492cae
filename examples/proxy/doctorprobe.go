package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/capability"
	"github.com/bidikv/bidikv/retention"
	"github.com/bidikv/bidikv/sse"
)

// probeTurns is the length of each --probe conversation: turn 1 has
// nothing to reuse, later turns should.
const probeTurns = 3

// probeRun is one --probe conversation: one API, streaming or not.
type probeRun struct {
	api    capability.API
	stream bool
	turns  int // turns answered
	hits   int // turns that reused KV (a hit, or decode-local)
	// reused counts the reused turns compared with the same turn sent with
	// reuse off, equal those whose answers were the same.
	reused, equal   int
	ttftOff, ttftOn time.Duration // p50 over the reused turns
	note            string        // why turns did not reuse, or failed
	// reason is the refusal or miss reason the note names
	// (noteMeanings), "" when it names none.
	reason string
}

// probeOpening is the first user message of every --probe conversation:
// long enough for a handle to pass --recompute-threshold on any tokenizer.
const probeOpening = "You are a careful assistant helping with a long support conversation about a " +
	"home network. The router is in the hallway, the office is two floors up, and the video calls in " +
	"the office drop every afternoon when the children come home from school and start streaming. The " +
	"router is five years old, the cable modem is new, and there is an old repeater in the stairwell " +
	"that nobody remembers configuring. Summarise the situation in one sentence, then ask one question."

// probeFollowUps are the later user messages.
var probeFollowUps = []string{
	"The repeater shows a single orange light. What should I check first?",
	"I unplugged the repeater and the calls still drop. What next?",
	"Thanks. Give me a short checklist for tomorrow.",
}

// probeConversations runs one conversation per API, non-streaming then
// streaming, through an in-process router with reuse on, and sends each
// turn's exact body again through a router with reuse off (plain P→D
// disaggregation): reused turns must answer the same (temperature 0). What
// the turns show is learned into the engines' reports: handles in
// streams per API, and bidirectional transfer on the decode engines.
func (c *config) probeConversations(ctx context.Context, rt http.RoundTripper, engines []engineFacts, maxTokens int, log *slog.Logger) []probeRun {
	model := ""
	for _, e := range engines {
		if e.rep != nil && e.rep.Model != "" {
			model = e.rep.Model
			break
		}
	}
	on, onRecs, closeOn, err := c.probeRouter(rt, true)
	if err != nil {
		return []probeRun{{note: "router: " + err.Error()}}
	}
	defer closeOn()
	off, offRecs, closeOff, err := c.probeRouter(rt, false)
	if err != nil {
		return []probeRun{{note: "router: " + err.Error()}}
	}
	defer closeOff()

	var runs []probeRun
	for _, a := range capability.APIs {
		for _, stream := range []bool{false, true} {
			r := probeRun{api: a, stream: stream}
			conv := newProbeConversation(a, model, maxTokens, stream)
			var offT, onT []time.Duration
			for turn := range probeTurns {
				body := conv.body()
				onAns, onRec, err := probeTurn(ctx, on, onRecs, a, body, stream)
				learn(engines, a, stream, onRec)
				if err != nil {
					r.note = fmt.Sprintf("turn %d: %v", turn+1, err)
					break
				}
				r.turns++
				reused := onRec.Reuse == kvroute.ReuseHit || onRec.Reuse == kvroute.ReuseLocal
				if reused {
					r.hits++
				} else if turn > 0 && r.note == "" {
					r.note, r.reason = missNote(onRec), string(onRec.MissReason)
				}
				if turn == 0 && !onRec.Stored && r.note == "" {
					r.note, r.reason = "turn 1 not retained: "+string(onRec.StoreRefusal), string(onRec.StoreRefusal)
				}
				offAns, offRec, err := probeTurn(ctx, off, offRecs, a, body, stream)
				if err != nil {
					r.note = fmt.Sprintf("turn %d with reuse off: %v", turn+1, err)
					break
				}
				if reused {
					r.reused++
					if offAns == onAns {
						r.equal++
					} else {
						r.note = fmt.Sprintf("turn %d: the reused answer differs: %q, reuse off: %q", turn+1, clipAnswer(onAns), clipAnswer(offAns))
					}
					onT, offT = append(onT, onRec.TTFT), append(offT, offRec.TTFT)
				}
				conv.reply(onAns, turn)
			}
			r.ttftOn, r.ttftOff = median(onT), median(offT)
			runs = append(runs, r)
			if ctx.Err() != nil {
				routed(engines, on)
				return runs
			}
		}
	}
	_ = log
	routed(engines, on)
	return runs
}

// routed records in engines what the router's turns showed of each: the
// block size its handles were checked at, and whether it serves without
// reuse.
func routed(engines []engineFacts, r *kvroute.Router) {
	status := routerStatus(r)
	for i := range engines {
		engines[i].status = status(engines[i].role, engines[i].url)
	}
}

// probeRouter builds an in-process router over the configured engines
// with the proxy's own options, reuse on or off, and a channel of its
// turn records.
func (c *config) probeRouter(rt http.RoundTripper, reuse bool) (*kvroute.Router, chan kvroute.TurnRecord, func(), error) {
	store, err := retention.NewMemory()
	if err != nil {
		return nil, nil, nil, err
	}
	recs := make(chan kvroute.TurnRecord, 16)
	opts := append(c.routerOptions(), kvroute.WithStore(store), kvroute.WithTransport(rt), kvroute.WithReuse(reuse),
		kvroute.WithLogger(slog.New(slog.DiscardHandler)),
		kvroute.WithObserver(kvroute.ObserverFunc(func(rec *kvroute.TurnRecord) {
			select {
			case recs <- *rec:
			default:
			}
		})))
	r, err := kvroute.New(opts...)
	if err != nil {
		_ = store.Close()
		return nil, nil, nil, flagError(err)
	}
	return r, recs, func() { _ = r.Close(); _ = store.Close() }, nil
}

// probeTurn sends one turn and returns the answer's text and its record.
func probeTurn(ctx context.Context, r *kvroute.Router, recs chan kvroute.TurnRecord, a capability.API, body []byte, stream bool) (string, kvroute.TurnRecord, error) {
	for len(recs) > 0 {
		<-recs
	}
	var buf bytes.Buffer
	resp, err := r.Do(ctx, &kvroute.Request{Path: a.Path(), Header: http.Header{"Content-Type": {"application/json"}}, Body: body})
	if err == nil {
		_, err = resp.WriteTo(&buf)
		_ = resp.Close()
	}
	var rec kvroute.TurnRecord
	select {
	case rec = <-recs:
	case <-ctx.Done():
		return "", rec, ctx.Err()
	}
	if err != nil {
		return "", rec, err
	}
	if rec.Err != nil {
		return "", rec, rec.Err
	}
	text, err := answerText(a, buf.Bytes(), stream)
	return text, rec, err
}

// learn records what a turn showed of its engines: a prefill engine that
// answered without a handle (an API without kv_transfer_params), a stream
// that ended normally with or without a handle, a non-streaming answer to
// a request with P's handle with or without one.
func learn(engines []engineFacts, a capability.API, stream bool, rec kvroute.TurnRecord) {
	find := func(role, url string) *capability.Report {
		for _, e := range engines {
			if e.role == role && e.url == strings.TrimRight(url, "/") && e.rep != nil {
				return e.rep
			}
		}
		return nil
	}
	if p := find(rolePrefill, rec.PrefillEndpoint); p != nil && rec.NoHandle == kvroute.PhasePrefill {
		if a == capability.Chat || a == capability.Completions {
			p.Learn(capability.NameBidirectional, capability.Fact{State: capability.Absent,
				Why: "learned: the prefill engine answered without a handle (no --kv-transfer-config with the NixlConnector?)", Fix: capability.FixBidirectional})
		} else {
			f := p.Handles.Get(a)
			p.Learn(capability.HandlesName(a), capability.Fact{State: capability.Absent,
				Why: "learned: the prefill engine answered a " + apiTitle(a) + " request without a handle",
				Fix: cmp.Or(f.Fix, "vLLM 0.19.0 or later (PRs #37424, #37535)")})
		}
	}
	rep := find(roleDecode, rec.DecodeEndpoint)
	if rep == nil || rec.Reuse == kvroute.ReuseLocal {
		return
	}
	switch {
	case stream && rec.Buffered && rec.Stored:
		// A buffered stream's decode leg ran non-streaming: it shows the
		// transfer, not the engine's streams.
		rep.Learn(capability.NameBidirectional, capability.Fact{State: capability.Present, Why: "learned: the decode engine returned a handle after a normal finish"})
	case stream && rec.Stored && !rec.Buffered:
		rep.Learn(capability.StreamHandlesName(a), capability.Fact{State: capability.Present, Why: "learned: a " + string(a) + " stream ended with a handle"})
	case stream && rec.StoreRefusal == kvroute.RefuseNoStreamHandle:
		fix := rep.StreamHandles.Get(a).Fix
		if a == capability.Responses {
			fix = "vLLM 0.19.0 or later (PR #37424: response.completed carries the handle; Responses streams are never buffered)"
		}
		rep.Learn(capability.StreamHandlesName(a), capability.Fact{State: capability.Absent,
			Why: "learned: a " + string(a) + " stream ended normally without a handle", Fix: cmp.Or(fix, capability.FixStreamHandles)})
	case !stream && rec.Stored:
		rep.Learn(capability.NameBidirectional, capability.Fact{State: capability.Present, Why: "learned: the decode engine returned a handle after a normal finish"})
	case !stream && (rec.NoHandle == kvroute.PhaseDecode || rec.StoreRefusal == kvroute.RefuseNoHandle) &&
		(a == capability.Responses || a == capability.Messages) && rep.Bidirectional.Is(capability.Present):
		f := rep.Handles.Get(a)
		rep.Learn(capability.HandlesName(a), capability.Fact{State: capability.Absent,
			Why: "learned: the decode engine answered a " + apiTitle(a) + " request without a handle",
			Fix: cmp.Or(f.Fix, "vLLM 0.19.0 or later (PRs #37424, #37535)")})
	case !stream && (rec.NoHandle == kvroute.PhaseDecode || rec.StoreRefusal == kvroute.RefuseNoHandle):
		rep.Learn(capability.NameBidirectional, capability.Fact{State: capability.Absent,
			Why: "learned: the decode engine answered a request carrying P's handle without one (bidirectional_kv_xfer off?)", Fix: capability.FixBidirectional})
	}
}

// missNote says why a later turn did not reuse.
func missNote(rec kvroute.TurnRecord) string {
	if rec.MissReason != "" {
		return "miss: " + string(rec.MissReason)
	}
	return "reuse " + string(rec.Reuse)
}

func clipAnswer(s string) string {
	if len(s) > 60 {
		return s[:60] + "…"
	}
	return s
}

func median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

// probeConversation builds the bodies of one --probe conversation.
type probeConversation struct {
	api       capability.API
	model     string
	maxTokens int
	stream    bool
	// history: chat and Messages messages, Responses input items; prompt:
	// the completions prompt.
	history []map[string]any
	prompt  string
}

func newProbeConversation(a capability.API, model string, maxTokens int, stream bool) *probeConversation {
	c := &probeConversation{api: a, model: model, maxTokens: maxTokens, stream: stream}
	mode := "non-streaming"
	if stream {
		mode = "streaming"
	}
	// Each conversation its own: no turn finds another's handle.
	c.user(probeOpening + " (Probe of " + string(a) + ", " + mode + ".)")
	return c
}

func (c *probeConversation) user(text string) {
	switch c.api {
	case capability.Completions:
		if c.prompt == "" {
			c.prompt = "User: " + text + "\nAssistant:"
		} else {
			c.prompt += "\nUser: " + text + "\nAssistant:"
		}
	case capability.Responses:
		c.history = append(c.history, map[string]any{"type": "message", "role": "user",
			"content": []map[string]any{{"type": "input_text", "text": text}}})
	default:
		c.history = append(c.history, map[string]any{"role": "user", "content": text})
	}
}

// reply appends the assistant's answer to turn and the next user message.
func (c *probeConversation) reply(text string, turn int) {
	switch c.api {
	case capability.Completions:
		c.prompt += text
	case capability.Responses:
		c.history = append(c.history, map[string]any{"type": "message", "role": "assistant", "status": "completed",
			"content": []map[string]any{{"type": "output_text", "text": text, "annotations": []any{}}}})
	default:
		c.history = append(c.history, map[string]any{"role": "assistant", "content": text})
	}
	c.user(probeFollowUps[turn%len(probeFollowUps)])
}

func (c *probeConversation) body() []byte {
	m := map[string]any{"temperature": 0, "stream": c.stream}
	if c.model != "" {
		m["model"] = c.model
	}
	switch c.api {
	case capability.Chat:
		m["messages"], m["max_tokens"] = c.history, c.maxTokens
	case capability.Completions:
		m["prompt"], m["max_tokens"] = c.prompt, c.maxTokens
	case capability.Responses:
		m["input"], m["max_output_tokens"], m["store"] = c.history, c.maxTokens, false
	case capability.Messages:
		m["messages"], m["max_tokens"] = c.history, c.maxTokens
	}
	b, _ := json.Marshal(m)
	return b
}

// answerText returns the text of an answer of API a: a body, or a stream
// whose text deltas it joins.
func answerText(a capability.API, b []byte, stream bool) (string, error) {
	if !stream {
		return bodyText(a, b)
	}
	var out strings.Builder
	rd := sse.NewReader(bytes.NewReader(b))
	for {
		ev, err := rd.Next()
		if err == io.EOF {
			return out.String(), nil
		}
		if err != nil {
			return "", err
		}
		data := bytes.TrimSpace(ev.Data)
		if len(data) == 0 || string(data) == "[DONE]" {
			continue
		}
		var m map[string]json.RawMessage
		if json.Unmarshal(data, &m) != nil {
			continue
		}
		if e, ok := m["error"]; ok && string(e) != "null" && a != capability.Messages {
			return "", fmt.Errorf("stream error: %s", clipAnswer(string(e)))
		}
		out.WriteString(deltaText(a, data))
	}
}

func bodyText(a capability.API, b []byte) (string, error) {
	var v struct {
		Choices []struct {
			Text    string `json:"text"`
			Message struct {
				Content *string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
		Output []struct {
			Type    string `json:"type"`
			Content []struct {
				Type, Text string
			} `json:"content"`
		} `json:"output"`
		Content []struct {
			Type, Text string
		} `json:"content"`
	}
	if err := json.Unmarshal(b, &v); err != nil {
		return "", fmt.Errorf("answer is not JSON: %v", err)
	}
	var out strings.Builder
	switch a {
	case capability.Chat:
		if len(v.Choices) > 0 && v.Choices[0].Message.Content != nil {
			out.WriteString(*v.Choices[0].Message.Content)
		}
	case capability.Completions:
		if len(v.Choices) > 0 {
			out.WriteString(v.Choices[0].Text)
		}
	case capability.Responses:
		for _, o := range v.Output {
			for _, c := range o.Content {
				if o.Type == "message" && c.Type == "output_text" {
					out.WriteString(c.Text)
				}
			}
		}
	case capability.Messages:
		for _, c := range v.Content {
			if c.Type == "text" {
				out.WriteString(c.Text)
			}
		}
	}
	return out.String(), nil
}

// deltaText returns the text one stream event adds.
func deltaText(a capability.API, data []byte) string {
	var v struct {
		Type    string `json:"type"`
		Delta   json.RawMessage
		Choices []struct {
			Text  string `json:"text"`
			Delta struct {
				Content *string `json:"content"`
			} `json:"delta"`
		} `json:"choices"`
	}
	if json.Unmarshal(data, &v) != nil {
		return ""
	}
	switch a {
	case capability.Chat:
		if len(v.Choices) > 0 && v.Choices[0].Delta.Content != nil {
			return *v.Choices[0].Delta.Content
		}
	case capability.Completions:
		if len(v.Choices) > 0 {
			return v.Choices[0].Text
		}
	case capability.Responses:
		var s string
		if v.Type == "response.output_text.delta" && json.Unmarshal(v.Delta, &s) == nil {
			return s
		}
	case capability.Messages:
		var d struct{ Type, Text string }
		if v.Type == "content_block_delta" && json.Unmarshal(v.Delta, &d) == nil && d.Type == "text_delta" {
			return d.Text
		}
	}
	return ""
}

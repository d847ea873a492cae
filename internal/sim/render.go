package sim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
)

// Paths of the render and tokenize endpoints (PathResponsesRender and
// PathMessagesRender are in apis.go).
const (
	PathChatRender        = "/v1/chat/completions/render"
	PathCompletionsRender = "/v1/completions/render"
	PathTokenize          = "/tokenize"
)

// Render modes of Config.Render.
const (
	// RenderEnabled serves /v1/chat/completions/render,
	// /v1/completions/render, /v1/responses/render and /v1/messages/render
	// (vLLM with the renderer).
	RenderEnabled = "enabled"
	// RenderDisabled keeps the routes but answers them as vLLM does when no
	// renderer is set up: the route raises NotImplementedError, answered
	// 501 {"error": {"message": "The model does not support Chat Completions
	// Render API", "type": "NotImplementedError", "param": null, "code": 501}}.
	RenderDisabled = "disabled"
	// RenderAbsent is an engine older than the render API: the routes do
	// not exist, 404 {"detail": "Not Found"}.
	RenderAbsent = "absent"
)

// Roles recorded for the render and tokenize endpoints.
const (
	RoleRender   = "render"
	RoleTokenize = "tokenize"
	// RoleCountTokens is POST /v1/messages/count_tokens.
	RoleCountTokens = "count_tokens"
)

// renderMode returns the effective render mode ("" is enabled).
func (c *Config) renderMode() string {
	if c.Render == "" {
		return RenderEnabled
	}
	return c.Render
}

// generateRequest is vLLM's GenerateRequest (serve/disagg/protocol.py), the
// answer of the render endpoints.
type generateRequest struct {
	RequestID      string          `json:"request_id"`
	TokenIDs       []uint32        `json:"token_ids"`
	Features       any             `json:"features"`
	SamplingParams map[string]any  `json:"sampling_params"`
	Model          json.RawMessage `json:"model"`
	Stream         bool            `json:"stream"`
	StreamOptions  json.RawMessage `json:"stream_options"`
	CacheSalt      json.RawMessage `json:"cache_salt"`
	Priority       json.RawMessage `json:"priority"`
	KVParams       json.RawMessage `json:"kv_transfer_params"`
}

// rawOr returns the body's raw value for key, or def when absent.
func rawOr(m map[string]json.RawMessage, key, def string) json.RawMessage {
	if v, ok := m[key]; ok && len(bytes.TrimSpace(v)) > 0 {
		return v
	}
	return json.RawMessage(def)
}

// samplingParams builds the subset of vLLM's SamplingParams the render
// endpoints return: the request's values where it gives them, vLLM's
// defaults otherwise. max_tokens defaults to max_model_len - prompt length
// as vLLM's get_max_tokens does; kv_transfer_params rides in extra_args as
// in to_sampling_params.
func (e *Engine) samplingParams(req *Request) map[string]any {
	m := req.Raw
	maxTokens := req.MaxTokens
	if maxTokens == 0 {
		maxTokens = max(e.maxModelLen()-len(req.Prompt), 1)
	}
	outputKind := 2 // FINAL_ONLY
	if req.Stream {
		outputKind = 1 // DELTA
	}
	stop := req.Stop
	if stop == nil {
		stop = []string{}
	}
	var extra any
	if req.KVParams != nil {
		extra = map[string]json.RawMessage{"kv_transfer_params": req.KVParams}
	}
	return map[string]any{
		"n":                             req.N,
		"presence_penalty":              rawOr(m, "presence_penalty", "0.0"),
		"frequency_penalty":             rawOr(m, "frequency_penalty", "0.0"),
		"repetition_penalty":            rawOr(m, "repetition_penalty", "1.0"),
		"temperature":                   rawOr(m, "temperature", "1.0"),
		"top_p":                         rawOr(m, "top_p", "1.0"),
		"top_k":                         rawOr(m, "top_k", "0"),
		"min_p":                         rawOr(m, "min_p", "0.0"),
		"seed":                          rawOr(m, "seed", "null"),
		"stop":                          stop,
		"stop_token_ids":                rawOr(m, "stop_token_ids", "[]"),
		"bad_words":                     rawOr(m, "bad_words", "[]"),
		"include_stop_str_in_output":    rawOr(m, "include_stop_str_in_output", "false"),
		"ignore_eos":                    req.IgnoreEOS,
		"max_tokens":                    maxTokens,
		"min_tokens":                    req.MinTokens,
		"logprobs":                      req.samplingLogprobs(),
		"prompt_logprobs":               json.RawMessage("null"),
		"skip_special_tokens":           rawOr(m, "skip_special_tokens", "true"),
		"spaces_between_special_tokens": rawOr(m, "spaces_between_special_tokens", "true"),
		"output_kind":                   outputKind,
		"structured_outputs":            json.RawMessage("null"),
		"logit_bias":                    rawOr(m, "logit_bias", "null"),
		"allowed_token_ids":             rawOr(m, "allowed_token_ids", "null"),
		"extra_args":                    extra,
	}
}

func (e *Engine) maxModelLen() int { return e.cfg.maxModelLen() }

// serveRender serves the render endpoints: the full generation body in,
// vLLM's GenerateRequest out (a list of one for completions). Responses and
// Messages bodies are rendered as their generation renders them (as chat).
func (e *Engine) serveRender(w http.ResponseWriter, r *http.Request) {
	body, rec, ok := e.readAux(w, r, RoleRender, &e.stats.RenderRequests)
	if !ok {
		return
	}
	path, api := PathCompletions, "Completions"
	switch r.URL.Path {
	case PathChatRender:
		path, api = PathChat, "Chat Completions"
	case PathResponsesRender:
		path, api = PathResponses, "Responses"
	case PathMessagesRender:
		path, api = PathMessages, "Messages"
	}
	// one GenerateRequest, but a list of one for completions
	single := path != PathCompletions
	if e.cfg.renderMode() == RenderDisabled {
		e.fail(w, rec, http.StatusNotImplemented, "The model does not support "+api+" Render API")
		return
	}
	req, err := e.parse(path, body)
	if err != nil {
		e.fail(w, rec, parseStatus(err), err.Error())
		return
	}
	if req.Model != "" && req.Model != e.cfg.Model {
		e.fail(w, rec, http.StatusNotFound, fmt.Sprintf("The model `%s` does not exist.", req.Model))
		return
	}
	if e.sleep(r.Context(), e.cfg.Profile.Render(len(req.Prompt))) != nil {
		e.finish(rec, 499, "client disconnected")
		return
	}
	reqID := "cmpl-" + randHex(16)
	switch path {
	case PathChat, PathMessages:
		reqID = "chatcmpl-" + randHex(16)
	case PathResponses:
		// ResponsesRequest.request_id
		if reqID = req.BodyRequestID; reqID == "" {
			reqID = "resp_" + uuidHex()
		}
	}
	gr := generateRequest{
		RequestID:      reqID,
		TokenIDs:       ids(req.Prompt),
		SamplingParams: e.samplingParams(req),
		Model:          rawOr(req.Raw, "model", "null"),
		Stream:         req.Stream,
		StreamOptions:  json.RawMessage("null"),
		CacheSalt:      rawOr(req.Raw, "cache_salt", "null"),
		Priority:       rawOr(req.Raw, "priority", "0"),
		KVParams:       json.RawMessage("null"),
	}
	if req.Stream {
		gr.StreamOptions = rawOr(req.Raw, "stream_options", "null")
	}
	e.mu.Lock()
	rec.PromptTokens = len(req.Prompt)
	e.mu.Unlock()
	if single {
		writeJSON(w, gr)
	} else {
		writeJSON(w, []generateRequest{gr})
	}
	e.finish(rec, http.StatusOK, "")
}

// tokenizeChatKeys are the fields vLLM's TokenizeChatRequest applies: no
// tool_choice, documents, reasoning_effort or response_format.
var tokenizeChatKeys = []string{"model", "messages", "add_generation_prompt", "continue_final_message",
	"add_special_tokens", "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs"}

// serveTokenize serves vLLM's older POST /tokenize: the chat form (with
// messages) or the completion form (with prompt), answered with count,
// max_model_len, tokens and token_strs (the token texts with
// return_token_strs, else null).
func (e *Engine) serveTokenize(w http.ResponseWriter, r *http.Request) {
	body, rec, ok := e.readAux(w, r, RoleTokenize, &e.stats.TokenizeRequests)
	if !ok {
		return
	}
	toks, m, err := e.tokenize(body)
	if err != nil {
		e.fail(w, rec, http.StatusBadRequest, err.Error())
		return
	}
	var model string
	_ = json.Unmarshal(m["model"], &model)
	if model != "" && model != e.cfg.Model {
		e.fail(w, rec, http.StatusNotFound, fmt.Sprintf("The model `%s` does not exist.", model))
		return
	}
	if e.sleep(r.Context(), e.cfg.Profile.Render(len(toks))) != nil {
		e.finish(rec, 499, "client disconnected")
		return
	}
	strs, err := laxBool(m, "return_token_strs", false)
	if err != nil {
		e.fail(w, rec, http.StatusBadRequest, err.Error())
		return
	}
	var tokenStrs []string
	if strs {
		tokenStrs = make([]string, len(toks))
		for i, t := range toks {
			tokenStrs[i] = t.Text
		}
	}
	e.mu.Lock()
	rec.PromptTokens = len(toks)
	e.mu.Unlock()
	writeJSON(w, struct {
		Count       int      `json:"count"`
		MaxModelLen int      `json:"max_model_len"`
		Tokens      []uint32 `json:"tokens"`
		TokenStrs   []string `json:"token_strs"`
	}{len(toks), e.maxModelLen(), ids(toks), tokenStrs})
	e.finish(rec, http.StatusOK, "")
}

// tokenize renders a /tokenize body: with messages through the chat
// template using only tokenizeChatKeys, else the prompt as completions do.
func (e *Engine) tokenize(body []byte) ([]Token, map[string]json.RawMessage, error) {
	m, err := decodeObject(body)
	if err != nil {
		return nil, nil, err
	}
	if _, ok := m["messages"]; ok {
		reduced := map[string]json.RawMessage{}
		for _, k := range tokenizeChatKeys {
			if v, ok := m[k]; ok {
				reduced[k] = v
			}
		}
		b, err := parseChatBody(reduced)
		if err != nil {
			return nil, nil, err
		}
		toks, err := e.renderChat(b)
		return toks, m, err
	}
	toks, err := completionPrompt(m["prompt"])
	return toks, m, err
}

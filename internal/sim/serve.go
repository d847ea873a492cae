package sim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"
)

// maxBody bounds a request body.
const maxBody = 64 << 20

// ServeHTTP serves POST /v1/chat/completions, POST /v1/completions,
// POST /v1/responses (OpenAI's Responses API), POST /v1/messages and
// POST /v1/messages/count_tokens (Anthropic's Messages API; a query string
// such as ?beta=true is ignored), their render endpoints
// (POST /v1/chat/completions/render, /v1/completions/render,
// /v1/responses/render, /v1/messages/render; see Config.Render),
// POST /tokenize (Config.NoTokenize), GET /health, GET /v1/models,
// GET /version ({"version": Config.Version}) and GET /metrics (Prometheus
// text, metrics.go: process_start_time_seconds and vLLM's scheduler and KV
// cache gauges), and the simulator's own
// GET /sim/stats (the Stats counters as JSON, for clients in other
// processes). Responses and Messages requests are rendered as chat and take
// the chat path through the engine (see apis.go); Messages errors are in
// Anthropic's shape.
func (e *Engine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/health":
		if !allow(w, r, http.MethodGet) {
			return
		}
		w.WriteHeader(http.StatusOK)
	case "/v1/models":
		if !allow(w, r, http.MethodGet) {
			return
		}
		e.serveModels(w)
	case "/metrics":
		if !allow(w, r, http.MethodGet) {
			return
		}
		e.serveMetrics(w)
	case "/version":
		if e.cfg.Version == "" {
			writeDetail(w, http.StatusNotFound, "Not Found")
			return
		}
		if !allow(w, r, http.MethodGet) {
			return
		}
		// starlette's JSONResponse: compact separators
		b, _ := json.Marshal(map[string]string{"version": e.cfg.Version})
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(b)
	case "/sim/stats":
		if !allow(w, r, http.MethodGet) {
			return
		}
		writeJSON(w, e.Stats())
	case PathChat, PathCompletions, PathResponses, PathMessages:
		if !allow(w, r, http.MethodPost) {
			return
		}
		e.serveCompletion(w, r)
	case PathCountTokens:
		if !allow(w, r, http.MethodPost) {
			return
		}
		e.serveCountTokens(w, r)
	case PathChatRender, PathCompletionsRender, PathResponsesRender, PathMessagesRender:
		if e.cfg.renderMode() == RenderAbsent {
			writeDetail(w, http.StatusNotFound, "Not Found")
			return
		}
		if !allow(w, r, http.MethodPost) {
			return
		}
		e.serveRender(w, r)
	case PathTokenize:
		if e.cfg.NoTokenize {
			writeDetail(w, http.StatusNotFound, "Not Found")
			return
		}
		if !allow(w, r, http.MethodPost) {
			return
		}
		e.serveTokenize(w, r)
	default:
		writeDetail(w, http.StatusNotFound, "Not Found")
	}
}

func allow(w http.ResponseWriter, r *http.Request, method string) bool {
	if r.Method == method {
		return true
	}
	w.Header().Set("Allow", method)
	writeDetail(w, http.StatusMethodNotAllowed, "Method Not Allowed")
	return false
}

// writeDetail answers as FastAPI does for routing errors.
func writeDetail(w http.ResponseWriter, status int, detail string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]string{"detail": detail})
}

type errorInfo struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    int     `json:"code"`
}

// ErrorBody is vLLM's ErrorResponse: {"error": {message, type, param, code}}.
func ErrorBody(status int, msg string) []byte {
	b, _ := json.Marshal(struct {
		Error errorInfo `json:"error"`
	}{errorInfo{Message: msg, Type: errorType(status), Code: status}})
	return b
}

// errorType is the error type vLLM names for status, such as
// "BadRequestError".
func errorType(status int) string {
	typ := strings.ReplaceAll(http.StatusText(status), " ", "")
	if !strings.HasSuffix(typ, "Error") {
		typ += "Error"
	}
	return typ
}

func writeError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(ErrorBody(status, msg))
}

func (e *Engine) serveModels(w http.ResponseWriter) {
	type model struct {
		ID          string  `json:"id"`
		Object      string  `json:"object"`
		Created     int64   `json:"created"`
		OwnedBy     string  `json:"owned_by"`
		Root        string  `json:"root"`
		Parent      *string `json:"parent"`
		MaxModelLen int     `json:"max_model_len"`
	}
	body := struct {
		Object string  `json:"object"`
		Data   []model `json:"data"`
	}{"list", []model{{ID: e.cfg.Model, Object: "model", Created: e.clock.Now().Unix(), OwnedBy: "vllm", Root: e.cfg.Model, MaxModelLen: e.maxModelLen()}}}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(body)
}

// newRecord appends the record of an arriving request; completion requests
// count in Stats.Requests.
func (e *Engine) newRecord(r *http.Request, body []byte, completion bool) *Record {
	rec := &Record{Path: r.URL.Path, Header: r.Header.Clone(), Body: body, RequestID: r.Header.Get("X-Request-Id")}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.records = append(e.records, rec)
	if completion {
		e.stats.Requests++
	}
	return rec
}

func (e *Engine) finish(rec *Record, status int, errMsg string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	rec.finished = true
	rec.Status = status
	if errMsg != "" {
		rec.Error = errMsg
		e.stats.Errors++
	}
	// Counts and decisions only: never prompts or bodies.
	e.log.Info("request", "role", rec.Role, "status", status, "pull", rec.Pull,
		"prompt_tokens", rec.PromptTokens, "cached", rec.CachedTokens, "pulled", rec.PulledTokens,
		"computed", rec.ComputedTokens, "completion_tokens", rec.CompletionTokens, "aborted", rec.Aborted,
		"x_request_id", rec.RequestID, "rank", rec.Rank)
}

// takeFault consumes the armed faults that apply to a completion request.
func (e *Engine) takeFault() (failStatus int, stall time.Duration) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.failN > 0 {
		e.failN--
		return e.failStatus, 0
	}
	stall, e.stall = e.stall, 0
	return 0, stall
}

func (e *Engine) serveCompletion(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBody))
	rec := e.newRecord(r, body, true)
	if err != nil {
		e.fail(w, rec, http.StatusBadRequest, "could not read body")
		return
	}
	failStatus, stall := e.takeFault()
	if failStatus != 0 {
		e.fail(w, rec, failStatus, "simulated failure")
		return
	}
	req, err := e.parse(r.URL.Path, body)
	if err != nil {
		e.fail(w, rec, parseStatus(err), err.Error())
		return
	}
	if req.Model != "" && req.Model != e.cfg.Model {
		e.fail(w, rec, http.StatusNotFound, fmt.Sprintf("The model `%s` does not exist.", req.Model))
		return
	}
	if msg := e.contextLengthError(req); msg != "" {
		e.fail(w, rec, http.StatusBadRequest, msg)
		return
	}
	if (req.Path == PathResponses && e.cfg.NoResponsesKV) || (req.Path == PathMessages && e.cfg.NoMessagesKV) {
		// an engine whose request model has no such field ignores it
		req.KVParams = nil
	}
	var offload *offloadParams
	if e.cfg.CPUTier.enabled() {
		// the offloading connector reads its keys of kv_transfer_params
		// (alone when the engine has no NixlConnector)
		offload = parseOffloadParams(req)
	}
	if e.cfg.NoKVConnector {
		// no connector: the scheduler never looks at the params
		req.KVParams = nil
	}
	t := &turn{rec: rec, req: req, toks: ids(req.Prompt), offload: offload}
	if req.KVParams != nil {
		if t.params, err = ParseParams(req.KVParams); err != nil {
			e.fail(w, rec, http.StatusBadRequest, err.Error())
			return
		}
	}
	t.role = roleOf(t.params)
	var rankErr *apiError
	if t.rank, rankErr = e.pickRank(r.Header); rankErr != nil {
		if req.Stream && req.Path != PathResponses && req.Path != PathMessages {
			// vLLM checks the rank when the stream has begun: the error
			// comes as an event of a 200 stream (the simulator answers
			// Responses and Messages streams with the plain error)
			e.streamError(w, rec, rankErr)
			return
		}
		e.fail(w, rec, rankErr.status, rankErr.msg)
		return
	}
	prefix := "chatcmpl-"
	if req.Path == PathCompletions {
		prefix = "cmpl-"
	}
	if rec.RequestID == "" {
		// vLLM falls back to the body's request_id
		rec.RequestID = req.BodyRequestID
	}
	respID := prefix + rec.RequestID
	if rec.RequestID == "" {
		respID = prefix + randHex(16)
	}
	if req.Path == PathResponses {
		// ResponsesRequest.request_id: the body's, else resp_ and a uuid
		respID = req.BodyRequestID
		if respID == "" {
			respID = "resp_" + uuidHex()
		}
	}
	e.mu.Lock()
	rec.Role, rec.PromptTokens, rec.Rank = t.role, len(t.toks), t.rank
	rec.EngineRequestID = respID + "-" + randHex(4)
	switch t.role {
	case RolePrefill:
		e.stats.PrefillRequests++
	case RoleDecode:
		e.stats.DecodeRequests++
	default:
		e.stats.PlainRequests++
	}
	e.mu.Unlock()

	ctx := r.Context()
	e.peerPrefetch(ctx, t)
	if err := e.admit(ctx, t); err != nil {
		e.gaveUp(w, t, err)
		return
	}
	if apiErr := e.execute(ctx, t); apiErr != nil {
		e.fail(w, rec, apiErr.status, apiErr.msg)
		return
	}
	// Time to first token: the read from the remote (loading), the
	// prefill and whatever preemptions cost, then any stall.
	e.mu.Lock()
	err = e.work(ctx, t, rec.Transfer)
	e.unpinTier(t) // the CPU→GPU load is done
	if err == nil {
		err = e.prefill(ctx, t)
	}
	e.mu.Unlock()
	if err == nil {
		err = realSleep(ctx, stall)
	}
	if err != nil {
		e.gaveUp(w, t, err)
		return
	}
	out := &reply{e: e, t: t, id: respID, created: e.clock.Now().Unix()}
	if req.Stream {
		out.stream(ctx, w)
		return
	}
	e.mu.Lock()
	err = e.decode(ctx, t, len(t.gens[0].Tokens))
	if err == nil {
		out.kv = e.complete(t)
	}
	e.mu.Unlock()
	if err != nil {
		e.gaveUp(w, t, err)
		return
	}
	out.json(w)
	e.finish(rec, http.StatusOK, "")
}

// gaveUp ends a request the engine could not finish: a client that went
// away (499, counted aborted) or an engine restarted under it (vLLM's
// EngineDeadError, 500).
func (e *Engine) gaveUp(w http.ResponseWriter, t *turn, err error) {
	if errors.Is(err, errEngineRestarted) {
		e.mu.Lock()
		if t.state != stateDone {
			e.finishTurn(t, false)
		}
		e.mu.Unlock()
		e.fail(w, t.rec, http.StatusInternalServerError, engineDead)
		return
	}
	e.abort(t)
	e.finish(t.rec, 499, "client disconnected")
}

// contextLengthError is vLLM's check of a request against max_model_len
// (MaxModelLen, else NumBlocks × BlockSize): the prompt must leave room
// for a token, and prompt plus max_tokens (chat: max_completion_tokens
// when given) must fit, as TokenizeParams checks them
// (vllm/renderers/params.py, _token_len_check with max_output_tokens
// from ChatCompletionRequest.build_tok_params). "" when it fits.
func (e *Engine) contextLengthError(req *Request) string {
	n, limit := len(req.Prompt), e.maxModelLen()
	switch {
	case req.MaxTokens == 0 && n >= limit:
		return fmt.Sprintf("This model's maximum context length is %d tokens. However, you requested %d tokens in the messages, Please reduce the length of the messages.", limit, n)
	case req.MaxTokens > 0 && n+req.MaxTokens > limit:
		return fmt.Sprintf("This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the messages, %d in the completion). Please reduce the length of the messages or completion.", limit, n+req.MaxTokens, n, req.MaxTokens)
	}
	return ""
}

// streamError answers a streaming request whose error vLLM raises inside
// the stream generator: a 200 event stream with one error event, written as
// Python's json.dumps writes it, then [DONE].
func (e *Engine) streamError(w http.ResponseWriter, rec *Record, apiErr *apiError) {
	msg, _ := json.Marshal(apiErr.msg)
	typ, _ := json.Marshal(errorType(apiErr.status))
	w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	_, _ = fmt.Fprintf(w, "data: {\"error\": {\"message\": %s, \"type\": %s, \"param\": null, \"code\": %d}}\n\ndata: [DONE]\n\n",
		msg, typ, apiErr.status)
	e.finish(rec, http.StatusOK, apiErr.msg)
}

// fail answers an error in the shape of the request's API: Anthropic's
// {"type": "error", "error": {"type", "message"}} for the Messages API
// (the type is the one vLLM's ErrorResponse names, as its
// translate_error_response keeps it), vLLM's ErrorResponse otherwise.
func (e *Engine) fail(w http.ResponseWriter, rec *Record, status int, msg string) {
	if rec.Path == PathMessages || rec.Path == PathCountTokens {
		writeAnthropicError(w, status, msg)
	} else {
		writeError(w, status, msg)
	}
	e.finish(rec, status, msg)
}

// AnthropicErrorBody is vLLM's AnthropicErrorResponse for status:
// {"type": "error", "error": {"type": "BadRequestError", "message": msg}}.
func AnthropicErrorBody(status int, msg string) []byte {
	type info struct {
		Type    string `json:"type"`
		Message string `json:"message"`
	}
	b, _ := json.Marshal(struct {
		Type  string `json:"type"`
		Error info   `json:"error"`
	}{"error", info{Type: errorType(status), Message: msg}})
	return b
}

func writeAnthropicError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(AnthropicErrorBody(status, msg))
}

// parseStatus is the status of a parse error: 404 for a missing stored
// response, 400 otherwise.
func parseStatus(err error) int {
	if errors.Is(err, errNotFound) {
		return http.StatusNotFound
	}
	return http.StatusBadRequest
}

// readAux reads the body of a request that generates nothing (render,
// tokenize, count_tokens) and records it under role, counting it in *count
// (a field of e.stats). On a body it cannot read it answers 400 and
// reports false.
func (e *Engine) readAux(w http.ResponseWriter, r *http.Request, role string, count *int) ([]byte, *Record, bool) {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBody))
	rec := e.newRecord(r, body, false)
	e.mu.Lock()
	rec.Role = role
	*count++
	e.mu.Unlock()
	if err != nil {
		e.fail(w, rec, http.StatusBadRequest, "could not read body")
		return nil, rec, false
	}
	return body, rec, true
}

// serveCountTokens serves POST /v1/messages/count_tokens: the Messages
// body rendered as generation would render it, answered
// {"input_tokens": n, "context_management": {"original_input_tokens": n}}.
// It counts in Stats.TokenizeRequests, not in Requests.
func (e *Engine) serveCountTokens(w http.ResponseWriter, r *http.Request) {
	body, rec, ok := e.readAux(w, r, RoleCountTokens, &e.stats.TokenizeRequests)
	if !ok {
		return
	}
	req, err := e.parse(PathCountTokens, body)
	if err != nil {
		e.fail(w, rec, parseStatus(err), err.Error())
		return
	}
	if req.Model != e.cfg.Model {
		e.fail(w, rec, http.StatusNotFound, fmt.Sprintf("The model `%s` does not exist.", req.Model))
		return
	}
	if e.sleep(r.Context(), e.cfg.Profile.Render(len(req.Prompt))) != nil {
		e.finish(rec, 499, "client disconnected")
		return
	}
	e.mu.Lock()
	rec.PromptTokens = len(req.Prompt)
	e.mu.Unlock()
	type management struct {
		OriginalInputTokens int `json:"original_input_tokens"`
	}
	writeJSON(w, struct {
		InputTokens       int        `json:"input_tokens"`
		ContextManagement management `json:"context_management"`
	}{len(req.Prompt), management{len(req.Prompt)}})
	e.finish(rec, http.StatusOK, "")
}

// sleep waits a modelled duration: on a Sleeper clock in full, otherwise in
// real time divided by the speed (never when the speed is 0). It returns
// ctx's error when the client went away.
func (e *Engine) sleep(ctx context.Context, d time.Duration) error {
	if d > 0 {
		if s, ok := e.clock.(Sleeper); ok {
			if err := s.Sleep(ctx, d); err != nil {
				return err
			}
		} else if e.cfg.Speed > 0 {
			return realSleep(ctx, time.Duration(float64(d)/e.cfg.Speed))
		}
	}
	return ctx.Err()
}

func realSleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// errCut is the panic value that cuts a connection (http.ErrAbortHandler).
var errCut = http.ErrAbortHandler

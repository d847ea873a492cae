package main

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/capability"
	"github.com/bidikv/bidikv/sse"
)

// maxModelsBytes bounds the /v1/models body copied from an engine.
const maxModelsBytes = 1 << 20

// server holds the proxy's routes.
type server struct {
	router   *kvroute.Router
	health   *health
	metrics  *metrics
	client   *http.Client // for /v1/models
	upstream string       // upstream API key, "" for none
	keys     []inboundKey // the accepted inbound keys; none: open
	// metricsKey requires an inbound key on /metrics (--metrics-require-key).
	metricsKey bool
	log        *slog.Logger

	maxHeaderBytes  int
	maxBodyBytes    int64
	readBodyTimeout time.Duration
	writeTimeout    time.Duration // per write of a turn's response, 0: none
	adm             *admission
	open            *openTurns
}

// route is one path's handler and the methods it serves.
type route struct {
	methods []string
	h       http.Handler
}

// routes returns the proxy's handler. Paths match exactly (no redirects
// for trailing slashes or unclean paths); a known path with another method
// gets 405 with Allow, an unknown one 404, both in OpenAI's error shape.
func (s *server) routes() http.Handler {
	post := []string{http.MethodPost}
	get := []string{http.MethodGet, http.MethodHead}
	turns := s.auth(s.admit(s.router))
	table := map[string]route{
		pathCountTokens: {post, s.auth(s.admit(http.HandlerFunc(s.countTokens)))},
		"/v1/models":    {get, s.auth(http.HandlerFunc(s.models))},
		"/health":       {get, http.HandlerFunc(s.live)},
		"/healthcheck":  {get, http.HandlerFunc(s.live)}, // the reference proxy's name
		"/ready":        {get, http.HandlerFunc(s.ready)},
		"/metrics":      {get, s.metricsHandler()},
	}
	// The router's APIs, from its registry.
	for _, a := range routerAPIs {
		table[a.Path] = route{post, turns}
	}
	return s.access(s.headerLimit(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Body != nil && r.Body != http.NoBody {
			// Every body, read or not: net/http discards what a handler
			// left unread, and would wait for a trickling client for ever.
			// A turn lifts it once its body is in.
			_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(s.readBodyTimeout))
		}
		if s.ambiguousLength(w, r) {
			return
		}
		rt, ok := table[r.URL.Path]
		if strings.HasPrefix(r.URL.Path, pathConversations) {
			// DELETE /v1/conversations/{id}: the router ends a
			// conversation keyed by id (kvroute.Router.ServeHTTP).
			rt, ok = route{[]string{http.MethodDelete}, s.auth(s.router)}, true
		}
		switch {
		case r.ProtoMajor != 1 || r.Method == "PRI":
			// HTTP/2 with prior knowledge (h2c): its preface parses as
			// "PRI * HTTP/2.0". Not a missing route: a protocol this
			// server does not speak in clear text.
			w.Header().Set("Connection", "close")
			s.reject(w, r, http.StatusHTTPVersionNotSupported, "http_version",
				"HTTP/2 without TLS (prior knowledge) is not served: use HTTP/1.1")
		case !ok:
			s.reject(w, r, http.StatusNotFound, "not_found", "no route for "+r.Method+" "+r.URL.Path)
		case !slices.Contains(rt.methods, r.Method):
			w.Header().Set("Allow", strings.Join(rt.methods, ", "))
			s.reject(w, r, http.StatusMethodNotAllowed, "method_not_allowed", r.URL.Path+" takes "+strings.Join(rt.methods, " or ")+", not "+r.Method)
		default:
			rt.h.ServeHTTP(w, r)
		}
	})))
}

// metricsHandler serves /metrics; with --metrics-require-key it takes an
// inbound API key like the API routes (its labels name the engines' URLs).
func (s *server) metricsHandler() http.Handler {
	if s.metricsKey {
		return s.auth(s.metrics.handler())
	}
	return s.metrics.handler()
}

// headerLimit answers 431 in OpenAI's error shape when the request line
// and headers exceed --max-header-bytes. net/http's own limit
// (http.Server.MaxHeaderBytes, set to the same value) has 4 KiB of slack,
// so this is the exact one; above net/http's, its plain-text 431 is
// rewritten to JSON by jsonErrorConn.
func (s *server) headerLimit(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if headerSize(r) > s.maxHeaderBytes {
			w.Header().Set("Connection", "close")
			s.reject(w, r, http.StatusRequestHeaderFieldsTooLarge, "headers_too_large",
				"request line and headers larger than "+strconv.Itoa(s.maxHeaderBytes)+" bytes")
			return
		}
		next.ServeHTTP(w, r)
	})
}

// headerSize is the size of the request line and headers as sent.
func headerSize(r *http.Request) int {
	n := len(r.Method) + 1 + len(r.RequestURI) + 1 + len(r.Proto) + 2
	if r.Host != "" {
		n += len("Host: ") + len(r.Host) + 2
	}
	for k, vs := range r.Header {
		for _, v := range vs {
			n += len(k) + 2 + len(v) + 2
		}
	}
	return n + 2
}

// access gives every request an X-Request-Id (the client's, or a new one,
// which the router then sends to both engines) and logs one line per
// request, without bodies, queries or credentials.
func (s *server) access(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		id := r.Header.Get("X-Request-Id")
		// One backing array for the id's header values (each header gets
		// its own element, so none can change another's).
		fresh := id == ""
		if fresh {
			id = newRequestID()
		}
		ids := []string{id, id, id}
		if fresh {
			r.Header["X-Request-Id"] = ids[0:1:1]
		}
		rw := &statusWriter{ResponseWriter: w}
		rw.Header()["X-Request-Id"] = ids[1:2:2]
		if anthropicPath(r.URL.Path) {
			// Anthropic's header: its SDKs report it (requestID, _request_id).
			rw.Header()["Request-Id"] = ids[2:3:3]
		}
		next.ServeHTTP(rw, r)
		level := slog.LevelInfo
		if r.URL.Path == "/health" || r.URL.Path == "/ready" || r.URL.Path == "/metrics" || r.URL.Path == "/healthcheck" {
			level = slog.LevelDebug
		}
		s.log.LogAttrs(r.Context(), level, "request",
			slog.String("request_id", id), slog.String("method", r.Method), slog.String("path", r.URL.Path),
			slog.Int("status", rw.code()), slog.String("reuse", rw.Header().Get("X-Bidikv-Reuse")),
			slog.Int64("bytes", rw.n), slog.Duration("duration", time.Since(start)))
	})
}

// auth requires one of the inbound API keys, when any is configured, as
// Authorization: Bearer KEY (OpenAI's SDKs, current Anthropic SDKs; the
// scheme in any case, RFC 7235) or X-Api-Key: KEY (Anthropic's API header:
// Claude Code, older Anthropic SDKs). Every key the request carries must
// be the same accepted key: a request with two different keys, or one
// accepted and one not, gets 401. The request's principal is then that
// key's (kvroute.KeyPrincipal): the key, never the header that carried
// it, is the tenant, so one key by either header is one tenant and two
// keys are two.
func (s *server) auth(next http.Handler) http.Handler {
	if len(s.keys) == 0 {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if p, ok := s.authenticate(r.Header); ok {
			next.ServeHTTP(w, r.WithContext(kvroute.ContextWithPrincipal(r.Context(), p)))
			return
		}
		w.Header().Set("WWW-Authenticate", `Bearer realm="bidikv"`)
		s.reject(w, r, http.StatusUnauthorized, "unauthorized", "invalid or missing API key")
	})
}

// inboundKey is an accepted inbound API key: its digest, compared in
// constant time, and its principal.
type inboundKey struct {
	digest    [32]byte
	principal string
}

func newInboundKey(k string) inboundKey {
	return inboundKey{digest: sha256.Sum256([]byte(k)), principal: kvroute.KeyPrincipal(k)}
}

// authenticate returns the principal of the one accepted key that every
// key in h names: each Bearer token of Authorization (another scheme is
// not the proxy's and is ignored) and each X-Api-Key value, empty ones
// ignored. No key, an unknown key or two different keys: false.
func (s *server) authenticate(h http.Header) (string, bool) {
	matched := -1
	check := func(tok string) bool {
		d := sha256.Sum256([]byte(tok))
		idx := -1
		for i := range s.keys { // every key compared: constant time over the set
			if subtle.ConstantTimeCompare(d[:], s.keys[i].digest[:]) == 1 {
				idx = i
			}
		}
		if idx < 0 || (matched >= 0 && idx != matched) {
			return false
		}
		matched = idx
		return true
	}
	for _, v := range h.Values("Authorization") {
		if tok := bearerToken(v); tok != "" && !check(tok) {
			return "", false
		}
	}
	for _, v := range h.Values("X-Api-Key") {
		if v = strings.Trim(v, " \t"); v != "" && !check(v) {
			return "", false
		}
	}
	if matched < 0 {
		return "", false
	}
	return s.keys[matched].principal, true
}

// bearerToken returns the token of an Authorization value of the Bearer
// scheme, in any case and with any spaces around; "" for another scheme.
func bearerToken(v string) string {
	v = strings.Trim(v, " \t")
	i := strings.IndexAny(v, " \t")
	if i < 0 || !strings.EqualFold(v[:i], "Bearer") {
		return ""
	}
	return strings.Trim(v[i:], " \t")
}

// live answers 200 while the process serves.
func (s *server) live(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, `{"status":"ok"}`)
}

// engineState is one engine in /ready: its health and what the router
// knows of it.
type engineState struct {
	Role     string `json:"role"`
	Endpoint string `json:"endpoint"`
	Up       bool   `json:"up"`
	// Reason says why the engine is down (its /health probe's error or
	// status); empty when it is up.
	Reason string `json:"reason,omitempty"`
	// BlockSize is the KV block size the router checks the engine's
	// handles at, and where it comes from: "engine" (its /metrics) or
	// "configured" (--block-size); 0 while unknown.
	BlockSize       int    `json:"block_size,omitempty"`
	BlockSizeSource string `json:"block_size_source,omitempty"`
	// KVGroups is the number of KV-cache groups in its last handle.
	KVGroups int `json:"kv_groups,omitempty"`
	// NoReuse says why the engine serves without reuse now: its handles
	// did not fit its block size (bidikv_unvalidated_handles_total).
	NoReuse string `json:"no_reuse,omitempty"`
	// NoCapacity says why decode memory management is off for a decode
	// engine, and the fix: its KV capacity is unknown
	// (bidikv_decode_kv_capacity_unknown_total).
	NoCapacity string `json:"no_capacity,omitempty"`
	// Capabilities is the last capability probe's report (null before
	// the first that reached the engine).
	Capabilities *capability.Report `json:"capabilities"`
}

// ready probes the engines now: 200 when at least one prefill and one
// decode engine answer their /health, else 503; each engine is listed
// with why it is down and how the router sees it.
func (s *server) ready(w http.ResponseWriter, r *http.Request) {
	p, d := s.health.check(r.Context())
	status := http.StatusOK
	if !p || !d {
		status = http.StatusServiceUnavailable
	}
	routed := routerStatus(s.router)
	var engines []engineState
	for _, e := range s.health.list() {
		es := engineState{Role: e.role, Endpoint: e.url, Up: e.up.Load(), Reason: e.down(), Capabilities: e.caps.Load()}
		if st := routed(e.role, e.url); st != nil {
			es.BlockSize, es.BlockSizeSource, es.KVGroups, es.NoReuse = st.BlockSize, st.BlockSizeSource, st.KVGroups, st.NoReuse
			if st.NoCapacity != "" {
				es.NoCapacity = noCapacityFix(st.NoCapacity)
			}
		}
		engines = append(engines, es)
	}
	b, _ := json.Marshal(struct {
		Ready   bool          `json:"ready"`
		Prefill bool          `json:"prefill"`
		Decode  bool          `json:"decode"`
		Engines []engineState `json:"engines"`
	}{p && d, p, d, engines})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// noCapacityFix says that decode memory management is off for an engine
// whose KV capacity is unknown (why), and the fix.
func noCapacityFix(why string) string {
	return "decode memory management off: KV capacity unknown (" + why + "); set --decode-kv-capacity to its KV capacity in tokens, or run the engine with vllm:cache_config_info on /metrics (no --disable-log-stats)"
}

// pathCountTokens is Anthropic's token count (vLLM serves it): Claude Code
// asks it before long requests.
const pathCountTokens = "/v1/messages/count_tokens"

// pathConversations is where a client deletes a conversation it keys by id
// (--key-mode conversation-id): the router drops its handle and releases
// its decode hold.
const pathConversations = "/v1/conversations/"

// models forwards GET /v1/models to the first engine that answers.
func (s *server) models(w http.ResponseWriter, r *http.Request) {
	s.passThrough(w, r, nil)
}

// countTokens forwards POST /v1/messages/count_tokens (its query, such as
// ?beta=true, included) to the first engine that answers: it renders the
// prompt and touches no KV, so any engine can. The body is bounded by
// --max-body-bytes.
func (s *server) countTokens(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.maxBodyBytes))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			s.reject(w, r, http.StatusRequestEntityTooLarge, "too_large", "request body larger than "+strconv.FormatInt(s.maxBodyBytes, 10)+" bytes")
			return
		}
		if r.Context().Err() == nil {
			writeError(w, r, http.StatusBadRequest, "reading the request body: "+err.Error())
		}
		return
	}
	s.passThrough(w, r, body)
}

// passThrough sends r's method, path and query (and body, if not nil) to
// the first engine that answers below 500, trying those last seen healthy
// first, and copies its answer: for calls any engine serves alike.
func (s *server) passThrough(w http.ResponseWriter, r *http.Request, body []byte) {
	target := r.URL.Path
	if r.URL.RawQuery != "" {
		target += "?" + r.URL.RawQuery
	}
	for _, e := range s.health.ordered() {
		var rd io.Reader
		if body != nil {
			rd = bytes.NewReader(body)
		}
		req, err := http.NewRequestWithContext(r.Context(), r.Method, e.url+target, rd)
		if err != nil {
			continue
		}
		if body != nil {
			req.Header.Set("Content-Type", "application/json")
		}
		if s.upstream != "" {
			req.Header.Set("Authorization", "Bearer "+s.upstream)
		}
		req.Header.Set("X-Request-Id", r.Header.Get("X-Request-Id"))
		resp, err := s.client.Do(req)
		if err != nil {
			if r.Context().Err() != nil {
				return
			}
			continue
		}
		b, err := io.ReadAll(io.LimitReader(resp.Body, maxModelsBytes))
		_ = resp.Body.Close()
		if err != nil || resp.StatusCode >= 500 {
			continue
		}
		// Through the mechanism every engine answer takes on its way to a
		// client: JSON without kv_transfer_params, or not at all.
		if b, _, err = sse.Scrub(nil, b); err != nil || resp.Header.Get("Content-Encoding") != "" {
			writeError(w, r, http.StatusBadGateway, "the engine's answer to "+r.URL.Path+" cannot be forwarded safely")
			return
		}
		w.Header().Set("Content-Type", resp.Header.Get("Content-Type"))
		w.Header().Set("Content-Length", strconv.Itoa(len(b)))
		w.WriteHeader(resp.StatusCode)
		_, _ = w.Write(b)
		return
	}
	writeError(w, r, http.StatusServiceUnavailable, "no engine answered "+r.URL.Path)
}

// reject answers an error the proxy decides itself and counts it in
// bidikv_rejected_requests_total.
func (s *server) reject(w http.ResponseWriter, r *http.Request, status int, reason, msg string) {
	s.metrics.rejected.WithLabelValues(strconv.Itoa(status), reason).Inc()
	writeError(w, r, status, msg)
}

// writeError answers in the error shape of r's API: Anthropic's for
// /v1/messages and its sub-paths, else OpenAI's.
func writeError(w http.ResponseWriter, r *http.Request, status int, msg string) {
	b := errorBodyFor(r.URL.Path, status, msg)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// errorBody renders msg in OpenAI's error shape, with a type and code
// that follow from the status.
func errorBody(status int, msg string) []byte {
	typ, code := "invalid_request_error", "invalid_request"
	switch status {
	case http.StatusUnauthorized:
		typ, code = "authentication_error", "invalid_api_key"
	case http.StatusNotFound:
		code = "not_found"
	case http.StatusMethodNotAllowed:
		code = "method_not_allowed"
	case http.StatusRequestTimeout:
		code = "request_timeout"
	case http.StatusRequestEntityTooLarge:
		code = "request_too_large"
	case http.StatusRequestHeaderFieldsTooLarge:
		code = "headers_too_large"
	case http.StatusNotImplemented:
		code = "not_implemented"
	case http.StatusHTTPVersionNotSupported:
		code = "http_version_not_supported"
	case http.StatusServiceUnavailable:
		typ, code = "server_error", "upstream_unavailable"
	}
	if status >= 500 && status != http.StatusNotImplemented && status != http.StatusHTTPVersionNotSupported {
		typ = "server_error"
	}
	return errorJSON(msg, typ, code)
}

// anthropicPath reports whether path is one of the router's APIs whose
// errors take Anthropic's shape (Messages), or a path below it
// (count_tokens).
func anthropicPath(path string) bool {
	a, ok := apiAt(path)
	return ok && a.ErrorShape == "anthropic"
}

// routerAPIs are the APIs kvroute serves (its registry).
var routerAPIs = kvroute.APIs()

// apiAt returns the router's API at path, or the one whose Anthropic-shaped
// errors the paths below it share.
func apiAt(path string) (kvroute.API, bool) {
	for _, a := range routerAPIs {
		if path == a.Path || (a.ErrorShape == "anthropic" && strings.HasPrefix(path, a.Path+"/")) {
			return a, true
		}
	}
	return kvroute.API{}, false
}

// errorBodyFor renders msg in the error shape of the API at path.
func errorBodyFor(path string, status int, msg string) []byte {
	if anthropicPath(path) {
		return anthropicErrorBody(status, msg)
	}
	return errorBody(status, msg)
}

// proxyError is an error the proxy decides with its own OpenAI type and
// code, in the error shape of the API at path.
func proxyError(path string, status int, msg, typ, code string) []byte {
	if anthropicPath(path) {
		return anthropicErrorBody(status, msg)
	}
	return errorJSON(msg, typ, code)
}

// anthropicErrorBody is Anthropic's error body, as the router writes it.
func anthropicErrorBody(status int, msg string) []byte {
	return kvroute.ErrorBody(kvroute.PathMessages, status, errors.New("proxy: "+msg))
}

// responsesErrorJSON is the data of the Responses API's stream error event
// (event: error), as kvroute.Response.ErrorEvent writes it, with the proxy's
// prefix and code.
func responsesErrorJSON(msg, code string, seq int64) []byte {
	b, _ := json.Marshal(map[string]any{"type": "error", "code": code, "message": "proxy: " + msg, "param": nil, "sequence_number": seq})
	return b
}

// errorJSON is OpenAI's error body.
func errorJSON(msg, typ, code string) []byte {
	b, _ := json.Marshal(map[string]any{"error": map[string]any{
		"message": "proxy: " + msg, "type": typ, "param": nil, "code": code}})
	return b
}

func newRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// statusWriter records the status and size of a response. Unwrap lets
// http.ResponseController reach the connection's Flush.
type statusWriter struct {
	http.ResponseWriter
	status int
	n      int64
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	n, err := w.ResponseWriter.Write(p)
	w.n += int64(n)
	return n, err
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func (w *statusWriter) code() int {
	if w.status == 0 {
		return http.StatusOK
	}
	return w.status
}

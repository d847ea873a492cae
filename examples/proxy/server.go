package main

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/bidikv/bidikv/kvroute"
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
	keys     [][32]byte   // digests of the accepted inbound keys; none: open
	log      *slog.Logger
}

// routes returns the proxy's handler.
func (s *server) routes() http.Handler {
	mux := http.NewServeMux()
	turns := s.auth(s.inflight(s.router))
	mux.Handle("POST "+kvroute.PathChatCompletions, turns)
	mux.Handle("POST "+kvroute.PathCompletions, turns)
	mux.Handle("GET /v1/models", s.auth(http.HandlerFunc(s.models)))
	mux.HandleFunc("GET /health", s.live)
	mux.HandleFunc("GET /healthcheck", s.live) // the reference proxy's name
	mux.HandleFunc("GET /ready", s.ready)
	mux.Handle("GET /metrics", s.metrics.handler())
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "no route for "+r.Method+" "+r.URL.Path)
	})
	return s.access(mux)
}

// access gives every request an X-Request-Id (the client's, or a new one,
// which the router then sends to both engines) and logs one line per
// request, without bodies, queries or credentials.
func (s *server) access(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		id := r.Header.Get("X-Request-Id")
		if id == "" {
			id = newRequestID()
			r.Header.Set("X-Request-Id", id)
		}
		rw := &statusWriter{ResponseWriter: w}
		rw.Header().Set("X-Request-Id", id)
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

// auth requires one of the inbound API keys, when any is configured.
func (s *server) auth(next http.Handler) http.Handler {
	if len(s.keys) == 0 {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if ok {
			d := sha256.Sum256([]byte(strings.TrimSpace(tok)))
			match := 0
			for i := range s.keys {
				match |= subtle.ConstantTimeCompare(d[:], s.keys[i][:])
			}
			if match == 1 {
				next.ServeHTTP(w, r)
				return
			}
		}
		w.Header().Set("WWW-Authenticate", `Bearer realm="bidikv"`)
		writeError(w, http.StatusUnauthorized, "invalid or missing API key")
	})
}

// inflight counts the completion requests being served.
func (s *server) inflight(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.metrics.inflight.Inc()
		defer s.metrics.inflight.Dec()
		next.ServeHTTP(w, r)
	})
}

// live answers 200 while the process serves.
func (s *server) live(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, `{"status":"ok"}`)
}

// ready probes the engines now: 200 when at least one prefill and one
// decode engine answer their /health, else 503.
func (s *server) ready(w http.ResponseWriter, r *http.Request) {
	p, d := s.health.check(r.Context())
	status := http.StatusOK
	if !p || !d {
		status = http.StatusServiceUnavailable
	}
	b, _ := json.Marshal(struct {
		Ready   bool `json:"ready"`
		Prefill bool `json:"prefill"`
		Decode  bool `json:"decode"`
	}{p && d, p, d})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// models forwards GET /v1/models to the first engine that answers,
// trying those last seen healthy first.
func (s *server) models(w http.ResponseWriter, r *http.Request) {
	for _, e := range s.health.ordered() {
		req, err := http.NewRequestWithContext(r.Context(), http.MethodGet, e.url+"/v1/models", nil)
		if err != nil {
			continue
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
		body, err := io.ReadAll(io.LimitReader(resp.Body, maxModelsBytes))
		_ = resp.Body.Close()
		if err != nil || resp.StatusCode >= 500 {
			continue
		}
		w.Header().Set("Content-Type", resp.Header.Get("Content-Type"))
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		w.WriteHeader(resp.StatusCode)
		_, _ = w.Write(body)
		return
	}
	writeError(w, http.StatusServiceUnavailable, "no engine answered /v1/models")
}

// writeError answers in OpenAI's error shape.
func writeError(w http.ResponseWriter, status int, msg string) {
	typ, code := "server_error", "upstream_unavailable"
	switch status {
	case http.StatusUnauthorized:
		typ, code = "authentication_error", "invalid_api_key"
	case http.StatusNotFound:
		typ, code = "invalid_request_error", "not_found"
	}
	b, _ := json.Marshal(map[string]any{"error": map[string]any{
		"message": "proxy: " + msg, "type": typ, "param": nil, "code": code}})
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, _ = w.Write(b)
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

package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"syscall"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/sse"
	"github.com/bidikv/bidikv/transport"
)

// local serves a turn that carries no x-prefiller-host-port on the local
// engine alone, as llm-d's sidecar does, as a plain request: the client's
// body without any kv_transfer_params (a client never hands an engine a
// handle), so the engine computes the prompt from its own prefix cache,
// holds nothing and returns no handle. Its answer reaches the client
// through the scrubber all engine answers take (sse.Scrub, sse.ScrubEvent).
// Nothing is looked up or retained: the conversation's handle, if any,
// stays in the store for its next disaggregated turn.
func (sc *sidecar) local(w http.ResponseWriter, r *http.Request, rank int) {
	// The admission's reader charges the body and, when the proxy stops it
	// (budget, turn slots, deadline), its answer replaces this one.
	body, err := readLimitedBody(r.Body, sc.maxBodyBytes)
	switch {
	case errors.Is(err, errBodyTooLarge):
		writeError(w, r, http.StatusRequestEntityTooLarge, "request body larger than "+strconv.FormatInt(sc.maxBodyBytes, 10)+" bytes") // counted by admit
		return
	case err != nil:
		if r.Context().Err() == nil {
			writeError(w, r, http.StatusBadRequest, "reading the request body: "+err.Error())
		}
		return
	}
	obj, err := jsonraw.ParseLimited(body, sc.cfg.maxObjectMembers)
	if err != nil {
		writeError(w, r, http.StatusBadRequest, "the request body is not a JSON object: "+err.Error())
		return
	}
	sc.send(w, r, sc.locals[rank], obj.Edit([]string{sse.HandleKey}))
}

// send posts body to the engine at base on r's path and query and writes
// its answer to w through the scrubber.
func (sc *sidecar) send(w http.ResponseWriter, r *http.Request, base string, body []byte) {
	u, err := url.Parse(base + r.URL.RequestURI())
	if err != nil {
		writeError(w, r, http.StatusBadGateway, "the local engine's address: "+err.Error())
		return
	}
	req, err := http.NewRequestWithContext(r.Context(), http.MethodPost, u.String(), bytes.NewReader(body))
	if err != nil {
		writeError(w, r, http.StatusBadGateway, err.Error())
		return
	}
	req.Header = transport.RequestHeader(r.Header)
	req.Header.Set("Content-Type", "application/json")
	if sc.upstream != "" {
		req.Header.Set("Authorization", "Bearer "+sc.upstream)
	}
	resp, err := sc.engines.Do(req, transport.Deadlines{FirstByte: sc.cfg.firstByteTimeout, Idle: sc.cfg.idleTimeout})
	if err != nil {
		sc.upstreamFailed(w, r, err)
		return
	}
	defer resp.Body.Close()
	copyAnswerHeader(w.Header(), resp.Header)
	if isEventStream(resp.Header.Get("Content-Type")) && resp.StatusCode == http.StatusOK {
		w.WriteHeader(resp.StatusCode)
		sc.scrubStream(w, resp.Body)
		return
	}
	b, err := readLimitedBody(resp.Body, sc.maxBodyBytes)
	if err != nil {
		if r.Context().Err() == nil {
			writeError(w, r, http.StatusBadGateway, "reading the decode engine's answer: "+err.Error())
		}
		return
	}
	out, _, err := sse.Scrub(nil, b)
	if err != nil || resp.Header.Get("Content-Encoding") != "" {
		writeError(w, r, http.StatusBadGateway, "the decode engine's answer to "+r.URL.Path+" cannot be forwarded safely")
		return
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(out)))
	w.WriteHeader(resp.StatusCode)
	_, _ = w.Write(out)
}

// upstreamFailed answers a failed engine call in the API's error shape: 503
// when the engine refused the connection (it is not up: llm-d answers 503
// too), 504 on a deadline, else 502.
func (sc *sidecar) upstreamFailed(w http.ResponseWriter, r *http.Request, err error) {
	if r.Context().Err() != nil {
		return
	}
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		w.Header().Set("Retry-After", strconv.Itoa(retryAfterSeconds))
		writeError(w, r, http.StatusServiceUnavailable, "decode: the local engine is not ready: "+err.Error())
	case errors.Is(err, transport.ErrFirstByteTimeout) || errors.Is(err, context.DeadlineExceeded):
		writeError(w, r, http.StatusGatewayTimeout, "decode: "+err.Error())
	default:
		writeError(w, r, http.StatusBadGateway, "decode: "+err.Error())
	}
}

// scrubStream forwards an event stream, each event through
// sse.ScrubEvent, flushing after each; an event that cannot be forwarded
// safely ends the stream.
func (sc *sidecar) scrubStream(w http.ResponseWriter, body io.Reader) {
	rd := sse.NewReader(body)
	ctl := http.NewResponseController(w)
	var buf []byte
	for {
		ev, err := rd.Next()
		if err != nil {
			return
		}
		out, _, err := sse.ScrubEvent(buf[:0], ev, ev.Data, false)
		if err != nil {
			sc.log.Warn("sidecar: a decode stream event could not be forwarded safely; the stream was cut", "err", err.Error())
			return
		}
		if len(out) > 0 {
			if _, err := w.Write(out); err != nil {
				return
			}
			if err := ctl.Flush(); err != nil {
				return
			}
		}
		if cap(out) > cap(buf) {
			buf = out
		}
	}
}

// copyAnswerHeader copies an engine's answer headers but its Server and
// Date (the proxy's own Date goes out) and its hop-by-hop ones.
func copyAnswerHeader(dst, src http.Header) {
	transport.CopyHeader(dst, src)
	dst.Del("Server")
	dst.Del("Date")
}

// readLimitedBody reads a body of at most limit bytes.
func readLimitedBody(r io.Reader, limit int64) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(r, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, errBodyTooLarge
	}
	return b, nil
}

// errBodyTooLarge: an answer above --max-body-bytes.
var errBodyTooLarge = errors.New("larger than --max-body-bytes")

// passThrough is the reverse proxy of every other path to the local engine
// of rank, as llm-d's sidecar has (vLLM's /v1/models, /tokenize, the render
// routes, /v1/embeddings...): bodies go as they are; JSON answers and event
// streams go through the scrubber, and answers it cannot read (compressed
// ones: the proxy asks for none) are refused with 502.
func (sc *sidecar) passThrough(rank int) http.Handler {
	target, _ := url.Parse(sc.locals[rank])
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.Out.Header.Del("Accept-Encoding")
			if sc.upstream != "" {
				pr.Out.Header.Set("Authorization", "Bearer "+sc.upstream)
			}
		},
		Transport:     sc.rt,
		FlushInterval: -1,
		ModifyResponse: func(resp *http.Response) error {
			resp.Header.Del("Server")
			resp.Header.Del("Date")
			ct := resp.Header.Get("Content-Type")
			switch {
			case isEventStream(ct):
				pr, pw := io.Pipe()
				body := resp.Body
				go func() {
					sc.scrubStream(pipeWriter{pw}, body)
					_ = body.Close()
					_ = pw.Close()
				}()
				resp.Body = pr
			case strings.HasPrefix(ct, "application/json") || resp.Header.Get("Content-Encoding") != "" && ct == "":
				b, err := readLimitedBody(resp.Body, sc.maxBodyBytes)
				_ = resp.Body.Close()
				if err != nil {
					return err
				}
				out, _, err := sse.Scrub(nil, b)
				if err != nil || resp.Header.Get("Content-Encoding") != "" {
					return errUnsafeAnswer
				}
				resp.Body = io.NopCloser(bytes.NewReader(out))
				resp.ContentLength = int64(len(out))
				resp.Header.Set("Content-Length", strconv.Itoa(len(out)))
			}
			return nil
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if errors.Is(err, errUnsafeAnswer) {
				writeError(w, r, http.StatusBadGateway, "the local engine's answer to "+r.URL.Path+" cannot be forwarded safely")
				return
			}
			sc.upstreamFailed(w, r, err)
		},
	}
	return rp
}

// errUnsafeAnswer: an engine answer the scrubber cannot read.
var errUnsafeAnswer = errors.New("an engine answer that cannot be forwarded safely")

// pipeWriter is an http.ResponseWriter over a pipe, for scrubStream in a
// reverse proxy's response body: Flush is a no-op (the proxy flushes each
// read, FlushInterval -1).
type pipeWriter struct{ *io.PipeWriter }

func (pipeWriter) Header() http.Header { return http.Header{} }
func (pipeWriter) WriteHeader(int)     {}
func (pipeWriter) Flush()              {}

package main

import (
	"bytes"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute"
)

// llm-d's sidecar rewrites usage.prompt_tokens_details.cached_tokens of the
// decode engine's answer to the prefill engine's count: the prompt tokens
// that did not have to be computed on P (its prefix cache, and with bidikv
// the KV pulled from a decode engine), not the ones D read from P. The
// sidecar does the same for chat and completions, whose usage has that
// member; Responses and Messages answers keep their own usage (llm-d would
// add chat's member to them).

// maxTappedAnswer bounds the prefill answer the tap keeps to read its
// usage: P's answer is one token.
const maxTappedAnswer = 1 << 20

// cachedTap is the sidecar's upstream transport: it reads the usage of
// each prefill answer of a turn (the leg to its turn's prefill engine on
// the API's own path, not a render) into the turn's legs, as the router reads
// the answer through it.
type cachedTap struct{ next http.RoundTripper }

// RoundTrip implements http.RoundTripper.
func (t cachedTap) RoundTrip(req *http.Request) (*http.Response, error) {
	rt := routeOf(req.Context())
	resp, err := t.next.RoundTrip(req)
	if err != nil || rt == nil || req.Method != http.MethodPost || req.URL.Host != rt.prefillHost || !isAPIPath(req.URL.Path) ||
		resp.StatusCode != http.StatusOK {
		return resp, err
	}
	resp.Body = &tapBody{rc: resp.Body, rt: rt}
	return resp, nil
}

// isAPIPath reports whether path is one of the router's APIs.
func isAPIPath(path string) bool {
	for _, a := range routerAPIs {
		if path == a.Path {
			return true
		}
	}
	return false
}

// tapBody copies what is read of a prefill answer and, at its end, stores
// its cached_tokens in the turn's legs.
type tapBody struct {
	rc   io.ReadCloser
	rt   *legs
	buf  []byte
	over bool
	done bool
}

func (b *tapBody) Read(p []byte) (int, error) {
	n, err := b.rc.Read(p)
	if !b.over {
		if len(b.buf)+n > maxTappedAnswer {
			b.over, b.buf = true, nil
		} else {
			b.buf = append(b.buf, p[:n]...)
		}
	}
	if err == io.EOF {
		b.end()
	}
	return n, err
}

func (b *tapBody) Close() error {
	b.end()
	return b.rc.Close()
}

// end reads the answer's cached_tokens once: 0 when it has none (vLLM
// answers prompt_tokens_details null when it counts none, and llm-d counts
// a missing one as 0).
func (b *tapBody) end() {
	if b.done || b.over {
		return
	}
	b.done = true
	n, _ := cachedTokens(b.buf)
	b.rt.cached.Store(n)
	b.buf = nil
}

// cachedTokens reads usage.prompt_tokens_details.cached_tokens of a JSON
// answer.
func cachedTokens(body []byte) (int64, bool) {
	usage, ok := jsonraw.Lookup(body, "usage")
	if !ok {
		return 0, false
	}
	details, ok := jsonraw.Lookup(usage, "prompt_tokens_details")
	if !ok {
		return 0, false
	}
	v, ok := jsonraw.Lookup(details, "cached_tokens")
	if !ok {
		return 0, false
	}
	return jsonraw.Int(v)
}

// withCachedTokens returns a JSON object whose top-level usage (an object)
// has prompt_tokens_details.cached_tokens n, as llm-d's rewrite: the
// details are made when absent or null. Anything else is returned as it
// is, with false.
func withCachedTokens(data []byte, n int64) ([]byte, bool) {
	obj, err := jsonraw.Parse(data)
	if err != nil {
		return data, false
	}
	usage, ok := obj.Get("usage")
	if !ok || len(usage) == 0 || usage[0] != '{' {
		return data, false
	}
	uobj, err := jsonraw.Parse(usage)
	if err != nil {
		return data, false
	}
	num := strconv.AppendInt(nil, n, 10)
	details := []byte(`{"cached_tokens":` + string(num) + `}`)
	if d, ok := uobj.Get("prompt_tokens_details"); ok && len(d) > 0 && d[0] == '{' {
		dobj, err := jsonraw.Parse(d)
		if err != nil {
			return data, false
		}
		details = dobj.Edit(nil, jsonraw.Member{Key: "cached_tokens", Value: num})
	}
	u := uobj.Edit(nil, jsonraw.Member{Key: "prompt_tokens_details", Value: details})
	return obj.Edit(nil, jsonraw.Member{Key: "usage", Value: u}), true
}

// cachedWriter rewrites the cached_tokens of the answer the router writes
// for a chat or completions turn: a JSON body is held until the turn ends
// (finish) and written with its new length; a stream's data lines are
// rewritten as they pass, each complete line at once.
type cachedWriter struct {
	http.ResponseWriter
	rt     *legs
	mode   int // cwUndecided, cwBody, cwStream, cwPass
	status int
	buf    []byte // the body, or a stream's incomplete line
}

const (
	cwUndecided = iota
	cwBody
	cwStream
	cwPass
)

// newCachedWriter returns w for path's turn: a cachedWriter for chat and
// completions, else w.
func newCachedWriter(w http.ResponseWriter, rt *legs, path string) (http.ResponseWriter, func()) {
	if path != kvroute.PathChatCompletions && path != kvroute.PathCompletions {
		return w, func() {}
	}
	cw := &cachedWriter{ResponseWriter: w, rt: rt}
	return cw, cw.finish
}

func (w *cachedWriter) WriteHeader(code int) {
	if w.mode != cwUndecided {
		return
	}
	w.status = code
	ct := w.Header().Get("Content-Type")
	switch {
	case code == http.StatusOK && isEventStream(ct):
		w.mode = cwStream
		w.Header().Del("Content-Length")
	case code == http.StatusOK && strings.HasPrefix(ct, "application/json"):
		w.mode = cwBody // written by finish
		return
	default:
		w.mode = cwPass
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *cachedWriter) Write(p []byte) (int, error) {
	if w.mode == cwUndecided {
		w.WriteHeader(http.StatusOK)
	}
	switch w.mode {
	case cwBody:
		w.buf = append(w.buf, p...)
		return len(p), nil
	case cwStream:
		return w.stream(p)
	}
	return w.ResponseWriter.Write(p)
}

// stream writes the complete lines of what has come, each data line with
// a usage rewritten.
func (w *cachedWriter) stream(p []byte) (int, error) {
	w.buf = append(w.buf, p...)
	var out []byte
	for {
		i := bytes.IndexByte(w.buf, '\n')
		if i < 0 {
			break
		}
		out = append(out, w.line(w.buf[:i+1])...)
		w.buf = w.buf[i+1:]
	}
	if len(out) > 0 {
		if _, err := w.ResponseWriter.Write(out); err != nil {
			return 0, err
		}
	}
	if len(w.buf) == 0 {
		w.buf = nil
	}
	return len(p), nil
}

// line rewrites one stream line: a "data: " line of a JSON object with a
// usage.
func (w *cachedWriter) line(l []byte) []byte {
	data, ok := bytes.CutPrefix(l, []byte("data: "))
	if !ok || !bytes.Contains(data, []byte(`"usage"`)) {
		return l
	}
	body := bytes.TrimRight(data, "\r\n")
	out, ok := withCachedTokens(body, w.cached())
	if !ok {
		return l
	}
	return append(append([]byte("data: "), out...), data[len(body):]...)
}

// cached is P's count (0 when P reported none or no prefill answer came).
func (w *cachedWriter) cached() int64 { return max(w.rt.cached.Load(), 0) }

// FlushError flushes what has been written; a held body is not flushed.
func (w *cachedWriter) FlushError() error {
	if w.mode == cwBody {
		return nil
	}
	return http.NewResponseController(w.ResponseWriter).Flush()
}

// Flush implements http.Flusher.
func (w *cachedWriter) Flush() { _ = w.FlushError() }

// Unwrap lets http.ResponseController reach the connection's deadlines.
func (w *cachedWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// finish writes a held body, rewritten, and a stream's last bytes.
func (w *cachedWriter) finish() {
	switch w.mode {
	case cwBody:
		out, _ := withCachedTokens(w.buf, w.cached())
		w.Header().Set("Content-Length", strconv.Itoa(len(out)))
		w.ResponseWriter.WriteHeader(w.status)
		_, _ = w.ResponseWriter.Write(out)
	case cwStream:
		if len(w.buf) > 0 {
			_, _ = w.ResponseWriter.Write(w.line(w.buf))
		}
	}
	w.buf = nil
}

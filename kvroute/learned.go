package kvroute

import (
	"context"
	"log/slog"
	"net/http"
	"strconv"
	"sync"

	"github.com/bidikv/bidikv/kvroute/capability"
)

// What the Router learns of its engines from real turns: the capabilities
// a probe cannot see (package kvroute/capability). A decode engine's
// streams carry its handle or not, per API (vLLM PR #40186 for chat and
// completions; never on Messages); a decode engine transfers KV both ways
// or not (a handle after a normal finish, or none); a prefill engine takes
// kv_transfer_params on Responses and Messages or not (a one-token answer
// with or without a handle). The render routes a prefill engine does not
// serve are the renderers' (verify_tokens.go: 404 or 501, not asked again for
// a while), reported with these. Router.Endpoints reports them
// (EndpointStatus.Learned), under kvroute/capability's names, for a
// program that merges them into its capability reports
// (capability.Report.Learn), as the proxy's /ready, gauges and start-up
// warnings do.

// Why a turn reused or retained less than it could because an engine
// lacks a capability (TurnRecord.Missing); one reason per capability.
const (
	// missingRenderRoute: the prefill engine serves no render route for
	// the API (404: vllm serve without --enable-scale-out; 501: no
	// renderer) and /tokenize could not stand in: the turn was verified
	// by content rules, or (Responses, Messages) not retained.
	missingRenderRoute = "no_render_route"
	// missingStreamHandle: the decode engine's stream ended normally
	// without a handle (stock vLLM on chat and completions without PR
	// #40186; vLLM's Messages streams always): nothing retained.
	missingStreamHandle = "no_stream_handle"
	// missingAPIHandle: an engine answered a Responses or Messages
	// request without kv_transfer_params (vLLM before PRs #37424,
	// #37535).
	missingAPIHandle = "no_api_handle"
	// missingTokenIDs: the decode engine sent no token ids
	// (return_token_ids): the turn was retained under content rules only.
	missingTokenIDs = "no_token_ids"
	// missingBidirectional: an engine answered a request without a
	// handle after a normal finish although it was given one, or as a
	// prefill engine (bidirectional_kv_xfer off, or no KV connector).
	missingBidirectional = "no_bidirectional"
)

// learned holds the facts learned of each engine, by endpoint URL.
type learned struct {
	mu      sync.Mutex
	engines map[string]*engineFacts
}

// engineFacts is what turns showed of one engine. A zero Fact is unknown.
type engineFacts struct {
	streams       map[string]capability.Fact // by API path: a decode handle in its streams
	handles       map[string]capability.Fact // by API path: kv_transfer_params in bodies
	bidirectional capability.Fact
	sampling      map[string]bool // by API path: a stream is under way to learn streams (buffered.go)
}

// engine returns url's facts, made on first use; the caller holds mu.
func (l *learned) engine(url string) *engineFacts {
	if l.engines == nil {
		l.engines = map[string]*engineFacts{}
	}
	e := l.engines[url]
	if e == nil {
		e = &engineFacts{streams: map[string]capability.Fact{}, handles: map[string]capability.Fact{}, sampling: map[string]bool{}}
		l.engines[url] = e
	}
	return e
}

// streams returns what is known of the decode engine at url's streams on
// the API at path: Present, Absent, or Unknown before a stream of it
// ended normally.
func (l *learned) streams(url, path string) capability.State {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e := l.engines[url]; e != nil {
		if f := e.streams[path]; f.State != "" {
			return f.State
		}
	}
	return capability.Unknown
}

// sawStream records a decode stream of the API at path that ended
// normally, with or without a handle, and reports whether this is the
// first time the engine is seen to send none on it. A stream with a
// handle is sticky: a later one without is the engine's failure
// (Stats.NoDecodeHandle), not a capability.
func (l *learned) sawStream(url, path string, handle bool) (firstAbsent bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	e := l.engine(url)
	delete(e.sampling, path)
	prev := e.streams[path]
	name := apiName(path)
	switch {
	case handle:
		e.streams[path] = capability.Fact{State: capability.Present, Why: "learned: a " + name + " stream ended with a handle"}
		e.bidirectional = capability.Fact{State: capability.Present, Why: "learned: the decode engine returned a handle after a normal finish"}
	case prev.Is(capability.Present):
	default:
		e.streams[path] = capability.Fact{State: capability.Absent,
			Why: "learned: a " + name + " stream ended normally without a handle", Fix: streamFix(path)}
		return !prev.Is(capability.Absent)
	}
	return false
}

// streamFix is the change that gives the API's streams a decode handle.
func streamFix(path string) string {
	switch path {
	case PathMessages:
		return capability.FixMessagesStreams
	case PathResponses:
		return "vLLM 0.19.0 or later (PR #37424: response.completed carries the handle)"
	}
	return capability.FixStreamHandles
}

// sample claims the stream that shows whether the decode engine at url
// puts a handle in its streams of the API at path: true when nothing is
// known of them yet and no other turn's stream is showing it now. The
// turn that got it calls unsample when it ends.
func (l *learned) sample(url, path string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	e := l.engine(url)
	if f := e.streams[path]; f.State != "" || e.sampling[path] {
		return false
	}
	e.sampling[path] = true
	return true
}

// unsample releases a claim sample granted whose stream showed nothing
// (it failed, or was cut): another turn's stream may show it.
func (l *learned) unsample(url, path string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e := l.engines[url]; e != nil {
		delete(e.sampling, path)
	}
}

// sawHandle records a decode answer with a handle: the engine transfers
// both ways.
func (l *learned) sawHandle(url string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.engine(url).bidirectional = capability.Fact{State: capability.Present,
		Why: "learned: the decode engine returned a handle after a normal finish"}
}

// noHandle records an engine's answer without a handle where one was
// due (a prefill answer, a decode body after a normal finish to a request
// carrying P's handle) and returns the capability it shows missing: on
// Responses and Messages the API's kv_transfer_params (when the engine is
// known to return handles elsewhere, or is a prefill engine), otherwise
// bidirectional transfer.
func (l *learned) noHandle(url, path string, phase Phase) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	e := l.engine(url)
	agent := path == PathResponses || path == PathMessages
	if agent && (phase == PhasePrefill || e.bidirectional.Is(capability.Present)) {
		e.handles[path] = capability.Fact{State: capability.Absent,
			Why: "learned: the " + string(phase) + " engine answered a " + apiName(path) + " request without a handle",
			Fix: "vLLM 0.19.0 or later (PRs #37424, #37535)"}
		return missingAPIHandle
	}
	why := "learned: the decode engine answered a request carrying P's handle without one (bidirectional_kv_xfer off?)"
	if phase == PhasePrefill {
		why = "learned: the prefill engine answered without a handle (no --kv-transfer-config with the NixlConnector?)"
	}
	e.bidirectional = capability.Fact{State: capability.Absent, Why: why, Fix: capability.FixBidirectional}
	return missingBidirectional
}

// forget drops what was learned of the engine at url (it restarted: it
// may run another build).
func (l *learned) forget(url string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.engines, url)
}

// facts returns what was learned of the engine at url, under
// kvroute/capability's names, in its order; render routes the renderers
// found missing come first.
func (l *learned) facts(url string, missing map[string]int) []capability.Named {
	var out []capability.Named
	for _, a := range capability.APIs {
		if status, ok := missing[a.RenderPath()]; ok {
			out = append(out, capability.Named{Name: capability.RenderName(a), Fact: renderFact(a, status)})
		}
	}
	if status, ok := missing[pathTokenize]; ok {
		out = append(out, capability.Named{Name: capability.NameTokenize, Fact: capability.Fact{State: capability.Absent,
			Why: "learned: POST /tokenize answered " + strconv.Itoa(status), Fix: capability.FixScaleOut}})
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	e := l.engines[url]
	if e == nil {
		return out
	}
	for _, a := range capability.APIs {
		if f, ok := e.handles[a.Path()]; ok {
			out = append(out, capability.Named{Name: capability.HandlesName(a), Fact: f})
		}
	}
	for _, a := range capability.APIs {
		if f, ok := e.streams[a.Path()]; ok {
			out = append(out, capability.Named{Name: capability.StreamHandlesName(a), Fact: f})
		}
	}
	if e.bidirectional.State != "" {
		out = append(out, capability.Named{Name: capability.NameBidirectional, Fact: e.bidirectional})
	}
	return out
}

// renderFact is a render route a turn found missing.
func renderFact(a capability.API, status int) capability.Fact {
	why := "learned: POST " + a.RenderPath() + " answered " + strconv.Itoa(status)
	fix := capability.FixRenderer
	switch status {
	case http.StatusNotFound:
		why += ": route not registered (vllm serve without --enable-scale-out)"
		fix = capability.FixScaleOut
	case http.StatusNotImplemented:
		why += ": no renderer for this API"
	}
	return capability.Fact{State: capability.Absent, Why: why, Fix: fix}
}

// apiName names the API at path as the logs and facts do.
func apiName(path string) string {
	if a, ok := capability.APIFor(path); ok {
		return string(a)
	}
	return path
}

// noStreamHandle counts and records a stream that ended normally without
// a handle where the turn gave the decode engine P's, and warns once per
// API the first time an engine is seen to send none.
func noStreamHandle(t *turn, decode string) {
	r := t.r
	r.stats.noStreamHandle.Add(1)
	t.lacks(missingStreamHandle)
	if !r.learned.sawStream(decode, t.req.Path, false) {
		return
	}
	msg := "kvroute: the decode engine's " + apiName(t.req.Path) + " streams carry no kv_transfer_params (stock vLLM without PR #40186); streamed turns there cannot reuse KV. Use engines with PR #40186, non-streaming requests, or WithDecodeMemory's BufferStreams (proxy: --decode-stream buffered)."
	if !t.req.api.streamHandles {
		msg = "kvroute: vLLM's " + apiName(t.req.Path) + " streams never carry kv_transfer_params; streamed turns there (Claude Code's) cannot reuse KV. Use non-streaming requests, or WithDecodeMemory's BufferStreams (proxy: --decode-stream buffered)."
	}
	r.log.once(context.Background(), "no_stream_handle:"+t.req.Path, msg, slog.String("endpoint", decode))
}

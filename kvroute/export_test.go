package kvroute

import (
	"context"
	"net/http"
)

// RenderedPromptIDs is, for tests in package kvroute_test, the number of
// turns whose decode answer's prompt ids were taken as the rendered ones
// (their text was the render answer's) instead of being parsed.
func RenderedPromptIDs(r *Router) int64 { return r.stats.renderedPromptIDs.Load() }

// HeaderPrincipalForTest is headerPrincipal, for tests in package
// kvroute_test: the principal the headers name (Request.Principal when the
// context carries none).
func HeaderPrincipalForTest(h http.Header) string { return headerPrincipal(h) }

// ConversationHintForTest is conversationHint, for tests in package
// kvroute_test.
func ConversationHintForTest(req *Request) string { return conversationHint(req) }

// LiveTokens is, for tests in package kvroute_test, the tokens of decode
// legs in flight the router counts on each decode engine (memory.go).
func LiveTokens(r *Router) []int64 {
	var out []int64
	for _, e := range r.decode.list() {
		out = append(out, e.mem.Live.Load())
	}
	return out
}

// ReadDecodeMetrics is, for tests in package kvroute_test, a reading of
// every decode engine's /metrics now (the meter's, pressure.go), as a
// turn's press or the restart check would start one.
func ReadDecodeMetrics(r *Router) error {
	for _, e := range r.decode.list() {
		if err := r.meter.read(context.Background(), e); err != nil {
			return err
		}
	}
	return nil
}

package kvroute

import "net/http"

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

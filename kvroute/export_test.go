package kvroute

// RenderedPromptIDs is, for tests in package kvroute_test, the number of
// turns whose decode answer's prompt ids were taken as the rendered ones
// (their text was the render answer's) instead of being parsed.
func RenderedPromptIDs(r *Router) int64 { return r.stats.renderedPromptIDs.Load() }

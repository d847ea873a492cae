package main

import (
	"slices"
	"strconv"
	"strings"

	"github.com/bidikv/bidikv/kvroute"
)

// Metric label values that engines or clients choose are bounded to a
// known set, the rest reported as "other", so that a hostile or broken
// engine or client cannot grow the proxy's series without bound: a path
// (a client's), an HTTP status (an engine's 4xx passes through), a
// finish reason inside a store refusal (an engine's), an engine's version
// and model. Every other label value is the proxy's or the router's own
// constant, or comes from the command line (endpoints).

// otherLabel is the value of a label outside its known set.
const otherLabel = "other"

// pathLabel is path when it is one of the router's APIs.
func pathLabel(path string) string {
	for _, a := range routerAPIs {
		if a.Path == path {
			return path
		}
	}
	return otherLabel
}

// knownStatuses are the statuses the proxy and the router answer.
var knownStatuses = []int{400, 401, 403, 404, 405, 408, 409, 413, 415, 422, 429, 431, 500, 501, 502, 503, 504, 505}

// statusLabel is code when it is a known status.
func statusLabel(code int) string {
	if slices.Contains(knownStatuses, code) {
		return strconv.Itoa(code)
	}
	return otherLabel
}

// knownFinishes are the finish and stop reasons of the APIs other than a
// normal end (stop, length, end_turn, max_tokens): vLLM's abort and error,
// tool calls in each API's words, OpenAI's content_filter and
// function_call, Anthropic's pause_turn and refusal.
var knownFinishes = []string{"abort", "error", "tool_calls", "tool_use", "function_call", "content_filter", "pause_turn", "refusal"}

// refusalLabel is a store refusal as a label: the router's reasons as
// they are, a finish reason (the engine's word, "finish_" and the reason)
// only when known, else "finish_other".
func refusalLabel(r kvroute.Refusal) string {
	finish, ok := strings.CutPrefix(string(r), "finish_")
	if !ok || slices.Contains(knownFinishes, finish) {
		return labelShape(string(r))
	}
	return "finish_" + otherLabel
}

// labelShape is v when it reads as one of the router's constants (lower
// case letters, digits and '_', at most 48 bytes), else "other".
func labelShape(v string) string {
	if v == "" || len(v) > 48 {
		return otherLabel
	}
	for i := range len(v) {
		c := v[i]
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '_' {
			return otherLabel
		}
	}
	return v
}

// infoLabel is an engine's version or model string as a label: printable
// ASCII without spaces, at most 128 bytes, else "other". One series per
// engine at a time (the collector exports the latest probe), so the
// bound is on the size of each value.
func infoLabel(v string) string {
	if len(v) > 128 {
		return otherLabel
	}
	for i := range len(v) {
		if v[i] <= ' ' || v[i] > '~' {
			return otherLabel
		}
	}
	return v
}

package sim

import (
	"fmt"
	"net/http"
	"strconv"
)

// serveMetrics serves GET /metrics as vLLM's API server does, in
// Prometheus' text format: here only the process collector's
// process_start_time_seconds (the start of the engine's current process,
// in Unix seconds, which a restart changes), formatted as the Python
// client formats floats (Go's shortest 'g' form: 1.71855734213e+09).
func (e *Engine) serveMetrics(w http.ResponseWriter) {
	e.mu.Lock()
	start := float64(e.start.UnixNano()) / 1e9
	e.mu.Unlock()
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	fmt.Fprintf(w, "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n"+
		"# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds %s\n", strconv.FormatFloat(start, 'g', -1, 64))
}

package main

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
)

// What a turn cut by the drain sends, by how far its response got and by
// API: a stream whose final event went out gets nothing after it (an error
// after message_stop would make Anthropic's SDKs throw the message away);
// a Messages stream gets Anthropic's named error event, which its SDKs
// raise (they skip events without a name).
func TestTurnWriterCut(t *testing.T) {
	sse := func(events ...string) func(w http.ResponseWriter) {
		return func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "text/event-stream")
			for _, e := range events {
				_, _ = w.Write([]byte(e))
			}
		}
	}
	anthropicCut := "event: message_start\ndata: {}\n\nevent: error\ndata: " +
		`{"type":"error","error":{"type":"overloaded_error","message":"proxy: shutting down: the turn was cut at the end of the shutdown grace period"}}` + "\n\n"
	tests := []struct {
		name   string
		path   string // "": /v1/chat/completions
		write  func(w http.ResponseWriter)
		status int
		tail   string // what the response ends with
	}{
		{"stream in flight", "", func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(http.StatusOK)
			_, _ = w.Write([]byte("data: {\"choices\":[]}\n\n"))
		}, http.StatusOK, `"code":"shutting_down","message":"proxy: shutting down: the turn was cut at the end of the shutdown grace period","param":null,"type":"server_error"}}` + "\n\n"},
		{"stream that just ended", "", func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
			_, _ = w.Write([]byte("data: {}\n\n"))
			_, _ = w.Write([]byte("data: [DONE]\n\n"))
		}, http.StatusOK, "data: [DONE]\n\n"},
		{"flushed headers only", "", func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "text/event-stream")
			_ = http.NewResponseController(w).Flush()
		}, http.StatusOK, `"type":"server_error"}}` + "\n\n"},
		{"nothing sent", "", func(http.ResponseWriter) {}, http.StatusServiceUnavailable, `"type":"server_error"}}`},
		{"messages stream in flight", "/v1/messages", sse("event: message_start\ndata: {}\n\n"), http.StatusOK, anthropicCut},
		{"messages stream that just ended", "/v1/messages", sse("event: message_delta\ndata: {}\n\n", "event: message_stop\ndata: {}\n\n"), http.StatusOK, "event: message_stop\ndata: {}\n\n"},
		{"messages events in one write", "/v1/messages", sse("event: message_delta\ndata: {}\n\nevent: message_stop\ndata: {}\n\n"), http.StatusOK, "event: message_stop\ndata: {}\n\n"},
		{"messages nothing sent", "/v1/messages", func(http.ResponseWriter) {}, http.StatusServiceUnavailable, `"type":"overloaded_error","message":"proxy: shutting down: the turn was cut at the end of the shutdown grace period"}}`},
		// Issue 21.22: the Responses API's own error event, numbered
		// after the last event sent.
		{"responses stream in flight", "/v1/responses", sse("event: response.created\ndata: {}\n\n"), http.StatusOK,
			"\n\nevent: error\ndata: " + `{"code":"shutting_down","message":"proxy: shutting down: the turn was cut at the end of the shutdown grace period","param":null,"sequence_number":0,"type":"error"}` + "\n\n"},
		{"responses stream numbered", "/v1/responses", sse("event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0}\n\n",
			"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":1,\"delta\":\"a\"}\n\n"), http.StatusOK,
			"\n\nevent: error\ndata: " + `{"code":"shutting_down","message":"proxy: shutting down: the turn was cut at the end of the shutdown grace period","param":null,"sequence_number":2,"type":"error"}` + "\n\n"},
		{"responses stream that just ended", "/v1/responses", sse("event: response.completed\ndata: {}\n\n"), http.StatusOK, "event: response.completed\ndata: {}\n\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := tt.path
			if path == "" {
				path = "/v1/chat/completions"
			}
			rec := httptest.NewRecorder()
			tw := &turnWriter{ResponseWriter: rec, req: httptest.NewRequest(http.MethodPost, path, nil), body: &bodyReader{}, seq: -1}
			tt.write(tw)
			tw.cut()
			assert.Equal(t, tt.status, rec.Code)
			assert.True(t, strings.HasSuffix(rec.Body.String(), tt.tail), "%q", rec.Body.String())
			end := strings.Count(rec.Body.String(), "[DONE]") + strings.Count(rec.Body.String(), "message_stop") +
				strings.Count(rec.Body.String(), "response.completed")
			assert.Equal(t, 1, end+strings.Count(rec.Body.String(), "shutting down"))
		})
	}
}

package main

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
)

// What a turn cut by the drain sends, by how far its response got.
func TestTurnWriterCut(t *testing.T) {
	tests := []struct {
		name   string
		write  func(w http.ResponseWriter)
		status int
		tail   string // what the response ends with
	}{
		{"stream in flight", func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(http.StatusOK)
			_, _ = w.Write([]byte("data: {\"choices\":[]}\n\n"))
		}, http.StatusOK, `"code":"shutting_down","message":"proxy: shutting down: the turn was cut at the end of the shutdown grace period","param":null,"type":"server_error"}}` + "\n\n"},
		{"stream that just ended", func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
			_, _ = w.Write([]byte("data: {}\n\n"))
			_, _ = w.Write([]byte("data: [DONE]\n\n"))
		}, http.StatusOK, "data: [DONE]\n\n"},
		{"flushed headers only", func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "text/event-stream")
			_ = http.NewResponseController(w).Flush()
		}, http.StatusOK, `"type":"server_error"}}` + "\n\n"},
		{"nothing sent", func(http.ResponseWriter) {}, http.StatusServiceUnavailable, `"type":"server_error"}}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			tw := &turnWriter{ResponseWriter: rec, body: &bodyReader{}}
			tt.write(tw)
			tw.cut()
			assert.Equal(t, tt.status, rec.Code)
			assert.True(t, strings.HasSuffix(rec.Body.String(), tt.tail), "%q", rec.Body.String())
			assert.Equal(t, 1, strings.Count(rec.Body.String(), "[DONE]")+strings.Count(rec.Body.String(), "shutting_down"))
		})
	}
}

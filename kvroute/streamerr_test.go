package kvroute_test

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// Issue 21.20 and 21.22: a decode stream cut in the middle of an event.
// The unterminated event is not forwarded (a client would not dispatch
// it); the error event that ends the stream starts on a fresh line, in the
// API's own shape: OpenAI's data: {"error":...} for chat, Responses'
// event: error with {"type":"error","code","message","param",
// "sequence_number"} numbered after the last event, Anthropic's event:
// error for Messages.
func TestStreamCutMidEvent(t *testing.T) {
	tests := []struct {
		path, request, sent, partial string
		check                        func(t *testing.T, ev kvroutetest.Event)
	}{
		{
			path:    kvroute.PathChatCompletions,
			request: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":8,"stream":true}`,
			sent:    `data: {"id":"d","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}` + "\n\n",
			partial: `data: {"id":"d","choices":[{"index":0,"delta":{"con`,
			check: func(t *testing.T, ev kvroutetest.Event) {
				assert.Empty(t, ev.Name)
				var e struct {
					Error struct{ Message, Type, Code string }
				}
				require.NoError(t, json.Unmarshal(ev.Data, &e), "%s", ev.Data)
				assert.Equal(t, "server_error", e.Error.Type)
				assert.Equal(t, "stream_failed", e.Error.Code)
			},
		},
		{
			path:    kvroute.PathResponses,
			request: `{"model":"m","input":"hi","max_output_tokens":8,"stream":true}`,
			sent: "event: response.created\n" + `data: {"type":"response.created","sequence_number":0,"response":{"id":"r","status":"in_progress","output":[]}}` + "\n\n" +
				"event: response.output_text.delta\n" + `data: {"type":"response.output_text.delta","sequence_number":1,"item_id":"m","output_index":0,"content_index":0,"delta":"he"}` + "\n\n",
			partial: "event: response.output_text.delta\n" + `data: {"type":"response.output_text.delta","sequence_number":2,"delta":"ll`,
			check: func(t *testing.T, ev kvroutetest.Event) {
				assert.Equal(t, "error", ev.Name)
				var e map[string]any
				require.NoError(t, json.Unmarshal(ev.Data, &e), "%s", ev.Data)
				assert.Equal(t, "error", e["type"])
				assert.Equal(t, "stream_failed", e["code"])
				assert.Contains(t, e["message"], "decode stream ended early")
				assert.Contains(t, e, "param")
				assert.Nil(t, e["param"])
				assert.EqualValues(t, 2, e["sequence_number"], "after the last event sent")
				assert.Len(t, e, 5)
			},
		},
		{
			path:    kvroute.PathMessages,
			request: `{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}],"stream":true}`,
			sent:    "event: message_start\n" + `data: {"type":"message_start","message":{"id":"m","type":"message","role":"assistant","content":[],"model":"m","stop_reason":null,"usage":{"input_tokens":1,"output_tokens":0}}}` + "\n\n",
			partial: "event: content_block_delta\n" + `data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"he`,
			check: func(t *testing.T, ev kvroutetest.Event) {
				assert.Equal(t, "error", ev.Name)
				var e struct {
					Type  string
					Error struct{ Type, Message string }
				}
				require.NoError(t, json.Unmarshal(ev.Data, &e), "%s", ev.Data)
				assert.Equal(t, "error", e.Type)
				assert.Equal(t, "api_error", e.Error.Type)
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.path, func(t *testing.T) {
			f := newFake(t)
			f.decode = func(w http.ResponseWriter, _ map[string]json.RawMessage) {
				w.Header().Set("Content-Type", "text/event-stream")
				_, _ = io.WriteString(w, tt.sent+tt.partial)
			}
			r := fakeRouter(t, f, &kvroutetest.Records{})
			res := send(t, serve(t, r), tt.path, []byte(tt.request), nil)
			require.Equal(t, http.StatusOK, res.status)
			raw := string(res.raw)
			require.True(t, strings.HasPrefix(raw, tt.sent), "the complete events first: %q", raw)
			rest := raw[len(tt.sent):]
			assert.NotContains(t, rest, tt.partial[:len(tt.partial)-2], "the unterminated event is not forwarded")
			evs := kvroutetest.ParseEvents([]byte(rest), false)
			require.Len(t, evs, 1, "one error event after them, on its own lines: %q", rest)
			tt.check(t, evs[0])
			assert.Equal(t, evs, kvroutetest.ParseEvents([]byte(rest), true))
		})
	}
}

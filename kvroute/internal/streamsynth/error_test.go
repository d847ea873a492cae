package streamsynth_test

import (
	"bytes"
	"encoding/json"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/internal/streamsynth"
)

// routerEvent plays the router's ErrorEvent (the router's Response.ErrorEvent):
// it records what it was given.
type routerEvent struct {
	status int
	err    error
}

func (r *routerEvent) event(status int, err error) []byte {
	r.status, r.err = status, err
	return []byte("data: {\"error\":{\"message\":\"router\"}}\n\n")
}

// An engine's error answer after the stream's headers: its own body when
// it has the API's error shape (as vLLM writes a stream's error event),
// the router's event otherwise, with the engine's message.
func TestWriteErrorShapes(t *testing.T) {
	for _, c := range []struct {
		name   string
		api    streamsynth.API
		status int
		body   string
		want   string // the stream, "" for the router's event
		msg    string // the message the router's event was given
	}{
		{"chat, OpenAI shape", streamsynth.ChatCompletions, 400,
			`{"error":{"message":"maximum context length is 4096 tokens","type":"BadRequestError","param":null,"code":400}}`,
			"data: {\"error\":{\"message\":\"maximum context length is 4096 tokens\",\"type\":\"BadRequestError\",\"param\":null,\"code\":400}}\n\n", ""},
		{"completions, older vLLM shape", streamsynth.Completions, 400,
			`{"object":"error","message":"bad","type":"BadRequestError","param":null,"code":400}`,
			"data: {\"error\":{\"object\":\"error\",\"message\":\"bad\",\"type\":\"BadRequestError\",\"param\":null,\"code\":400}}\n\n", ""},
		{"chat, pretty-printed", streamsynth.ChatCompletions, 500, "{\n \"error\": {\"message\": \"x\"}\r\n}",
			"data: { \"error\": {\"message\": \"x\"}}\n\n", ""},
		{"messages, Anthropic shape", streamsynth.Messages, 400,
			`{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long"}}`,
			"event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"invalid_request_error\",\"message\":\"prompt is too long\"}}\n\n", ""},
		{"messages, OpenAI shape from a middleware", streamsynth.Messages, 500, `{"error":{"message":"engine dead"}}`, "", "engine dead"},
		{"chat, not JSON", streamsynth.ChatCompletions, 502, `<html>Bad Gateway</html>`, "", "Bad Gateway"},
		{"chat, JSON without an error", streamsynth.ChatCompletions, 503, `{"detail":"x","message":"overloaded"}`, "", "overloaded"},
		{"messages, empty body", streamsynth.Messages, 504, ``, "", "Gateway Timeout"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var buf bytes.Buffer
			r := &routerEvent{}
			require.NoError(t, c.api.WriteError(&buf, c.status, []byte(c.body), r.event))
			if c.want != "" {
				assert.Equal(t, c.want, buf.String())
				assert.Nil(t, r.err, "the engine's own event, not the router's")
				return
			}
			assert.Equal(t, "data: {\"error\":{\"message\":\"router\"}}\n\n", buf.String())
			assert.Equal(t, c.status, r.status)
			require.Error(t, r.err)
			assert.Equal(t, c.msg, r.err.Error())
		})
	}
}

// Without a router's hook, the error events of each API, as their SDKs
// read them.
func TestWriteErrorDefault(t *testing.T) {
	var buf bytes.Buffer
	require.NoError(t, streamsynth.ChatCompletions.WriteError(&buf, http.StatusBadGateway, []byte(`nope`), nil))
	evs, err := events(buf.Bytes())
	require.NoError(t, err)
	require.Len(t, evs, 1)
	var e struct {
		Error struct {
			Message, Type string
			Code          int
		}
	}
	require.NoError(t, json.Unmarshal(evs[0].Data, &e))
	assert.Equal(t, "Bad Gateway", e.Error.Message)
	assert.Equal(t, "server_error", e.Error.Type)
	assert.Equal(t, 502, e.Error.Code)

	buf.Reset()
	require.NoError(t, streamsynth.Messages.WriteError(&buf, http.StatusBadRequest, []byte(`{"message":"too \"long\""}`), nil))
	evs, err = events(buf.Bytes())
	require.NoError(t, err)
	require.Len(t, evs, 1)
	assert.Equal(t, "error", evs[0].Name)
	var a struct {
		Type  string
		Error struct{ Type, Message string }
	}
	require.NoError(t, json.Unmarshal(evs[0].Data, &a))
	assert.Equal(t, "error", a.Type)
	assert.Equal(t, "invalid_request_error", a.Error.Type)
	assert.Equal(t, `too "long"`, a.Error.Message)

	assert.Error(t, streamsynth.API(9).WriteError(&buf, 500, nil, nil))
	assert.ErrorIs(t, streamsynth.Messages.WriteError(&errWriter{}, 500, nil, nil), errBroken)
}

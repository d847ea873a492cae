package kvroute

import (
	"encoding/json"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/observed"
)

// Extension example: a fifth API is one file (this one) and one
// registration line (the entry in apis; here, in the test). Its
// descriptor names a code of its own (persisted in every entry its turns
// retain) and its kind, two legs. echoAPI is a
// made-up API, POST /v1/echo with {"model","system","prompt"}, answered
// {"text","finish_reason"}; its errors take Anthropic's shape, to show
// that the error shape follows the descriptor. Nothing else in the router
// knows of it: routing, both legs, the capture, the Identifier's anchor,
// retention and the error shape come from the descriptor.
var echoAPI = &api{
	code:          254, // a test-only code, far from the registry's
	kind:          twoLegs,
	path:          "/v1/echo",
	prefillSet:    []jsonraw.Member{{Key: "stream", Value: jsonFalse}, {Key: "max_tokens", Value: jsonOne}},
	prefillDrop:   commonPrefillDrop,
	nested:        "echo",
	final:         map[string]bool{"echo.done": true},
	streamHandles: true,
	head:          "system",
	turns:         "prompt",
	errors:        anthropicErrors{},
	impl:          echo{},
}

type echo struct{}

func (echo) validate(obj jsonraw.Object) error {
	if v, ok := obj.Get("prompt"); !ok || len(v) == 0 || v[0] != '"' {
		return badRequest("prompt must be a string")
	}
	return nil
}

func (echo) bodyReply(obj jsonraw.Object) *Reply {
	rep := &Reply{}
	if v, ok := obj.Get("text"); ok {
		rep.Content, _ = jsonraw.String(v)
	}
	if v, ok := obj.Get("finish_reason"); ok {
		rep.FinishReason, _ = jsonraw.String(v)
	}
	return rep
}

func TestExtendFifthAPI(t *testing.T) {
	apis = append(apis, echoAPI) // the registration line
	t.Cleanup(func() { apis = apis[:len(apis)-1] })
	checkRegistry(t)

	e := newToyEngine(t, func(string, map[string]json.RawMessage) []byte {
		return []byte(`{"text":"hi back","finish_reason":"stop"}`)
	})
	obs := &observed.Log[TurnRecord]{}
	_, url := toyRouter(t, e, WithObserver(ObserverFunc(obs.Add)))

	status, h, body := toyPost(t, url, "/v1/echo", `{"model":"m","system":"be brief","prompt":"hi","max_tokens":9,"stream":false}`)
	require.Equal(t, http.StatusOK, status, "%s", body)
	assert.JSONEq(t, `{"text":"hi back","finish_reason":"stop"}`, string(body), "the handle never reaches the client")
	assert.Equal(t, "miss", h.Get("X-Bidikv-Reuse"))

	p := e.last(true)
	assert.Equal(t, "/v1/echo", p.path)
	assert.JSONEq(t, `1`, string(p.body["max_tokens"]), "the descriptor's prefill rewrite")
	assert.Contains(t, string(p.body[kvKey]), `"remote_engine_id":null`, "the miss handle")
	d := e.last(false)
	assert.JSONEq(t, `9`, string(d.body["max_tokens"]), "the decode leg is the client's body")
	assert.Contains(t, string(d.body[kvKey]), `"remote_engine_id":"toy"`, "with P's handle")

	rec := obs.Last()
	assert.Equal(t, RefuseTokenOnly, rec.StoreRefusal, "ContinuationKeys keys it by its anchor (head and turns), for token verification only")

	status, _, body = toyPost(t, url, "/v1/echo", `{"model":"m","prompt":7}`)
	assert.Equal(t, http.StatusBadRequest, status)
	assert.JSONEq(t, `{"type":"error","error":{"type":"invalid_request_error","message":"kvroute: bad request: prompt must be a string"}}`, string(body),
		"the descriptor's validation, in its error shape")

	var found bool
	for _, a := range APIs() {
		if a.Path == "/v1/echo" {
			found = true
			assert.Equal(t, "anthropic", a.ErrorShape)
			assert.Equal(t, "anthropic", a.StreamErrorShape)
		}
	}
	assert.True(t, found, "front ends route it through the registry")
}

package kvroute

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/observed"
)

// Extension example: a pass-through API is one file (this one) and one
// registration line (the entry in apis; here, in the test). vLLM's
// /v1/embeddings needs no prefill and leaves no handle: its descriptor
// says so with its kind, and the router forwards the client's body (less
// kv_transfer_params and conversation_id) to a decode engine the Selector
// picks, answers with the engine's answer, scrubbed as every answer, and
// records the turn (Reuse off, the decode engine, PhaseDecode when it
// fails). Its code, persisted as every API's, is one no other API has.
var embeddingsAPI = &api{
	code:   255, // a test-only code, far from the registry's
	kind:   passThrough,
	path:   "/v1/embeddings",
	errors: openAIErrors{},
	impl:   embeddings{},
}

type embeddings struct{ forwarded }

// validate asks for the input, as vLLM's EmbeddingCompletionRequest does.
func (embeddings) validate(obj jsonraw.Object) error {
	if v, ok := obj.Get("input"); !ok || jsonraw.IsNull(v) {
		return badRequest("input is required")
	}
	return nil
}

func TestExtendPassThroughAPI(t *testing.T) {
	apis = append(apis, embeddingsAPI) // the registration line
	t.Cleanup(func() { apis = apis[:len(apis)-1] })
	checkRegistry(t)

	const answer = `{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.5,-0.25]}],"model":"m","usage":{"prompt_tokens":2,"total_tokens":2}}`
	var fail atomic.Bool
	p := newToyEngine(t, func(string, map[string]json.RawMessage) []byte { return []byte(`{}`) })
	d := newToyEngine(t, func(path string, _ map[string]json.RawMessage) []byte {
		if fail.Load() {
			return nil
		}
		// An engine's answer naming kv_transfer_params anywhere is
		// scrubbed, as every answer is.
		return []byte(`{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.5,-0.25],"kv_transfer_params":{"note":"x"}}],"model":"m","usage":{"prompt_tokens":2,"total_tokens":2}}`)
	})
	obs := &observed.Log[TurnRecord]{}
	r, err := New(WithPrefill(p.url), WithDecode(d.url), WithHealth(Health{RestartCheck: -1}), WithObserver(ObserverFunc(obs.Add)))
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)

	status, h, body := toyPost(t, srv.URL, "/v1/embeddings", `{"model":"m","input":"hi","conversation_id":"c1","kv_transfer_params":{"remote_engine_id":"client"}}`)
	require.Equal(t, http.StatusOK, status, "%s", body)
	assert.JSONEq(t, answer, string(body), "the engine's answer, scrubbed")
	assert.Equal(t, "off", h.Get("X-Bidikv-Reuse"))

	assert.Zero(t, p.count(), "no prefill leg")
	leg := d.last(false)
	assert.Equal(t, "/v1/embeddings", leg.path)
	assert.JSONEq(t, `"hi"`, string(leg.body["input"]), "the client's body")
	assert.NotContains(t, leg.body, kvKey, "no handle reaches the engine, not even the client's")
	assert.NotContains(t, leg.body, "conversation_id")
	assert.NotContains(t, leg.body, "return_token_ids")

	rec := obs.Last()
	assert.Equal(t, "/v1/embeddings", rec.Path)
	assert.Equal(t, ReuseOff, rec.Reuse)
	assert.Equal(t, d.url, rec.DecodeEndpoint)
	assert.Empty(t, rec.PrefillEndpoint)
	assert.Zero(t, rec.PrefillAttempts)
	assert.False(t, rec.Stored)
	assert.Equal(t, RefuseReuseOff, rec.StoreRefusal)
	assert.NoError(t, rec.Err)

	status, _, body = toyPost(t, srv.URL, "/v1/embeddings", `{"model":"m"}`)
	assert.Equal(t, http.StatusBadRequest, status)
	assert.JSONEq(t, `{"error":{"message":"kvroute: bad request: input is required","type":"invalid_request_error","param":null,"code":"invalid_request"}}`, string(body),
		"the descriptor's validation, in its error shape")

	fail.Store(true)
	status, _, _ = toyPost(t, srv.URL, "/v1/embeddings", `{"model":"m","input":"hi"}`)
	assert.Equal(t, http.StatusBadGateway, status)
	rec = obs.Last()
	assert.Equal(t, PhaseDecode, rec.ErrPhase, "the leg is a decode engine's")
	assert.Equal(t, d.url, rec.DecodeEndpoint)
	assert.Zero(t, p.count())

	var found bool
	for _, a := range APIs() {
		found = found || a.Path == "/v1/embeddings"
	}
	assert.True(t, found, "front ends route it through the registry")
}

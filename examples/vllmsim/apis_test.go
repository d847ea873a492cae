package main

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func postAPI(t *testing.T, url string, body map[string]any) map[string]any {
	t.Helper()
	raw, err := json.Marshal(body)
	require.NoError(t, err)
	resp, err := http.Post(url, "application/json", bytes.NewReader(raw))
	require.NoError(t, err)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
	var out map[string]any
	require.NoError(t, json.Unmarshal(b, &out))
	return out
}

// One conversation across APIs and processes: P prefills it as a Responses
// request, D decodes it as an Anthropic Messages request, and the next turn
// goes to P as chat with D's handle. The three render to the same tokens,
// so the positional reads are right.
func TestProcessesAcrossAPIs(t *testing.T) {
	p := spawn(t, "--kv-transfer-config", bidiKV, "--no-enable-prefix-caching")
	d := spawn(t, "--kv-transfer-config", bidiKV)
	long := "the quick brown fox jumps over the lazy dog and keeps running through the forest until nightfall"
	q := long + " " + long + " " + long
	miss := map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
		"remote_block_ids": nil, "remote_host": nil, "remote_port": nil}

	pr := postAPI(t, p.url+"/v1/responses", map[string]any{"model": "sim-model", "input": q, "max_output_tokens": 1,
		"stream": false, "kv_transfer_params": miss})
	assert.Equal(t, "incomplete", pr["status"])
	require.NotNil(t, pr["kv_transfer_params"])

	dr := postAPI(t, d.url+"/v1/messages?beta=true", map[string]any{"model": "sim-model", "max_tokens": 100,
		"messages": []any{map[string]any{"role": "user", "content": q}}, "kv_transfer_params": pr["kv_transfer_params"]})
	content := dr["content"].([]any)
	reply := content[len(content)-1].(map[string]any)["text"].(string)
	assert.Equal(t, reference(t, messages(q)), reply)
	require.NotNil(t, dr["kv_transfer_params"])
	dm := dr["kv_transfer_params"].(map[string]any)
	dm["do_remote_decode"], dm["do_remote_prefill"] = true, false

	turn2 := messages(q, reply, "and then what happened to the fox after the night had fallen")
	_, ph2 := call(t, p.url, withKV(turn2, dm, 1))
	require.NotEqual(t, "null", string(ph2))
	ps := stats(t, p.url)
	assert.Positive(t, ps.TokensPulledIn, "P read the history D decoded as messages")
	reply2, _ := call(t, d.url, withKV(turn2, json.RawMessage(ph2), 0))
	assert.Equal(t, reference(t, turn2), reply2)
	assert.Zero(t, stats(t, d.url).WrongOutputs)
	assert.Zero(t, ps.PoisonedHits)
}

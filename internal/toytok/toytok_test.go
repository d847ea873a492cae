package toytok_test

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/internal/toytok"
)

// PromptTokens counts what Chat renders, escapes and long words included.
func TestPromptTokens(t *testing.T) {
	for _, msgs := range [][]toytok.Message{
		{},
		{{Role: "user", Content: ""}},
		{{Role: "system", Content: "You are a coding agent."}, {Role: "user", Content: "list\tthe \"files\"\n  in é/世界 abcdefghijklmnop"}},
		{{Role: "user", Content: strings.Repeat(" func return\nerr", 500)}, {Role: "assistant", Content: "Done."}},
	} {
		body, err := json.Marshal(map[string]any{"model": "m", "messages": msgs, "stream": true})
		require.NoError(t, err)
		n, err := toytok.PromptTokens(body)
		require.NoError(t, err)
		assert.Equal(t, len(toytok.Chat(msgs)), n, "%s", body)
	}
	_, err := toytok.PromptTokens([]byte(`{"messages":[{"role":"user","content":[{"type":"text"}]}]}`))
	assert.Error(t, err)
}

// A handle holds one block id per block in the pool's range, with vLLM's
// keys, and the tokens it covers.
func TestHandles(t *testing.T) {
	for _, c := range []struct {
		h              []byte
		tokens, blocks int
		prefill        string
	}{
		{toytok.Handle(7, 25000, 16), 25000, 1563, "false"},
		{toytok.Handle(8, 100001, 64), 100001, 1563, "false"},
		{toytok.PrefillHandle(9, 17, 16), 17, 2, "true"},
	} {
		obj, err := jsonraw.Parse(c.h)
		require.NoError(t, err)
		v, _ := obj.Get("remote_num_tokens")
		assert.Equal(t, strconv.Itoa(c.tokens), string(v))
		v, _ = obj.Get("do_remote_prefill")
		assert.Equal(t, c.prefill, string(v))
		for _, k := range []string{"remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "remote_blocks_expiry_time", "transfer_mode"} {
			assert.True(t, obj.Has(k), k)
		}
		var groups [][]int
		v, _ = obj.Get("remote_block_ids")
		require.NoError(t, json.Unmarshal(v, &groups))
		require.Len(t, groups, 1)
		assert.Len(t, groups[0], c.blocks)
		for _, id := range groups[0] {
			assert.True(t, id >= 0 && id < toytok.PoolBlocks, "id %d", id)
		}
	}
}

func TestGroupHandle(t *testing.T) {
	var groups [][]int
	obj, err := jsonraw.Parse(toytok.GroupHandle(3, 40, 16, 2, true))
	require.NoError(t, err)
	v, _ := obj.Get("remote_block_ids")
	require.NoError(t, json.Unmarshal(v, &groups))
	require.Len(t, groups, 2)
	assert.Len(t, groups[0], 3)
	assert.Len(t, groups[1], 3)
	assert.NotEqual(t, groups[0], groups[1], "each group has blocks of its own")
}

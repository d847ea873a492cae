package kvroute_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
)

func chatReq(t testing.TB, body map[string]any) *kvroute.Request {
	t.Helper()
	b, err := json.Marshal(body)
	require.NoError(t, err)
	return &kvroute.Request{Path: kvroute.PathChatCompletions, Body: b}
}

func msgs(m ...map[string]any) []map[string]any { return m }

func user(s string) map[string]any      { return map[string]any{"role": "user", "content": s} }
func assistant(s string) map[string]any { return map[string]any{"role": "assistant", "content": s} }

// storedKey is the key ContinuationKeys retains a turn under.
func storedKey(t testing.TB, body map[string]any, reply *kvroute.Reply) string {
	t.Helper()
	ret, err := kvroute.ContinuationKeys{}.Key(chatReq(t, body), reply)
	require.NoError(t, err)
	require.NotEmpty(t, ret.Key, "refused: %s", ret.Refusal)
	return ret.Key
}

func lookup(t testing.TB, body map[string]any) []string {
	t.Helper()
	keys, err := kvroute.ContinuationKeys{}.Lookup(chatReq(t, body))
	require.NoError(t, err)
	return keys
}

func clone(m map[string]any) map[string]any {
	b, _ := json.Marshal(m)
	var out map[string]any
	_ = json.Unmarshal(b, &out)
	return out
}

func TestContinuationKeys(t *testing.T) {
	tools := []any{map[string]any{"type": "function", "function": map[string]any{"name": "ls", "parameters": map[string]any{"type": "object"}}}}
	turn1 := map[string]any{
		"model":    "m",
		"tools":    tools,
		"messages": msgs(map[string]any{"role": "system", "content": "sys"}, user("list the files")),
	}
	reply := &kvroute.Reply{Content: "Here they are.", FinishReason: "stop"}
	key := storedKey(t, turn1, reply)

	next := func(edit func(m map[string]any)) map[string]any {
		m := clone(turn1)
		ms := m["messages"].([]any)
		ms = append(ms, assistant("Here they are."), user("now open main.go"))
		m["messages"] = ms
		if edit != nil {
			edit(m)
		}
		return m
	}
	msgAt := func(m map[string]any, i int) map[string]any { return m["messages"].([]any)[i].(map[string]any) }

	misses := []struct {
		name string
		edit func(m map[string]any)
	}{
		{"earlier message edited", func(m map[string]any) { msgAt(m, 1)["content"] = "list the file" }},
		{"system prompt changed", func(m map[string]any) { msgAt(m, 0)["content"] = "sys2" }},
		{"reply edited", func(m map[string]any) { msgAt(m, 2)["content"] = "Here they are!" }},
		{"reply stripped", func(m map[string]any) { msgAt(m, 2)["content"] = "" }},
		{"reasoning kept in history", func(m map[string]any) { msgAt(m, 2)["reasoning_content"] = "I think" }},
		{"unrelated conversation", func(m map[string]any) { m["messages"] = msgs(user("hi"), assistant("Here they are."), user("x")) }},
		{"messages reordered", func(m map[string]any) {
			ms := m["messages"].([]any)
			ms[0], ms[1] = ms[1], ms[0]
		}},
		{"model", func(m map[string]any) { m["model"] = "m2" }},
		{"tools", func(m map[string]any) { m["tools"] = []any{} }},
		{"tool_choice", func(m map[string]any) { m["tool_choice"] = "none" }},
		{"reasoning_effort", func(m map[string]any) { m["reasoning_effort"] = "high" }},
		{"add_special_tokens", func(m map[string]any) { m["add_special_tokens"] = true }},
		{"cache_salt", func(m map[string]any) { m["cache_salt"] = "s" }},
		{"chat_template_kwargs", func(m map[string]any) { m["chat_template_kwargs"] = map[string]any{"enable_thinking": false} }},
		{"no new message", func(m map[string]any) {
			ms := m["messages"].([]any)
			m["messages"] = ms[:len(ms)-1]
		}},
		{"role changed", func(m map[string]any) { msgAt(m, 2)["role"] = "user" }},
		{"name added", func(m map[string]any) { msgAt(m, 1)["name"] = "bob" }},
	}
	for _, tc := range misses {
		t.Run("miss/"+tc.name, func(t *testing.T) {
			assert.NotContains(t, lookup(t, next(tc.edit)), key)
		})
	}
	hits := []struct {
		name string
		edit func(m map[string]any)
	}{
		{"unchanged", nil},
		{"reply echoed with null fields", func(m map[string]any) {
			a := msgAt(m, 2)
			a["refusal"] = nil
			a["annotations"] = []any{}
			a["tool_calls"] = nil
			a["audio"] = nil
			a["reasoning_content"] = nil
			a["name"] = nil
		}},
		{"content as text parts", func(m map[string]any) {
			msgAt(m, 1)["content"] = []any{map[string]any{"type": "text", "text": "list the files"}}
		}},
		{"key order and whitespace", func(m map[string]any) { m["max_tokens"] = 7; m["stream"] = true }},
		{"router-only and sampling fields", func(m map[string]any) {
			m["conversation_id"] = "c"
			m["temperature"] = 0.2
		}},
	}
	for _, tc := range hits {
		t.Run("hit/"+tc.name, func(t *testing.T) {
			keys := lookup(t, next(tc.edit))
			require.NotEmpty(t, keys)
			assert.Equal(t, key, keys[0])
		})
	}
	t.Run("hit/another tenant is a miss", func(t *testing.T) {
		// Tenants are scoped by the router; here by the key function input.
		a, b := chatReq(t, next(nil)), chatReq(t, next(nil))
		a.Header, b.Header = map[string][]string{"Authorization": {"Bearer a"}}, map[string][]string{"Authorization": {"Bearer b"}}
		assert.NotEqual(t, kvroute.AuthorizationTenant(a), kvroute.AuthorizationTenant(b))
	})
}

func TestContinuationToolCalls(t *testing.T) {
	call := `[{"id":"call_1","type":"function","function":{"name":"ls","arguments":"{\"dir\":\".\"}"}}]`
	turn1 := map[string]any{"model": "m", "messages": msgs(user("list"))}
	key := storedKey(t, turn1, &kvroute.Reply{ToolCalls: []byte(call), FinishReason: "stop"})
	var calls any
	require.NoError(t, json.Unmarshal([]byte(call), &calls))
	turn2 := clone(turn1)
	turn2["messages"] = append(turn2["messages"].([]any),
		map[string]any{"role": "assistant", "content": nil, "tool_calls": calls},
		map[string]any{"role": "tool", "tool_call_id": "call_1", "content": "a.go b.go"})
	keys := lookup(t, turn2)
	require.NotEmpty(t, keys)
	assert.Equal(t, key, keys[0])

	// Different arguments: a miss.
	turn2b := clone(turn2)
	turn2b["messages"].([]any)[1].(map[string]any)["tool_calls"].([]any)[0].(map[string]any)["function"].(map[string]any)["arguments"] = `{"dir":"/"}`
	assert.NotContains(t, lookup(t, turn2b), key)
}

func TestContinuationLongestPrefixFirst(t *testing.T) {
	t1 := map[string]any{"messages": msgs(user("a"))}
	k1 := storedKey(t, t1, &kvroute.Reply{Content: "A", FinishReason: "stop"})
	t2 := map[string]any{"messages": msgs(user("a"), assistant("A"), user("b"))}
	k2 := storedKey(t, t2, &kvroute.Reply{Content: "B", FinishReason: "stop"})
	t3 := map[string]any{"messages": msgs(user("a"), assistant("A"), user("b"), assistant("B"), user("c"))}
	assert.Equal(t, []string{k2, k1}, lookup(t, t3))
}

func TestContinuationRefusals(t *testing.T) {
	base := map[string]any{"messages": msgs(user("a"))}
	with := func(k string, v any) map[string]any { m := clone(base); m[k] = v; return m }
	ok := &kvroute.Reply{Content: "A", FinishReason: "stop"}
	cases := []struct {
		name  string
		body  map[string]any
		reply *kvroute.Reply
		want  string
	}{
		{"reasoning", base, &kvroute.Reply{Content: "A", Reasoning: "hmm", FinishReason: "stop"}, kvroute.RefuseReasoning},
		{"n", with("n", 2), ok, kvroute.RefuseN},
		{"truncate_prompt_tokens", with("truncate_prompt_tokens", 100), ok, kvroute.RefuseTruncate},
		{"stop string", with("stop", []string{"END"}), &kvroute.Reply{Content: "A", FinishReason: "stop", StopReason: []byte(`"END"`)}, kvroute.RefuseStopString},
		{"stop string, engine silent", with("stop", "END"), ok, kvroute.RefuseStopString},
		{"incomplete", base, &kvroute.Reply{Content: "A", FinishReason: "stop", Incomplete: true}, kvroute.RefuseIncomplete},
		{"too large", base, &kvroute.Reply{Content: strings.Repeat("x", kvroute.DefaultMaxReplyBytes+1), FinishReason: "stop"}, kvroute.RefuseTooLarge},
		{"continue_final_message", with("continue_final_message", true), ok, kvroute.RefuseContinueFinal},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ret, err := kvroute.ContinuationKeys{}.Key(chatReq(t, tc.body), tc.reply)
			require.NoError(t, err)
			assert.Empty(t, ret.Key)
			assert.Equal(t, tc.want, ret.Refusal)
		})
	}
	t.Run("stop string ended by EOS is kept", func(t *testing.T) {
		ret, err := kvroute.ContinuationKeys{}.Key(chatReq(t, with("stop", "END")), &kvroute.Reply{Content: "A", FinishReason: "stop", StopReason: []byte("null")})
		require.NoError(t, err)
		assert.NotEmpty(t, ret.Key)
	})
	t.Run("n=1 is fine", func(t *testing.T) {
		ret, err := kvroute.ContinuationKeys{}.Key(chatReq(t, with("n", 1)), ok)
		require.NoError(t, err)
		assert.NotEmpty(t, ret.Key)
	})
}

func TestContinuationCompletions(t *testing.T) {
	req := func(prompt string) *kvroute.Request {
		b, _ := json.Marshal(map[string]any{"model": "m", "prompt": prompt})
		return &kvroute.Request{Path: kvroute.PathCompletions, Body: b}
	}
	ck := kvroute.ContinuationKeys{}
	p1 := strings.Repeat("history ", 40)
	ret, err := ck.Key(req(p1), &kvroute.Reply{Content: " answer", FinishReason: "stop"})
	require.NoError(t, err)
	require.NotEmpty(t, ret.Key)
	next := req(p1 + " answer\nUser: more")
	keys, err := ck.Lookup(next)
	require.NoError(t, err)
	assert.Contains(t, keys, ret.Key)
	assert.True(t, ck.Verify(next, ret.Check))
	assert.False(t, ck.Verify(req(p1+" answxr\nUser: more"), ret.Check), "edited reply")
	assert.False(t, ck.Verify(req(p1+" answer"), ret.Check), "nothing new")
	assert.False(t, ck.Verify(req("x"+p1+" answer\nUser: more"), ret.Check))
}

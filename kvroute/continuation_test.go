package kvroute_test

import (
	"encoding/json"
	"net/http"
	"slices"
	"strconv"
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

// stored is the Retention ContinuationKeys keeps a chat turn under; the
// turn must be usable by content rules (a key, a content check, no
// refusal).
func stored(t testing.TB, body map[string]any, reply *kvroute.Reply) kvroute.Retention {
	t.Helper()
	return mustRetain(t, chatReq(t, body), reply)
}

func mustRetain(t testing.TB, req *kvroute.Request, reply *kvroute.Reply) kvroute.Retention {
	t.Helper()
	ret, err := kvroute.ContinuationKeys{}.Key(req, kvroute.Candidates{}, reply)
	require.NoError(t, err)
	require.NotEmpty(t, ret.Key, "refused: %s", ret.Refusal)
	require.Empty(t, ret.Refusal)
	require.NotEmpty(t, ret.Check)
	return ret
}

// rawChat builds a chat request from a literal body, for cases where key
// order and spelling matter.
func rawChat(body string) *kvroute.Request {
	return &kvroute.Request{Path: kvroute.PathChatCompletions, Body: []byte(body)}
}

// rawStored is the Retention a chat turn with the literal body is kept
// under.
func rawStored(t testing.TB, body string, reply *kvroute.Reply) kvroute.Retention {
	t.Helper()
	return mustRetain(t, rawChat(body), reply)
}

// continues reports whether req continues the turn retained as ret under
// content rules: Lookup names ret's key, Verify accepts ret's check, and
// the turn was not refused.
func continues(t testing.TB, req *kvroute.Request, ret kvroute.Retention) bool {
	t.Helper()
	ck := kvroute.ContinuationKeys{}
	c, err := ck.Lookup(req)
	require.NoError(t, err)
	return ret.Key != "" && slices.Contains(c.Keys, ret.Key) && ck.Verify(req, c, ret.Check) && ret.Refusal == ""
}

// verifies reports whether a fresh req's content check accepts ret's,
// whatever the anchor: anchors are not trusted, so every miss must fail
// here too.
func verifies(req *kvroute.Request, ret kvroute.Retention) bool {
	return kvroute.ContinuationKeys{}.Verify(req, kvroute.Candidates{}, ret.Check)
}

// anchor is the one key Lookup returns for a chat request.
func anchor(t testing.TB, req *kvroute.Request) string {
	t.Helper()
	c, err := kvroute.ContinuationKeys{}.Lookup(req)
	require.NoError(t, err)
	require.Len(t, c.Keys, 1)
	return c.Keys[0]
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
	ret := stored(t, turn1, reply)

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
			assert.False(t, continues(t, chatReq(t, next(tc.edit)), ret))
			assert.False(t, verifies(chatReq(t, next(tc.edit)), ret), "the content check alone refuses")
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
		{"sampling fields", func(m map[string]any) {
			m["temperature"] = 0.2
			m["top_p"] = 0.9
			m["seed"] = 3
		}},
	}
	for _, tc := range hits {
		t.Run("hit/"+tc.name, func(t *testing.T) {
			assert.True(t, continues(t, chatReq(t, next(tc.edit)), ret))
		})
	}
	// A conversation hint is router-only: it chooses the anchor (so the
	// turn must carry it too) but never enters the content check.
	t.Run("hit/router-only fields", func(t *testing.T) {
		withHint := func(m map[string]any) map[string]any {
			m = clone(m)
			m["conversation_id"] = "c"
			return m
		}
		hinted := stored(t, withHint(turn1), reply)
		assert.Equal(t, ret.Check, hinted.Check, "the hint is not content")
		assert.True(t, continues(t, chatReq(t, withHint(next(nil))), hinted))
		assert.True(t, verifies(chatReq(t, withHint(next(nil))), ret))
	})
	t.Run("hit/another tenant is a miss", func(t *testing.T) {
		// Tenants are scoped by the router; here by the key function input.
		a, b := chatReq(t, next(nil)), chatReq(t, next(nil))
		a.Header, b.Header = map[string][]string{"Authorization": {"Bearer a"}}, map[string][]string{"Authorization": {"Bearer b"}}
		assert.NotEqual(t, kvroute.PrincipalTenant(a), kvroute.PrincipalTenant(b))
	})
}

func TestContinuationToolCalls(t *testing.T) {
	call := `[{"id":"call_1","type":"function","function":{"name":"ls","arguments":"{\"dir\":\".\"}"}}]`
	turn1 := map[string]any{"model": "m", "messages": msgs(user("list"))}
	ret := stored(t, turn1, &kvroute.Reply{ToolCalls: []byte(call), FinishReason: "stop"})
	var calls any
	require.NoError(t, json.Unmarshal([]byte(call), &calls))
	turn2 := clone(turn1)
	turn2["messages"] = append(turn2["messages"].([]any),
		map[string]any{"role": "assistant", "content": nil, "tool_calls": calls},
		map[string]any{"role": "tool", "tool_call_id": "call_1", "content": "a.go b.go"})
	assert.True(t, continues(t, chatReq(t, turn2), ret))

	// Different arguments: a miss.
	turn2b := clone(turn2)
	turn2b["messages"].([]any)[1].(map[string]any)["tool_calls"].([]any)[0].(map[string]any)["function"].(map[string]any)["arguments"] = `{"dir":"/"}`
	assert.False(t, continues(t, chatReq(t, turn2b), ret))
	assert.False(t, verifies(chatReq(t, turn2b), ret))
}

// TestContinuationAnchor: a conversation's turns share one anchor key,
// from its start or from the client's hint; what the handle holds is
// decided by the content check alone.
func TestContinuationAnchor(t *testing.T) {
	sys := map[string]any{"role": "system", "content": "sys"}
	t1 := map[string]any{"messages": msgs(sys, user("a"))}
	r1 := stored(t, t1, &kvroute.Reply{Content: "A", FinishReason: "stop"})
	t2 := map[string]any{"messages": msgs(sys, user("a"), assistant("A"), user("b"))}
	r2 := stored(t, t2, &kvroute.Reply{Content: "B", FinishReason: "stop"})
	t3 := map[string]any{"messages": msgs(sys, user("a"), assistant("A"), user("b"), assistant("B"), user("c"))}

	t.Run("one anchor per conversation", func(t *testing.T) {
		assert.Equal(t, r1.Key, r2.Key)
		assert.NotEqual(t, r1.Check, r2.Check)
		assert.Len(t, r1.Check, 32)
		for _, m := range []map[string]any{t1, t2, t3} {
			assert.Equal(t, r1.Key, anchor(t, chatReq(t, m)))
		}
	})
	t.Run("latest and earlier turns verify", func(t *testing.T) {
		assert.True(t, continues(t, chatReq(t, t3), r2))
		assert.True(t, continues(t, chatReq(t, t3), r1))
		assert.True(t, continues(t, chatReq(t, t2), r1))
		assert.False(t, continues(t, chatReq(t, t2), r2), "the request that made the turn")
	})
	t.Run("nothing new does not verify", func(t *testing.T) {
		// The last message is the stored reply itself.
		t2r := map[string]any{"messages": msgs(sys, user("a"), assistant("A"), user("b"), assistant("B"))}
		assert.False(t, continues(t, chatReq(t, t2r), r2))
		assert.False(t, verifies(chatReq(t, t2r), r2))
		assert.True(t, continues(t, chatReq(t, t2r), r1), "an earlier reply is followed by something new")
		t1r := map[string]any{"messages": msgs(sys, user("a"), assistant("A"))}
		assert.False(t, continues(t, chatReq(t, t1r), r1))
	})
	t.Run("an edit keeps the anchor but fails the check", func(t *testing.T) {
		edited := map[string]any{"messages": msgs(sys, user("a"), assistant("A!"), user("b"), assistant("B"), user("c"))}
		assert.Equal(t, r1.Key, anchor(t, chatReq(t, edited)))
		assert.False(t, continues(t, chatReq(t, edited), r2))
		assert.False(t, continues(t, chatReq(t, edited), r1))
	})
	t.Run("the start", func(t *testing.T) {
		other := stored(t, map[string]any{"messages": msgs(sys, user("x"))}, &kvroute.Reply{Content: "A", FinishReason: "stop"})
		assert.NotEqual(t, r1.Key, other.Key, "a different first user message")
		sys2 := stored(t, map[string]any{"messages": msgs(map[string]any{"role": "system", "content": "sys2"}, user("a"))}, &kvroute.Reply{Content: "A", FinishReason: "stop"})
		assert.NotEqual(t, r1.Key, sys2.Key, "a different system prompt")
		dev := map[string]any{"role": "developer", "content": "dev"}
		d1 := stored(t, map[string]any{"messages": msgs(sys, dev, user("a"))}, &kvroute.Reply{Content: "A", FinishReason: "stop"})
		assert.NotEqual(t, r1.Key, d1.Key, "a developer message is part of the start")
		assert.Equal(t, d1.Key, anchor(t, chatReq(t, map[string]any{"messages": msgs(sys, dev, user("a"), assistant("A"), user("b"))})))
		model := stored(t, map[string]any{"model": "m2", "messages": msgs(sys, user("a"))}, &kvroute.Reply{Content: "A", FinishReason: "stop"})
		assert.NotEqual(t, r1.Key, model.Key, "another model")
		salt := stored(t, map[string]any{"cache_salt": "s", "messages": msgs(sys, user("a"))}, &kvroute.Reply{Content: "A", FinishReason: "stop"})
		assert.NotEqual(t, r1.Key, salt.Key, "another cache_salt")
	})
	t.Run("hint", func(t *testing.T) {
		reply := &kvroute.Reply{Content: "A", FinishReason: "stop"}
		hinted := func(field, hint string, ms []map[string]any) *kvroute.Request {
			if field == "header" {
				req := chatReq(t, map[string]any{"messages": ms})
				req.Header = http.Header{"X-Session-Id": {hint}}
				return req
			}
			return chatReq(t, map[string]any{field: hint, "messages": ms})
		}
		for _, field := range []string{"conversation_id", "session_id", "prompt_cache_key", "header"} {
			t.Run(field, func(t *testing.T) {
				h := mustRetain(t, hinted(field, "h", msgs(user("a"))), reply)
				assert.NotEqual(t, r1.Key, h.Key)
				assert.Equal(t, h.Key, anchor(t, hinted(field, "h", msgs(sys, user("z"), assistant("Z"), user("y")))),
					"the hint's anchor whatever the messages")
				assert.NotEqual(t, h.Key, anchor(t, hinted(field, "h2", msgs(user("a")))), "two hints differ")
				assert.True(t, continues(t, hinted(field, "h", msgs(user("a"), assistant("A"), user("b"))), h))
				// The hint finds the handle; the content check still decides.
				assert.False(t, continues(t, hinted(field, "h", msgs(user("z"), assistant("A"), user("b"))), h))
			})
		}
	})
}

func TestContinuationRefusals(t *testing.T) {
	base := map[string]any{"messages": msgs(user("a"))}
	with := func(kv ...any) map[string]any {
		m := clone(base)
		for i := 0; i < len(kv); i += 2 {
			m[kv[i].(string)] = kv[i+1]
		}
		return m
	}
	ok := &kvroute.Reply{Content: "A", FinishReason: "stop"}
	content := func(s string) *kvroute.Reply { return &kvroute.Reply{Content: s, FinishReason: "stop"} }
	thinking := func(v any) map[string]any { return with("chat_template_kwargs", map[string]any{"enable_thinking": v}) }
	type keys = kvroute.ContinuationKeys
	cases := []struct {
		name  string
		ck    keys
		body  map[string]any
		reply *kvroute.Reply
		want  kvroute.Refusal // "" retains for content rules
		soft  bool            // the key comes with the refusal: only n is hard
	}{
		{"reasoning", keys{}, base, &kvroute.Reply{Content: "A", Reasoning: "hmm", FinishReason: "stop"}, kvroute.RefuseReasoning, true},
		{"n", keys{}, with("n", 2), ok, kvroute.RefuseN, false},
		{"n as string", keys{}, with("n", "2"), ok, kvroute.RefuseN, false},
		{"n as float", keys{}, with("n", 2.0), ok, kvroute.RefuseN, false},
		{"n unreadable", keys{}, with("n", "two"), ok, kvroute.RefuseN, false},
		{"n=1", keys{}, with("n", 1), ok, "", false},
		{"n=\"1\"", keys{}, with("n", "1"), ok, "", false},
		{"n=1.0", keys{}, with("n", json.Number("1.0")), ok, "", false},
		{"n=true", keys{}, with("n", true), ok, "", false},
		{"truncate_prompt_tokens", keys{}, with("truncate_prompt_tokens", 100), ok, kvroute.RefuseTruncate, true},
		{"stop string", keys{}, with("stop", []string{"END"}), &kvroute.Reply{Content: "A", FinishReason: "stop", StopReason: []byte(`"END"`)}, kvroute.RefuseStopString, true},
		{"stop string, engine silent", keys{}, with("stop", "END"), ok, kvroute.RefuseStopString, true},
		{"stop string ended by EOS", keys{}, with("stop", "END"), &kvroute.Reply{Content: "A", FinishReason: "stop", StopReason: []byte("null")}, "", false},
		{"stop string kept", keys{}, with("stop", "END", "include_stop_str_in_output", true), ok, "", false},
		{"stop string kept, as string", keys{}, with("stop", "END", "include_stop_str_in_output", "true"), ok, "", false},
		{"stop string kept, as 1", keys{}, with("stop", "END", "include_stop_str_in_output", 1), ok, "", false},
		{"stop string not kept, as \"off\"", keys{}, with("stop", "END", "include_stop_str_in_output", "off"), ok, kvroute.RefuseStopString, true},
		{"incomplete", keys{}, base, &kvroute.Reply{Content: "A", FinishReason: "stop", Incomplete: true}, kvroute.RefuseIncomplete, true},
		{"too large", keys{}, base, content(strings.Repeat("x", 1<<20+1)), kvroute.RefuseTooLarge, true},
		{"continue_final_message", keys{}, with("continue_final_message", true), ok, kvroute.RefuseContinueFinal, true},
		{"continue_final_message as \"true\"", keys{}, with("continue_final_message", "true"), ok, kvroute.RefuseContinueFinal, true},
		{"continue_final_message as 1", keys{}, with("continue_final_message", 1), ok, kvroute.RefuseContinueFinal, true},
		{"continue_final_message as \"yes\"", keys{}, with("continue_final_message", "yes"), ok, kvroute.RefuseContinueFinal, true},
		{"continue_final_message unreadable", keys{}, with("continue_final_message", "sure"), ok, kvroute.RefuseContinueFinal, true},
		{"continue_final_message as \"false\"", keys{}, with("continue_final_message", "false"), ok, "", false},
		{"continue_final_message as 0", keys{}, with("continue_final_message", 0), ok, "", false},
		{"echo", keys{}, with("echo", true), ok, kvroute.RefuseEcho, true},
		{"echo as 1", keys{}, with("echo", 1), ok, kvroute.RefuseEcho, true},
		{"echo as \"True\"", keys{}, with("echo", "True"), ok, kvroute.RefuseEcho, true},
		{"echo as 1.0", keys{}, with("echo", json.Number("1.0")), ok, kvroute.RefuseEcho, true},
		{"echo as \"no\"", keys{}, with("echo", "no"), ok, "", false},
		{"add_generation_prompt false", keys{}, with("add_generation_prompt", false), ok, kvroute.RefuseNoGenerationPrompt, true},
		{"add_generation_prompt 0", keys{}, with("add_generation_prompt", 0), ok, kvroute.RefuseNoGenerationPrompt, true},
		{"add_generation_prompt \"false\"", keys{}, with("add_generation_prompt", "false"), ok, kvroute.RefuseNoGenerationPrompt, true},
		{"add_generation_prompt \"n\"", keys{}, with("add_generation_prompt", "n"), ok, kvroute.RefuseNoGenerationPrompt, true},
		{"add_generation_prompt unreadable", keys{}, with("add_generation_prompt", "later"), ok, kvroute.RefuseNoGenerationPrompt, true},
		{"add_generation_prompt true", keys{}, with("add_generation_prompt", true), ok, "", false},
		{"add_generation_prompt \"yes\"", keys{}, with("add_generation_prompt", "yes"), ok, "", false},
		{"add_generation_prompt null", keys{}, with("add_generation_prompt", nil), ok, "", false},
		{"inline reasoning", keys{}, base, content("<think>let me see</think>\n\nA"), kvroute.RefuseInlineReasoning, true},
		{"inline reasoning, close tag only", keys{}, base, content("let me see</think>A"), kvroute.RefuseInlineReasoning, true},
		{"inline reasoning, custom tag", keys{ReasoningCloseTags: []string{"</seed:think>"}}, base, content("x</seed:think>A"), kvroute.RefuseInlineReasoning, true},
		{"custom tags replace the default", keys{ReasoningCloseTags: []string{"</seed:think>"}}, base, content("x</think>A"), "", false},
		{"inline reasoning check off", keys{ReasoningCloseTags: []string{}}, base, content("x</think>A"), "", false},
		{"open tag alone is content", keys{}, base, content("use <think> tags"), "", false},
		{"enable_thinking false", keys{}, thinking(false), ok, kvroute.RefuseThinkingOff, true},
		{"enable_thinking \"false\"", keys{}, thinking("false"), ok, kvroute.RefuseThinkingOff, true},
		{"enable_thinking null", keys{}, thinking(nil), ok, kvroute.RefuseThinkingOff, true},
		{"enable_thinking true", keys{}, thinking(true), ok, "", false},
		{"other chat_template_kwargs", keys{}, with("chat_template_kwargs", map[string]any{"x": false}), ok, "", false},
		{"hard refusal wins over soft", keys{}, with("n", 2, "add_generation_prompt", false), ok, kvroute.RefuseN, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ret, err := tc.ck.Key(chatReq(t, tc.body), kvroute.Candidates{}, tc.reply)
			require.NoError(t, err)
			assert.Equal(t, tc.want, ret.Refusal)
			if tc.want == "" || tc.soft {
				assert.NotEmpty(t, ret.Key)
				assert.Len(t, ret.Check, 32)
			} else {
				assert.Empty(t, ret.Key)
				assert.Empty(t, ret.Check)
			}
		})
	}
}

// TestContinuationToolCallArguments: arguments hash by JSON type and
// value, so an edited earlier tool call misses whatever the form of its
// arguments.
func TestContinuationToolCallArguments(t *testing.T) {
	// A conversation whose history holds an assistant tool call with the
	// given function object, then a tool result.
	body := func(function string) string {
		return `{"model":"m","messages":[{"role":"user","content":"list"},` +
			`{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":` + function + `}]},` +
			`{"role":"tool","tool_call_id":"call_1","content":"a.go"}]}`
	}
	reply := &kvroute.Reply{Content: "Done.", FinishReason: "stop"}
	// next sends the stored turn back with the reply and a new message.
	next := func(function string) string {
		b := body(function)
		return b[:len(b)-2] + `,{"role":"assistant","content":"Done."},{"role":"user","content":"more"}]}`
	}
	cases := []struct {
		name          string
		stored, later string
		hit           bool
	}{
		{"string unchanged", `{"name":"ls","arguments":"{\"dir\":\".\"}"}`, `{"name":"ls","arguments":"{\"dir\":\".\"}"}`, true},
		{"string edited", `{"name":"ls","arguments":"{\"dir\":\".\"}"}`, `{"name":"ls","arguments":"{\"dir\":\"/\"}"}`, false},
		{"string respaced", `{"name":"ls","arguments":"{\"dir\":\".\"}"}`, `{"name":"ls","arguments":"{\"dir\": \".\"}"}`, false},
		{"object unchanged", `{"name":"ls","arguments":{"dir":"."}}`, `{"name":"ls","arguments":{"dir":"."}}`, true},
		{"object edited", `{"name":"ls","arguments":{"dir":"."}}`, `{"name":"ls","arguments":{"dir":"/"}}`, false},
		{"object member added", `{"name":"ls","arguments":{"dir":"."}}`, `{"name":"ls","arguments":{"dir":".","all":true}}`, false},
		{"object respaced", `{"name":"ls","arguments":{"dir":".","all":true}}`, `{"name":"ls","arguments": { "dir" : ".", "all" : true } }`, true},
		{"object escapes", `{"name":"ls","arguments":{"dir":"a"}}`, `{"name":"ls","arguments":{"dir":"\u0061"}}`, true},
		// The template serializes dicts in their order (transformers'
		// tojson does not sort keys), so a reordered object renders
		// differently.
		{"object reordered", `{"name":"ls","arguments":{"dir":".","all":true}}`, `{"name":"ls","arguments":{"all":true,"dir":"."}}`, false},
		{"nested object edited", `{"name":"ls","arguments":{"opts":{"depth":1}}}`, `{"name":"ls","arguments":{"opts":{"depth":2}}}`, false},
		{"array edited", `{"name":"ls","arguments":["a","b"]}`, `{"name":"ls","arguments":["a","c"]}`, false},
		{"array unchanged", `{"name":"ls","arguments":["a","b"]}`, `{"name":"ls","arguments":[ "a", "b" ]}`, true},
		{"number edited", `{"name":"ls","arguments":1}`, `{"name":"ls","arguments":2}`, false},
		{"string {} is not object {}", `{"name":"ls","arguments":"{}"}`, `{"name":"ls","arguments":{}}`, false},
		{"string \"1\" is not number 1", `{"name":"ls","arguments":"1"}`, `{"name":"ls","arguments":1}`, false},
		{"string of the object is not the object", `{"name":"ls","arguments":"{\"dir\":\".\"}"}`, `{"name":"ls","arguments":{"dir":"."}}`, false},
		{"name edited", `{"name":"ls","arguments":{}}`, `{"name":"cat","arguments":{}}`, false},
		{"function members reordered", `{"name":"ls","arguments":{"dir":"."}}`, `{"arguments":{"dir":"."},"name":"ls"}`, true},
		{"function member added", `{"name":"ls","arguments":{}}`, `{"name":"ls","arguments":{},"strict":true}`, false},
		{"function null member", `{"name":"ls","arguments":{}}`, `{"name":"ls","arguments":{},"strict":null}`, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ret := rawStored(t, body(tc.stored), reply)
			assert.Equal(t, tc.hit, continues(t, rawChat(next(tc.later)), ret))
			assert.Equal(t, tc.hit, verifies(rawChat(next(tc.later)), ret))
		})
	}
}

// TestContinuationToolCallMembers: every member of a call is hashed, in
// any order; the engine's string form echoed back hits.
func TestContinuationToolCallMembers(t *testing.T) {
	engine := `[{"id":"call_1","type":"function","function":{"name":"ls","arguments":"{\"dir\":\".\"}"}}]`
	turn1 := `{"model":"m","messages":[{"role":"user","content":"list"}]}`
	ret := rawStored(t, turn1, &kvroute.Reply{ToolCalls: []byte(engine), FinishReason: "tool_calls"})
	next := func(calls string) string {
		return `{"model":"m","messages":[{"role":"user","content":"list"},{"role":"assistant","content":null,"tool_calls":` + calls +
			`},{"role":"tool","tool_call_id":"call_1","content":"a.go"}]}`
	}
	cases := []struct {
		name  string
		calls string
		hit   bool
	}{
		{"engine form", engine, true},
		// The OpenAI SDK's model_dump order.
		{"SDK member order", `[{"id":"call_1","function":{"arguments":"{\"dir\":\".\"}","name":"ls"},"type":"function"}]`, true},
		{"whitespace", `[ { "id" : "call_1", "type" : "function", "function" : { "name" : "ls", "arguments" : "{\"dir\":\".\"}" } } ]`, true},
		{"type absent", `[{"id":"call_1","function":{"name":"ls","arguments":"{\"dir\":\".\"}"}}]`, true},
		{"null member", `[{"id":"call_1","type":"function","index":null,"function":{"name":"ls","arguments":"{\"dir\":\".\"}"}}]`, true},
		{"id edited", `[{"id":"call_2","type":"function","function":{"name":"ls","arguments":"{\"dir\":\".\"}"}}]`, false},
		{"type edited", `[{"id":"call_1","type":"custom","function":{"name":"ls","arguments":"{\"dir\":\".\"}"}}]`, false},
		{"member added", `[{"id":"call_1","type":"function","index":0,"function":{"name":"ls","arguments":"{\"dir\":\".\"}"}}]`, false},
		{"arguments as object", `[{"id":"call_1","type":"function","function":{"name":"ls","arguments":{"dir":"."}}}]`, false},
		{"arguments absent", `[{"id":"call_1","type":"function","function":{"name":"ls"}}]`, false},
		{"second call", `[` + engine[1:len(engine)-1] + `,{"id":"call_2","type":"function","function":{"name":"ls","arguments":"{}"}}]`, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.hit, continues(t, rawChat(next(tc.calls)), ret))
			assert.Equal(t, tc.hit, verifies(rawChat(next(tc.calls)), ret))
		})
	}
}

// TestContinuationContentParts: one text part is the string; two or more
// never are (vLLM's openai content format concatenates them, its string
// format joins them with newlines).
func TestContinuationContentParts(t *testing.T) {
	text := func(s ...string) []any {
		parts := []any{}
		for _, p := range s {
			parts = append(parts, map[string]any{"type": "text", "text": p})
		}
		return parts
	}
	keyOf := func(t *testing.T, content any) kvroute.Retention {
		return stored(t, map[string]any{"messages": msgs(map[string]any{"role": "user", "content": content})},
			&kvroute.Reply{Content: "A", FinishReason: "stop"})
	}
	cases := []struct {
		name string
		a, b any
		same bool
	}{
		{"one part is the string", "ab", text("ab"), true},
		{"two parts are not the newline join", "a\nb", text("a", "b"), false},
		{"two parts are not the concatenation", "ab", text("a", "b"), false},
		{"two parts are not one", text("ab"), text("a", "b"), false},
		{"split elsewhere", text("a", "bc"), text("ab", "c"), false},
		{"same parts", text("a", "b"), text("a", "b"), true},
		{"three parts are not two", text("a", "b", ""), text("a", "b"), false},
		{"null is empty", nil, "", true},
		{"no parts are null", []any{}, nil, true},
		{"one empty part is empty", text(""), "", true},
		{"image part", text("a"), []any{map[string]any{"type": "image_url", "image_url": map[string]any{"url": "x"}}}, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			// The first user message is the conversation's start, so it
			// shapes both the anchor and the content check.
			a, b := keyOf(t, tc.a), keyOf(t, tc.b)
			if tc.same {
				assert.Equal(t, a.Key, b.Key)
				assert.Equal(t, a.Check, b.Check)
			} else {
				assert.NotEqual(t, a.Key, b.Key)
				assert.NotEqual(t, a.Check, b.Check)
			}
		})
	}
}

func completionReq(prompt string) *kvroute.Request {
	b, _ := json.Marshal(map[string]any{"model": "m", "prompt": prompt})
	return &kvroute.Request{Path: kvroute.PathCompletions, Body: b}
}

func TestContinuationCompletions(t *testing.T) {
	ck := kvroute.ContinuationKeys{}
	p1 := strings.Repeat("history ", 40) + "Q:"
	ret, err := ck.Key(completionReq(p1), kvroute.Candidates{}, &kvroute.Reply{Content: " answer", FinishReason: "stop"})
	require.NoError(t, err)
	require.NotEmpty(t, ret.Key)
	require.Empty(t, ret.Refusal)
	assert.True(t, continues(t, completionReq(p1+" answer\nUser: more"), ret))
	for name, prompt := range map[string]string{
		"edited reply":   p1 + " answxr\nUser: more",
		"nothing new":    p1 + " answer",
		"other start":    "x" + p1 + " answer\nUser: more",
		"edited history": "H" + p1[1:] + " answer\nUser: more",
	} {
		assert.False(t, continues(t, completionReq(prompt), ret), name)
		assert.False(t, ck.Verify(completionReq(prompt), kvroute.Candidates{}, ret.Check), name)
	}

	t.Run("anchors", func(t *testing.T) {
		// The turn is kept under the anchor of its text's leading 320
		// bytes (329 bytes in all: anchor lengths are m*2^e, m in 4..7);
		// Lookup tries the prompt's anchor lengths, longest first, eight
		// of them.
		text := p1 + " answer"
		require.Len(t, text, 329)
		c, err := ck.Lookup(completionReq(text + "\nUser: more"))
		require.NoError(t, err)
		keys := c.Keys
		require.Len(t, keys, 8)
		assert.Equal(t, ret.Key, keys[0])
		assert.Len(t, slices.Compact(slices.Clone(keys)), 8)
		// Found while the prompt grows below four times the anchor
		// (the eighth length above 320 is 1,280)...
		long := text + " " + strings.Repeat("more ", (4*320-len(text)-2)/5)
		require.Less(t, len(long), 4*320)
		assert.True(t, continues(t, completionReq(long), ret))
		// ...and not beyond.
		longer := text + " " + strings.Repeat("more ", (4*320-len(text))/5+1)
		require.GreaterOrEqual(t, len(longer), 4*320)
		assert.False(t, continues(t, completionReq(longer), ret))
		assert.True(t, ck.Verify(completionReq(longer), kvroute.Candidates{}, ret.Check), "only the anchor is out of reach")
	})
	t.Run("hint", func(t *testing.T) {
		req := func(prompt, hint string) *kvroute.Request {
			b, _ := json.Marshal(map[string]any{"model": "m", "prompt": prompt, "conversation_id": hint})
			return &kvroute.Request{Path: kvroute.PathCompletions, Body: b}
		}
		h, err := ck.Key(req(p1, "h"), kvroute.Candidates{}, &kvroute.Reply{Content: " answer", FinishReason: "stop"})
		require.NoError(t, err)
		require.Empty(t, h.Refusal)
		assert.Equal(t, ret.Check, h.Check, "the hint is not content")
		assert.NotEqual(t, ret.Key, h.Key)
		c, err := ck.Lookup(req("anything else entirely", "h"))
		require.NoError(t, err)
		assert.Equal(t, []string{h.Key}, c.Keys, "the hint's anchor whatever the prompt")
		other, err := ck.Lookup(req(p1, "h2"))
		require.NoError(t, err)
		assert.NotEqual(t, c.Keys, other.Keys, "two hints differ")
		assert.True(t, continues(t, req(p1+" answer\nUser: more", "h"), h))
		assert.False(t, continues(t, req("x"+p1+" answer\nUser: more", "h"), h))
	})
	t.Run("token ids", func(t *testing.T) {
		ids := func(n int) *kvroute.Request {
			p := make([]int, n)
			for i := range p {
				p[i] = 1000 + i
			}
			b, _ := json.Marshal(map[string]any{"model": "m", "prompt": p})
			return &kvroute.Request{Path: kvroute.PathCompletions, Body: b}
		}
		ret, err := ck.Key(ids(40), kvroute.Candidates{}, &kvroute.Reply{Content: " answer", FinishReason: "stop"})
		require.NoError(t, err)
		assert.Equal(t, kvroute.RefuseUnkeyable, ret.Refusal, "soft: kept for token verification")
		require.NotEmpty(t, ret.Key)
		c, err := ck.Lookup(ids(60))
		require.NoError(t, err)
		assert.Contains(t, c.Keys, ret.Key, "a longer prompt of the same ids finds the anchor")
		assert.False(t, continues(t, ids(60), ret))
	})
}

// TestContinuationCompletionSeams: a prompt and its reply must meet where
// a BPE tokenizer cuts anyway, and so must the stored text and what the
// next prompt adds.
func TestContinuationCompletionSeams(t *testing.T) {
	head := strings.Repeat("history ", 10)
	keyCases := []struct {
		name, prompt, reply string
		clean               bool
	}{
		{"space starts the reply", head + "A:", " Sure.", true},
		{"newline after a word", head + "A", "\nSure.", true},
		{"newline after a digit", head + "A1", "\nSure.", true},
		{"empty reply", head + "A:", "", true},
		{"prompt ends in a space", head + "A: ", "Sure.", false},
		{"prompt ends in a newline", head + "A:\n", "Sure.", false},
		{"prompt ends in a space, empty reply", head + "A: ", "", false},
		{"reply continues the word", head + "Hel", "lo there.", false},
		{"reply continues the number", head + "12", "34 apples.", false},
		{"word after punctuation", head + "A:", "Sure.", false},      // ":Sure" is one Llama 3 pre-token
		{"newline after punctuation", head + "A:", "\nSure.", false}, // ":\n" is one token
		{"punctuation after punctuation", head + "Wait.", "..", false},
		{"reply ends in a space", head + "A:", " Sure. ", false},
		{"reply ends in a newline", head + "A:", " Sure.\n", false},
		{"non-ASCII letters", head + "Straße", "n sind lang.", false},
	}
	for _, tc := range keyCases {
		t.Run("key/"+tc.name, func(t *testing.T) {
			ret, err := kvroute.ContinuationKeys{}.Key(completionReq(tc.prompt), kvroute.Candidates{}, &kvroute.Reply{Content: tc.reply, FinishReason: "stop"})
			require.NoError(t, err)
			assert.NotEmpty(t, ret.Key, "soft refusal: the key is kept for token verification")
			assert.NotEmpty(t, ret.Check)
			if tc.clean {
				assert.Empty(t, ret.Refusal)
			} else {
				assert.Equal(t, kvroute.RefuseTokenBoundary, ret.Refusal)
			}
		})
	}
	verifyCases := []struct {
		name, reply, then string
		ok                bool
	}{
		{"newline after a word", " the answer", "\nUser: more", true},
		{"space after a word", " the answer", " and more", true},
		{"space after punctuation", " the answer.", " More", true},
		{"word continued", " the answer", "s are wrong", false},
		{"number continued", " it is 12", "34", false},
		{"newline after punctuation", " the answer.", "\nUser: more", false},
		{"punctuation after a word", " the answer", ".", false},
		{"punctuation after punctuation", " the answer.", "..", false},
		{"word after punctuation", " the answer:", "yes", false},
		{"tab", " the answer", "\tmore", false},
	}
	prompt := head + "Q:"
	for _, tc := range verifyCases {
		t.Run("verify/"+tc.name, func(t *testing.T) {
			ck := kvroute.ContinuationKeys{}
			ret, err := ck.Key(completionReq(prompt), kvroute.Candidates{}, &kvroute.Reply{Content: tc.reply, FinishReason: "stop"})
			require.NoError(t, err)
			require.Empty(t, ret.Refusal)
			assert.Equal(t, tc.ok, continues(t, completionReq(prompt+tc.reply+tc.then), ret))
			assert.Equal(t, tc.ok, ck.Verify(completionReq(prompt+tc.reply+tc.then), kvroute.Candidates{}, ret.Check))
		})
	}
}

// TestContinuationReplyQuoted: a reply is raw text, so one that begins
// and ends with a double quote (a model quoting a string back) continues
// like any other, and one spelled like a JSON escape stays the text it is.
func TestContinuationReplyQuoted(t *testing.T) {
	for _, text := range []string{`"main.go"`, `"a\nb"`, `"\u00e9"`, `"`, `""`, `"unterminated\"`} {
		t.Run(text, func(t *testing.T) {
			turn1 := map[string]any{"model": "m", "messages": msgs(user("quote the file name"))}
			ret := stored(t, turn1, &kvroute.Reply{Content: text, FinishReason: "stop"})
			next := clone(turn1)
			next["messages"] = append(next["messages"].([]any), assistant(text), user("thanks"))
			assert.True(t, continues(t, chatReq(t, next), ret), "the resent reply %q continues", text)
			// Its JSON-decoded form is another text: it must not.
			if s, err := strconv.Unquote(text); err == nil && s != text {
				other := clone(turn1)
				other["messages"] = append(other["messages"].([]any), assistant(s), user("thanks"))
				assert.False(t, continues(t, chatReq(t, other), ret), "%q is not the reply %q", s, text)
			}
		})
	}
}

// The fields that shape a completions prompt's tokens are part of its
// content check: add_special_tokens puts a BOS token in front of the same
// text, so a handle retained without it holds other tokens.
func TestContinuationCompletionShaping(t *testing.T) {
	ck := kvroute.ContinuationKeys{}
	p1 := strings.Repeat("history ", 40) + "Q:"
	req := func(prompt string, extra map[string]any) *kvroute.Request {
		m := map[string]any{"model": "m", "prompt": prompt}
		for k, v := range extra {
			m[k] = v
		}
		b, err := json.Marshal(m)
		require.NoError(t, err)
		return &kvroute.Request{Path: kvroute.PathCompletions, Body: b}
	}
	next := p1 + " answer\nUser: more"
	for _, tc := range []struct {
		name         string
		turn1, turn2 map[string]any
		same         bool
	}{
		{"add_special_tokens turned on", nil, map[string]any{"add_special_tokens": true}, false},
		{"add_special_tokens turned off", map[string]any{"add_special_tokens": true}, map[string]any{"add_special_tokens": false}, false},
		{"add_special_tokens spelled 1: another spelling, refused", map[string]any{"add_special_tokens": true}, map[string]any{"add_special_tokens": 1}, false},
		{"mm_processor_kwargs", nil, map[string]any{"mm_processor_kwargs": map[string]any{"x": 1}}, false},
		{"add_special_tokens kept", map[string]any{"add_special_tokens": true}, map[string]any{"add_special_tokens": true, "temperature": 0.5}, true},
		{"null is absent", nil, map[string]any{"add_special_tokens": nil}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ret, err := ck.Key(req(p1, tc.turn1), kvroute.Candidates{}, &kvroute.Reply{Content: " answer", FinishReason: "stop"})
			require.NoError(t, err)
			require.NotEmpty(t, ret.Key)
			assert.True(t, continues(t, req(next, tc.turn1), ret), "the same fields continue")
			assert.Equal(t, tc.same, ck.Verify(req(next, tc.turn2), kvroute.Candidates{}, ret.Check))
		})
	}
}

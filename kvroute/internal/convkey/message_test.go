package convkey_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/internal/convkey"
)

// sum is the digest a fresh Chainer gives message m after the zero
// digest.
func sum(t testing.TB, m string) [32]byte {
	t.Helper()
	s, _, err := convkey.NewChainer().Message([32]byte{}, []byte(m), nil)
	require.NoError(t, err, "%s", m)
	return s
}

// The canonical form: messages whose meaning is equal (what a chat
// template renders from them is the same) hash equal, however a client
// spells them.
func TestMessageEquivalences(t *testing.T) {
	for _, tc := range []struct {
		name string
		a, b string
	}{
		// Spelling of the JSON.
		{"key order", `{"role":"user","content":"hi","name":"bob"}`, `{"name":"bob","content":"hi","role":"user"}`},
		{"whitespace", `{"role":"user","content":"hi"}`, "{ \"role\" :\t\"user\",\r\n  \"content\" : \"hi\" }"},
		{"escaped content", `{"role":"user","content":"caf\u00e9 \/ \"q\""}`, `{"role":"user","content":"café / \"q\""}`},
		{"escaped astral rune", `{"role":"user","content":"\ud83d\ude00"}`, `{"role":"user","content":"😀"}`},
		{"escaped control", `{"role":"user","content":"a\nb\u0009"}`, `{"role":"user","content":"a\u000ab\t"}`},
		{"escaped role", `{"role":"\u0075ser","content":"hi"}`, `{"role":"user","content":"hi"}`},
		{"escaped name", `{"role":"user","name":"b\u006fb","content":"hi"}`, `{"role":"user","name":"bob","content":"hi"}`},
		{"escaped tool_call_id", `{"role":"tool","tool_call_id":"call\u005f1","content":"a.go"}`, `{"role":"tool","tool_call_id":"call_1","content":"a.go"}`},
		{"escaped key", `{"r\u006fle":"user","c\u006fntent":"hi"}`, `{"role":"user","content":"hi"}`},

		// Content: a string and one text part are the same text.
		{"one text part is the string", `{"role":"user","content":[{"type":"text","text":"hi"}]}`, `{"role":"user","content":"hi"}`},
		{"text part members in any order", `{"role":"user","content":[{"text":"hi","type":"text"}]}`, `{"role":"user","content":"hi"}`},
		{"text part escaped", `{"role":"user","content":[{"type":"t\u0065xt","text":"h\u0069"}]}`, `{"role":"user","content":"hi"}`},
		{"text part with a null member", `{"role":"user","content":[{"type":"text","text":"hi","cache_control":null}]}`, `{"role":"user","content":"hi"}`},
		{"two parts spelled otherwise", `{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}`,
			`{"role":"user","content":[ {"text":"\u0061","type":"text"} , {"type":"text","text":"b"} ]}`},
		{"null content is empty", `{"role":"assistant","content":null}`, `{"role":"assistant","content":""}`},
		{"absent content is empty", `{"role":"assistant"}`, `{"role":"assistant","content":""}`},
		{"no parts are empty", `{"role":"assistant","content":[]}`, `{"role":"assistant","content":""}`},
		{"one empty part is empty", `{"role":"assistant","content":[{"type":"text","text":""}]}`, `{"role":"assistant","content":""}`},

		// Null, absent and empty members.
		{"null name", `{"role":"user","content":"hi","name":null}`, `{"role":"user","content":"hi"}`},
		{"null tool_call_id", `{"role":"user","content":"hi","tool_call_id":null}`, `{"role":"user","content":"hi"}`},
		{"null tool_calls", `{"role":"assistant","content":"a","tool_calls":null}`, `{"role":"assistant","content":"a"}`},
		{"no tool_calls", `{"role":"assistant","content":"a","tool_calls":[]}`, `{"role":"assistant","content":"a"}`},
		{"null member", `{"role":"assistant","content":"a","reasoning_content":null}`, `{"role":"assistant","content":"a"}`},
		{"empty string member", `{"role":"assistant","content":"a","reasoning_content":""}`, `{"role":"assistant","content":"a"}`},

		// Members a client echoes back from an answer, which never reach
		// the prompt.
		{"echoed answer members", `{"role":"assistant","content":"a","refusal":null,"annotations":[],"audio":null,"function_call":null}`,
			`{"role":"assistant","content":"a"}`},

		// Other members: their order among themselves and their
		// whitespace do not matter.
		{"other members in any order", `{"role":"assistant","content":"a","x":1,"y":[1,2]}`, `{"y":[1, 2],"role":"assistant","x":1,"content":"a"}`},

		// Tool calls: the engine's member order and a client's echo.
		{"tool call member order", `{"role":"assistant","tool_calls":[{"id":"c1","type":"function","function":{"name":"ls","arguments":"{}"}}]}`,
			`{"role":"assistant","tool_calls":[{"function":{"arguments":"{}","name":"ls"},"type":"function","id":"c1"}]}`},
		{"tool call type absent", `{"role":"assistant","tool_calls":[{"id":"c1","type":"function","function":{"name":"ls","arguments":"{}"}}]}`,
			`{"role":"assistant","tool_calls":[{"id":"c1","function":{"name":"ls","arguments":"{}"}}]}`},
		{"tool call null member", `{"role":"assistant","tool_calls":[{"id":"c1","type":"function","function":{"name":"ls","arguments":"{}"}}]}`,
			`{"role":"assistant","tool_calls":[{"id":"c1","index":null,"type":"function","function":{"name":"ls","arguments":"{}","x":null}}]}`},
		{"tool call escapes and whitespace", `{"role":"assistant","tool_calls":[{"id":"c1","type":"function","function":{"name":"ls","arguments":"{\"dir\":\".\"}"}}]}`,
			`{"role":"assistant","tool_calls":[ { "id" : "c\u0031", "type" : "function", "function" : { "name" : "l\u0073", "arguments" : "{\"dir\":\"\u002e\"}" } } ]}`},
		{"tool call arguments object spelled otherwise", `{"role":"assistant","tool_calls":[{"id":"c1","function":{"name":"ls","arguments":{"dir":"."}}}]}`,
			`{"role":"assistant","tool_calls":[{"id":"c1","function":{"name":"ls","arguments":{ "dir" : "\u002e" }}}]}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, sum(t, tc.a), sum(t, tc.b), "%s\n%s", tc.a, tc.b)
		})
	}
}

// Anything that renders differently hashes differently, and so does
// anything the router cannot tell renders the same.
func TestMessageDistinctions(t *testing.T) {
	base := `{"role":"user","content":"hi"}`
	for _, tc := range []struct {
		name string
		a, b string
	}{
		{"role", base, `{"role":"assistant","content":"hi"}`},
		{"role absent", base, `{"content":"hi"}`},
		{"content", base, `{"role":"user","content":"Hi"}`},
		{"content longer", base, `{"role":"user","content":"hi "}`},
		{"content empty", base, `{"role":"user","content":""}`},
		{"name added", base, `{"role":"user","content":"hi","name":"bob"}`},
		{"name", `{"role":"user","content":"hi","name":"bob"}`, `{"role":"user","content":"hi","name":"bot"}`},
		{"tool_call_id added", base, `{"role":"user","content":"hi","tool_call_id":"c1"}`},
		{"other member added", base, `{"role":"user","content":"hi","reasoning_content":"I think"}`},
		{"other member's value", `{"role":"user","content":"hi","x":1}`, `{"role":"user","content":"hi","x":2}`},
		{"other member's name", `{"role":"user","content":"hi","x":1}`, `{"role":"user","content":"hi","y":1}`},

		// Content forms: vLLM renders two or more text parts either
		// concatenated or joined with newlines, so they are neither.
		{"two parts are not the concatenation", `{"role":"user","content":"ab"}`,
			`{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}`},
		{"two parts are not the newline join", `{"role":"user","content":"a\nb"}`,
			`{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}`},
		{"parts split elsewhere", `{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"bc"}]}`,
			`{"role":"user","content":[{"type":"text","text":"ab"},{"type":"text","text":"c"}]}`},
		{"an empty third part", `{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}`,
			`{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"},{"type":"text","text":""}]}`},
		{"parts in another order", `{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}`,
			`{"role":"user","content":[{"type":"text","text":"b"},{"type":"text","text":"a"}]}`},
		{"a string spelling the parts' framing", `{"role":"user","content":"\u0001a\u0001b"}`,
			`{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}`},
		{"an image part", `{"role":"user","content":[{"type":"text","text":"a"}]}`,
			`{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}`},
		{"a part with another member", `{"role":"user","content":"a"}`,
			`{"role":"user","content":[{"type":"text","text":"a","cache_control":{"type":"ephemeral"}}]}`},
		{"JSON content is not its text", `{"role":"user","content":"[{\"type\":\"image_url\"}]"}`,
			`{"role":"user","content":[{"type":"image_url"}]}`},

		// Length-prefixed fields: text moved from one field into the next
		// is another message.
		{"text moved from content to name", `{"role":"user","content":"ab"}`, `{"role":"user","content":"a","name":"b"}`},
		{"text moved from role to content", `{"role":"user","content":"x"}`, `{"role":"use","content":"rx"}`},
		{"text moved from name to tool_call_id", `{"role":"tool","name":"ab","content":"x"}`, `{"role":"tool","name":"a","tool_call_id":"b","content":"x"}`},

		// Tool calls.
		{"tool call added", `{"role":"assistant","content":"a"}`,
			`{"role":"assistant","content":"a","tool_calls":[{"id":"c1","type":"function","function":{"name":"ls","arguments":"{}"}}]}`},
		{"tool call arguments string is not the object", `{"role":"assistant","tool_calls":[{"id":"c1","function":{"name":"ls","arguments":"{}"}}]}`,
			`{"role":"assistant","tool_calls":[{"id":"c1","function":{"name":"ls","arguments":{}}}]}`},
		{"tool call arguments absent", `{"role":"assistant","tool_calls":[{"id":"c1","function":{"name":"ls","arguments":"{}"}}]}`,
			`{"role":"assistant","tool_calls":[{"id":"c1","function":{"name":"ls"}}]}`},
		{"tool call id", `{"role":"assistant","tool_calls":[{"id":"c1","function":{"name":"ls","arguments":"{}"}}]}`,
			`{"role":"assistant","tool_calls":[{"id":"c2","function":{"name":"ls","arguments":"{}"}}]}`},
		{"tool call type", `{"role":"assistant","tool_calls":[{"id":"c1","function":{"name":"ls","arguments":"{}"}}]}`,
			`{"role":"assistant","tool_calls":[{"id":"c1","type":"custom","function":{"name":"ls","arguments":"{}"}}]}`},
		{"tool call member added", `{"role":"assistant","tool_calls":[{"id":"c1","function":{"name":"ls","arguments":"{}"}}]}`,
			`{"role":"assistant","tool_calls":[{"id":"c1","index":0,"function":{"name":"ls","arguments":"{}"}}]}`},
		{"tool calls in another order", `{"role":"assistant","tool_calls":[{"id":"c1","function":{"name":"a"}},{"id":"c2","function":{"name":"b"}}]}`,
			`{"role":"assistant","tool_calls":[{"id":"c2","function":{"name":"b"}},{"id":"c1","function":{"name":"a"}}]}`},
		{"tool call arguments object member order", `{"role":"assistant","tool_calls":[{"id":"c1","function":{"name":"ls","arguments":{"a":1,"b":2}}}]}`,
			`{"role":"assistant","tool_calls":[{"id":"c1","function":{"name":"ls","arguments":{"b":2,"a":1}}}]}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.NotEqual(t, sum(t, tc.a), sum(t, tc.b), "%s\n%s", tc.a, tc.b)
		})
	}
}

// Message returns the message's role, decoded.
func TestMessageRole(t *testing.T) {
	for m, want := range map[string]string{
		`{"role":"user","content":"hi"}`:      "user",
		`{"content":"hi","role":"assistant"}`: "assistant",
		`{"role":"\u0074ool"}`:                "tool",
		`{"role":"critic"}`:                   "critic",
		`{"role":7}`:                          "",
		`{"content":"hi"}`:                    "",
	} {
		_, role, err := convkey.NewChainer().Message([32]byte{}, []byte(m), nil)
		require.NoError(t, err)
		assert.Equal(t, want, role, "%s", m)
	}
}

// A message that is not a JSON object is an error, and the chain stays
// where it was.
func TestMessageNotAnObject(t *testing.T) {
	prev := sum(t, `{"role":"user","content":"hi"}`)
	for _, m := range []string{`["role","user"]`, `"hi"`, `{"role":"user"`, `{"role":"user"} x`, ``} {
		got, role, err := convkey.NewChainer().Message(prev, []byte(m), nil)
		assert.Error(t, err, "%q", m)
		assert.Equal(t, prev, got, "%q", m)
		assert.Empty(t, role)
	}
}

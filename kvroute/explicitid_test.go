package kvroute_test

import (
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// otherPrompt is a system prompt longer than anything a first turn of
// systemPrompt leaves in D's blocks, and different from its first token.
var otherPrompt = "Different instructions: you review pull requests for a payments service written in Rust. " +
	strings.Repeat("Check every error path, every lock and every allocation, and list what you would change before you approve. ", 4)

// explicitCase is one API and verification setting for the conversation-id
// attack: turn 1 of a conversation, then a different, longer prompt under
// the same conversation id.
type explicitCase struct {
	name   string
	path   string
	stream bool
	mode   kvroute.VerificationMode
	engine []kvroutetest.Option
	// first and attack are the bodies of the conversation's first turn
	// (reply appended by hear) and of the attack.
	first  func() []byte
	attack func() []byte
	text   func(t *testing.T, raw []byte, stream bool) string
}

func chatText(t *testing.T, raw []byte, stream bool) string {
	if stream {
		text, _ := parseStream(t, raw)
		return text
	}
	text, _ := parseBody(t, raw)
	return text
}

func explicitCases() []explicitCase {
	chat := func(system string, stream bool) func() []byte {
		return func() []byte {
			c := &conversation{path: kvroute.PathChatCompletions, stream: stream, maxTok: 16,
				messages: []message{{Role: "system", Content: system}, {Role: "user", Content: userText(1)}}}
			return c.body()
		}
	}
	completion := func(prompt string) func() []byte {
		return func() []byte {
			c := &conversation{path: kvroute.PathCompletions, maxTok: 16, prompt: prompt + "\nUser: " + userText(1) + "\nAssistant:"}
			return c.body()
		}
	}
	agent := func(path string, system string) func() []byte {
		return func() []byte {
			base := codexBase()
			if path == kvroute.PathMessages {
				base = claudeBase()
				base["system"] = []any{map[string]any{"type": "text", "text": system}}
			} else {
				base["instructions"] = system
			}
			delete(base, "prompt_cache_key")
			c := &agentConv{path: path, base: base}
			c.say(userText(1))
			return c.body()
		}
	}
	agentText := func(path string) func(*testing.T, []byte, bool) string {
		return func(t *testing.T, raw []byte, stream bool) string {
			s, _ := agentText(t, path, raw, stream)
			return s
		}
	}
	noRender := []kvroutetest.Option{kvroutetest.WithRenderRoutes(false)}
	var cases []explicitCase
	for _, stream := range []bool{false, true} {
		name := "chat"
		if stream {
			name += " stream"
		}
		cases = append(cases, explicitCase{name: name, path: kvroute.PathChatCompletions, stream: stream, mode: kvroute.VerifyContent,
			first: chat(systemPrompt, stream), attack: chat(otherPrompt, stream), text: chatText})
	}
	cases = append(cases,
		explicitCase{name: "completions", path: kvroute.PathCompletions, mode: kvroute.VerifyContent,
			first: completion(systemPrompt), attack: completion(otherPrompt), text: chatText},
		explicitCase{name: "responses", path: kvroute.PathResponses, mode: kvroute.VerifyContent,
			first: agent(kvroute.PathResponses, systemPrompt), attack: agent(kvroute.PathResponses, otherPrompt), text: agentText(kvroute.PathResponses)},
		explicitCase{name: "messages", path: kvroute.PathMessages, mode: kvroute.VerifyContent,
			first: agent(kvroute.PathMessages, systemPrompt), attack: agent(kvroute.PathMessages, otherPrompt), text: agentText(kvroute.PathMessages)},
		// Token verification that falls back to content rules: engines
		// without the render routes (and /tokenize cannot render tools).
		explicitCase{name: "chat tokens without renderer", path: kvroute.PathChatCompletions, mode: kvroute.VerifyTokens, engine: noRender,
			first: withMember(chat(systemPrompt, false), "tool_choice", "none"), attack: withMember(chat(otherPrompt, false), "tool_choice", "none"), text: chatText},
		explicitCase{name: "responses tokens without renderer", path: kvroute.PathResponses, mode: kvroute.VerifyTokens, engine: noRender,
			first: agent(kvroute.PathResponses, systemPrompt), attack: agent(kvroute.PathResponses, otherPrompt), text: agentText(kvroute.PathResponses)},
	)
	return cases
}

// withMember adds a member to the body body gives.
func withMember(body func() []byte, key string, v any) func() []byte {
	return func() []byte {
		b := body()
		return append(append(b[:len(b)-1:len(b)-1], []byte(`,"`+key+`":`+mustJSON(v))...), '}')
	}
}

// Issue 21.2: with ExplicitID (the proxy's --key-mode conversation-id), a
// client that sends a different, longer prompt under an old conversation
// id must not get the old KV attached: the prefill engine would pull it as
// the prefix of the new prompt, answer wrongly, and cache the wrong blocks
// under the new prompt's token hashes, where any tenant sending that
// prompt reads them. Every answer must be the single engine's, and no
// engine may see a poisoned prefix-cache hit.
func TestConversationIDCannotPoison(t *testing.T) {
	for _, tc := range explicitCases() {
		t.Run(tc.name, func(t *testing.T) {
			c := kvroutetest.NewCluster(t, 1, 1, append([]kvroutetest.Option{kvroutetest.WithStreamHandles(true)}, tc.engine...)...)
			obs := &kvroutetest.Records{}
			r := newRouter(t, c, kvroute.WithIdentifier(kvroute.ContinuationKeys{ByConversationID: true}), kvroute.WithVerification(kvroute.Verification{Mode: tc.mode}), kvroute.WithObserver(obs))
			url := serve(t, r)
			tenantA := http.Header{"Authorization": {"Bearer key-a"}, "X-Session-Id": {"c1"}}
			tenantB := http.Header{"Authorization": {"Bearer key-b"}}
			turn := func(body []byte, h http.Header) {
				t.Helper()
				res := send(t, url, tc.path, body, h)
				require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
				ref, err := kvroutetest.Reference(tc.path, body)
				require.NoError(t, err)
				assert.Equal(t, ref.Text, tc.text(t, res.raw, tc.stream), "the answer differs from a single engine's")
			}
			turn(tc.first(), tenantA)
			t.Logf("turn 1: stored %v %s", obs.Last().Stored, obs.Last().StoreRefusal)
			turn(tc.attack(), tenantA)
			assert.NotEqual(t, kvroute.ReuseHit, obs.Last().Reuse, "a prompt that does not continue the conversation got its KV")
			turn(tc.attack(), tenantB)
			for _, e := range append(c.Prefill, c.Decode...) {
				st := e.Stats()
				assert.Zero(t, st.PoisonedHits, "poisoned prefix-cache hits")
				assert.Zero(t, st.WrongOutputs, "wrong outputs")
			}
		})
	}
}

// ExplicitID verifies by content: a conversation that resends its history
// under its id still reuses it (content mode, every API with content
// rules).
func TestConversationIDStillReuses(t *testing.T) {
	for _, stream := range []bool{false, true} {
		c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true))
		g := newRig(t, c, stream, kvroute.WithIdentifier(kvroute.ContinuationKeys{ByConversationID: true}), kvroute.WithVerification(kvroute.Verification{Mode: kvroute.VerifyContent}))
		g.conv.extra = map[string]any{"conversation_id": "c1"}
		for i := range 4 {
			g.turn(i, false)
			if i > 0 {
				assert.Equal(t, kvroute.ReuseHit, g.obs.Last().Reuse, "turn %d: %s", i, g.obs.Last().MissReason)
			}
		}
		g.finish()
	}
}

package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// --session-affinity: an agent's new conversations (first turns: no handle
// to attach) of one session, named only by its session header (Claude
// Code's x-claude-code-session-id, Codex's session_id), go to one prefill
// and one decode engine, where the engines' prefix caches hold what the
// session sent before; sessions spread over the engines. Without the flag
// the same turns spread by load. Every answer is a single engine's, and a
// session id finds no handle: each first turn is a miss.
func TestSessionAffinityFlag(t *testing.T) {
	for _, tc := range []struct {
		name   string
		args   []string
		header string
		pinned bool
	}{
		{"claude code", []string{"--session-affinity"}, "x-claude-code-session-id", true},
		{"codex", []string{"--session-affinity"}, "session_id", true},
		{"headers listed", []string{"--session-affinity", "--session-headers", "x-my-session"}, "x-my-session", true},
		{"headers none", []string{"--session-affinity", "--session-headers", "none"}, "x-claude-code-session-id", false},
		{"off", nil, "x-claude-code-session-id", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cl := kvroutetest.NewCluster(t, 2, 2)
			args := []string{"--prefill", cl.Prefill[0].URL(), cl.Prefill[1].URL(), "--decode", cl.Decode[0].URL(), cl.Decode[1].URL()}
			p := startInProcess(t, nil, append(args, tc.args...)...)
			// served is the prefill and the decode engine whose legs carry
			// the turn's request id (the proxy suffixes it per leg).
			served := func(id string) [2]int {
				where := [2]int{-1, -1}
				for i := range 2 {
					for _, r := range cl.Prefill[i].Requests() {
						if strings.HasPrefix(r.Header.Get("X-Request-Id"), id+"-") {
							where[0] = i
						}
					}
					for _, r := range cl.Decode[i].Requests() {
						if strings.HasPrefix(r.Header.Get("X-Request-Id"), id+"-") {
							where[1] = i
						}
					}
				}
				return where
			}
			sessions := map[string][2]int{} // the engines each session's turns went to
			for s := range 6 {
				session := fmt.Sprintf("0f8e%04d-session", s)
				for c := range 4 { // new conversations of the session: first turns, misses
					body, err := json.Marshal(map[string]any{"model": kvroutetest.DefaultModel, "max_tokens": 8,
						"messages": []map[string]any{{"role": "system", "content": "You are a coding agent."},
							{"role": "user", "content": fmt.Sprintf("Session %d, task %d: fix the failing test.", s, c)}}})
					require.NoError(t, err)
					status, h, got := p.do(t, http.MethodPost, "/v1/chat/completions", string(body), tc.header, session)
					require.Equal(t, http.StatusOK, status, got)
					assert.Equal(t, "miss", h.Get("X-Bidikv-Reuse"), "a session id finds no handle")
					var ans struct {
						Choices []struct {
							Message struct{ Content string } `json:"message"`
						} `json:"choices"`
					}
					require.NoError(t, json.Unmarshal([]byte(got), &ans))
					want, err := kvroutetest.Reference("/v1/chat/completions", body)
					require.NoError(t, err)
					assert.Equal(t, want.Text, ans.Choices[0].Message.Content)
					where := served(h.Get("X-Request-Id"))
					require.NotContains(t, where, -1, "both legs found by the turn's request id")
					if c == 0 {
						sessions[session] = where
					} else if tc.pinned {
						assert.Equal(t, sessions[session], where, "session %s, conversation %d: the session's engines", session, c)
					}
					if where != sessions[session] {
						sessions[session] = [2]int{-2, -2} // moved
					}
				}
			}
			moved, places := 0, map[[2]int]bool{}
			for _, w := range sessions {
				if w[0] == -2 {
					moved++
				}
				places[w] = true
			}
			if tc.pinned {
				assert.Zero(t, moved)
				assert.Greater(t, len(places), 1, "sessions spread over the engines: %v", sessions)
			} else {
				assert.Positive(t, moved, "without affinity, a session's turns spread by load")
			}
		})
	}
}

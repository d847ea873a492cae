package sim_test

import (
	"fmt"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
)

// With drift the sampler emits a word as two tokens whose text re-tokenizes
// to one; Reference reproduces it, and the next turn's prompt tokenizes
// differently from D's blocks at that point.
func TestDrift(t *testing.T) {
	tests := []struct {
		name      string
		rate      float64
		reasoning bool
		drifted   int // replies out of 20 that must drift
	}{
		{"always", 1, false, 20},
		{"always with reasoning", 1, true, 20},
		{"never", 0, false, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reg := sim.NewRegistry()
			mod := func(c *sim.Config) { c.DriftRate, c.Reasoning = tt.rate, tt.reasoning }
			p := start(t, reg, nil, mod)
			d := start(t, reg, nil, mod)
			cfg := d.Config()
			drifted := 0
			for i := 0; i < 20; i++ {
				q := fmt.Sprintf("drift question %d", i)
				body := chat(msg{"user", q})
				rp := post(t, p.url, sim.PathChat, with(body, "max_tokens", 1, "kv_transfer_params", missHandle()))
				require.Equal(t, http.StatusOK, rp.Status)
				status, b := postRaw(t, d.url, sim.PathChat, with(body, "kv_transfer_params", rp.KV, "return_token_ids", true))
				require.Equal(t, http.StatusOK, status, string(b))
				ids := parseIDs(t, sim.PathChat, b)
				raw := chatReply(t, b)
				content := str(t, raw["content"])

				req := mustParse(t, cfg, body)
				ref := sim.Reference("sim-model", tokIDs(req.Prompt), cfg.GenParams(req, 0))
				require.Equal(t, tokIDs(ref.Tokens), ids.gen, "Reference reproduces the drift")

				// the content tokens as generated vs as the text re-tokenizes
				gen := ids.gen[len(ids.gen)-len(contentTokens(ref)):]
				gen = gen[:len(gen)-1] // EOS
				if equalIDs(tokIDs(sim.Tokenize(content)), gen) {
					continue
				}
				drifted++
				next := renderWith(t, cfg, chat(msg{"user", q}, msg{"assistant", content}, msg{"user", "more"}))
				dSeq := append(append([]uint32(nil), ids.prompt...), ids.gen[:len(ids.gen)-1]...)
				assert.False(t, isPrefix(dSeq, tokIDs(next)), "the re-tokenized reply diverges from D's blocks")
				assert.True(t, isPrefix(ids.prompt, tokIDs(next)))
			}
			assert.Equal(t, tt.drifted, drifted)
			assert.Zero(t, d.Stats().WrongOutputs)
		})
	}
}

// contentTokens returns ref's tokens after the think block (the content
// tokens and EOS).
func contentTokens(ref sim.Generated) []sim.Token {
	for i, tk := range ref.Tokens {
		if tk.Text == "</think>" {
			return ref.Tokens[i+2:]
		}
	}
	return ref.Tokens
}

func equalIDs(a, b []uint32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// A split word's halves are two tokens whose joined text is one token.
func TestDriftSplit(t *testing.T) {
	cfg := cfgWith(func(c *sim.Config) { c.DriftRate = 1 })
	req := mustParse(t, cfg, chat(msg{"user", "split me"}))
	g := sim.Reference("sim-model", tokIDs(req.Prompt), cfg.GenParams(req, 0))
	found := false
	for i := 0; i+1 < len(g.Tokens); i++ {
		joinedText := g.Tokens[i].Text + g.Tokens[i+1].Text
		if re := sim.Tokenize(joinedText); len(re) == 1 && g.Tokens[i+1].Text != "" {
			found = true
			assert.Len(t, sim.Tokenize(g.Tokens[i].Text), 1)
			assert.NotEqual(t, re[0].ID, g.Tokens[i].ID)
		}
	}
	assert.True(t, found, "one word is split: %q", g.Content)
	_, err := sim.New(cfgWith(func(c *sim.Config) { c.DriftRate = 1.5 }))
	assert.ErrorIs(t, err, sim.ErrInvalidConfig)
}

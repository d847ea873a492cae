package sim_test

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
)

const hiMsgs = `"messages":[{"role":"user","content":"hi"}]`

// Request bodies are read as vLLM's pydantic models read them.
func TestParseLikePydantic(t *testing.T) {
	tests := []struct {
		name  string
		path  string
		body  string
		check func(t *testing.T, r *sim.Request)
	}{
		{"keys are case-sensitive", sim.PathChat, `{` + hiMsgs + `,"Stream":true,"MAX_TOKENS":3,"Return_Token_Ids":true}`, func(t *testing.T, r *sim.Request) {
			assert.False(t, r.Stream)
			assert.Zero(t, r.MaxTokens)
			assert.False(t, r.ReturnTokenIDs)
		}},
		{"unknown keys are ignored", sim.PathChat, `{` + hiMsgs + `,"frobnicate":{"x":[1]},"conversation_id":"c"}`, func(t *testing.T, r *sim.Request) {
			assert.Equal(t, 1, r.N)
		}},
		{"last duplicate wins", sim.PathChat, `{` + hiMsgs + `,"stream":true,"max_tokens":2,"stream":false,"max_tokens":9}`, func(t *testing.T, r *sim.Request) {
			assert.False(t, r.Stream)
			assert.Equal(t, 9, r.MaxTokens)
		}},
		{"last duplicate wins in messages", sim.PathChat, `{"messages":[{"role":"user","content":"a","content":"hi"}]}`, func(t *testing.T, r *sim.Request) {
			want, err := sim.ParseRequest(sim.PathChat, []byte(`{`+hiMsgs+`}`))
			require.NoError(t, err)
			assert.Equal(t, want.Prompt, r.Prompt)
		}},
		{"message keys are case-sensitive", sim.PathChat, `{"messages":[{"role":"user","content":"hi","Content":"other"}]}`, func(t *testing.T, r *sim.Request) {
			want, err := sim.ParseRequest(sim.PathChat, []byte(`{`+hiMsgs+`}`))
			require.NoError(t, err)
			assert.Equal(t, want.Prompt, r.Prompt)
		}},
		{"string bools", sim.PathChat, `{` + hiMsgs + `,"stream":"yes","ignore_eos":"On","return_token_ids":"T"}`, func(t *testing.T, r *sim.Request) {
			assert.True(t, r.Stream)
			assert.True(t, r.IgnoreEOS)
			assert.True(t, r.ReturnTokenIDs)
		}},
		{"string bools false", sim.PathChat, `{` + hiMsgs + `,"stream":"OFF","ignore_eos":"n","return_token_ids":"False"}`, func(t *testing.T, r *sim.Request) {
			assert.False(t, r.Stream)
			assert.False(t, r.IgnoreEOS)
			assert.False(t, r.ReturnTokenIDs)
		}},
		{"number bools", sim.PathChat, `{` + hiMsgs + `,"stream":1,"ignore_eos":1.0,"return_token_ids":0}`, func(t *testing.T, r *sim.Request) {
			assert.True(t, r.Stream)
			assert.True(t, r.IgnoreEOS)
			assert.False(t, r.ReturnTokenIDs)
		}},
		{"nullable bool null", sim.PathChat, `{` + hiMsgs + `,"stream":null,"return_token_ids":null}`, func(t *testing.T, r *sim.Request) {
			assert.False(t, r.Stream)
		}},
		{"lax ints", sim.PathChat, `{` + hiMsgs + `,"max_tokens":"5","n":2.0,"min_tokens":"3"}`, func(t *testing.T, r *sim.Request) {
			assert.Equal(t, 5, r.MaxTokens)
			assert.Equal(t, 2, r.N)
			assert.Equal(t, 3, r.MinTokens)
		}},
		{"int strings with decimal zeros and spaces", sim.PathCompletions, `{"prompt":"x","max_tokens":" 7 ","n":"1.00"}`, func(t *testing.T, r *sim.Request) {
			assert.Equal(t, 7, r.MaxTokens)
			assert.Equal(t, 1, r.N)
		}},
		{"max_completion_tokens wins", sim.PathChat, `{` + hiMsgs + `,"max_tokens":5,"max_completion_tokens":"4"}`, func(t *testing.T, r *sim.Request) {
			assert.Equal(t, 4, r.MaxTokens)
		}},
		{"nullable ints null", sim.PathChat, `{` + hiMsgs + `,"max_tokens":null,"n":null}`, func(t *testing.T, r *sim.Request) {
			assert.Zero(t, r.MaxTokens)
			assert.Equal(t, 1, r.N)
		}},
		{"stream_options lax", sim.PathChat, `{` + hiMsgs + `,"stream":"true","stream_options":{"include_usage":"1"}}`, func(t *testing.T, r *sim.Request) {
			assert.True(t, r.IncludeUsage)
		}},
		{"body request_id", sim.PathCompletions, `{"prompt":"x","request_id":"abc"}`, func(t *testing.T, r *sim.Request) {
			assert.Equal(t, "abc", r.BodyRequestID)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := sim.ParseRequest(tt.path, []byte(tt.body))
			require.NoError(t, err)
			tt.check(t, r)
		})
	}
}

func TestParseLikePydanticRejects(t *testing.T) {
	tests := map[string]string{
		"fractional max_tokens":   `{` + hiMsgs + `,"max_tokens":5.5}`,
		"fractional string":       `{` + hiMsgs + `,"max_tokens":"5.5"}`,
		"word for int":            `{` + hiMsgs + `,"n":"two"}`,
		"bool word":               `{` + hiMsgs + `,"stream":"maybe"}`,
		"bool number":             `{` + hiMsgs + `,"stream":2}`,
		"bool list":               `{` + hiMsgs + `,"ignore_eos":[]}`,
		"null for plain bool":     `{` + hiMsgs + `,"ignore_eos":null}`,
		"null for plain int":      `{` + hiMsgs + `,"min_tokens":null}`,
		"null add_gen_prompt":     `{` + hiMsgs + `,"add_generation_prompt":null}`,
		"echo word":               `{"prompt":"x","echo":"sure"}`,
		"continue_final_message":  `{` + hiMsgs + `,"continue_final_message":"x"}`,
		"add_special_tokens":      `{` + hiMsgs + `,"add_special_tokens":3}`,
		"number model":            `{` + hiMsgs + `,"model":5}`,
		"number role":             `{"messages":[{"role":1,"content":"hi"}]}`,
		"not an object":           `[1]`,
		"null body":               `null`,
		"max_tokens zero":         `{` + hiMsgs + `,"max_tokens":"0"}`,
		"stream_options unstream": `{"prompt":"x","stream":"0","stream_options":{}}`,
	}
	for name, body := range tests {
		t.Run(name, func(t *testing.T) {
			path := sim.PathChat
			var m map[string]json.RawMessage
			if json.Unmarshal([]byte(body), &m) == nil && m["prompt"] != nil {
				path = sim.PathCompletions
			}
			_, err := sim.ParseRequest(path, []byte(body))
			assert.Error(t, err)
		})
	}
}

// Lax values shape the prompt as their strict equivalents do.
func TestLaxTemplateFlags(t *testing.T) {
	tests := []struct{ lax, strict string }{
		{`"add_generation_prompt":"no"`, `"add_generation_prompt":false`},
		{`"add_special_tokens":"Y"`, `"add_special_tokens":true`},
		{`"continue_final_message":1,"add_generation_prompt":0`, `"continue_final_message":true,"add_generation_prompt":false`},
	}
	for _, tt := range tests {
		t.Run(tt.lax, func(t *testing.T) {
			a, err := sim.ParseRequest(sim.PathChat, []byte(`{`+hiMsgs+`,`+tt.lax+`}`))
			require.NoError(t, err)
			b, err := sim.ParseRequest(sim.PathChat, []byte(`{`+hiMsgs+`,`+tt.strict+`}`))
			require.NoError(t, err)
			assert.Equal(t, b.Prompt, a.Prompt)
			c, err := sim.ParseRequest(sim.PathChat, []byte(`{`+hiMsgs+`}`))
			require.NoError(t, err)
			assert.NotEqual(t, c.Prompt, a.Prompt)
		})
	}
}

package sim_test

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"regexp"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
)

func fingerprintMode(mode string) func(*sim.Config) {
	return func(c *sim.Config) { c.Fingerprint = mode }
}

// fpOf returns the system_fingerprint of a JSON object and whether the key
// is there.
func fpOf(t *testing.T, b []byte) (json.RawMessage, bool) {
	t.Helper()
	var m map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(b, &m), string(b))
	v, ok := m["system_fingerprint"]
	return v, ok
}

func streamPath(t *testing.T, url, path string, body any) sse {
	t.Helper()
	raw, _ := json.Marshal(body)
	resp, err := http.Post(url+path, "application/json", bytes.NewReader(raw))
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	return readSSE(t, resp.Body)
}

// isFinish reports whether a chunk carries a finish_reason.
func isFinish(t *testing.T, ev string) bool {
	var c struct {
		Choices []struct {
			FinishReason *string `json:"finish_reason"`
		} `json:"choices"`
	}
	require.NoError(t, json.Unmarshal([]byte(ev), &c))
	return len(c.Choices) > 0 && c.Choices[0].FinishReason != nil
}

var fullFP = regexp.MustCompile(`^"vllm-0\.0\.0\+sim-[0-9a-f]{8}"$`)

// vLLM's default: the fingerprint on every response and on the final
// message of a stream (the finish chunks, or the usage chunk after them).
func TestSystemFingerprintFull(t *testing.T) {
	e := start(t, nil, nil, fingerprintMode(sim.FingerprintFull))
	bodies := map[string]map[string]any{
		sim.PathChat:        chat(msg{"user", "fingerprint"}),
		sim.PathCompletions: {"model": "sim-model", "prompt": "fingerprint"},
	}
	var want json.RawMessage
	for path, body := range bodies {
		r := post(t, e.url, path, body)
		require.Equal(t, http.StatusOK, r.Status)
		fp, ok := fpOf(t, r.Body)
		require.True(t, ok, path)
		assert.Regexp(t, fullFP, string(fp))
		if want == nil {
			want = fp
		}
		assert.Equal(t, string(want), string(fp), "one fingerprint per server")

		s := streamPath(t, e.url, path, with(body, "stream", true, "n", 2))
		finishes := 0
		for _, ev := range s.events {
			got, ok := fpOf(t, []byte(ev))
			if isFinish(t, ev) {
				finishes++
				assert.True(t, ok, "finish chunk: %s", ev)
				assert.Equal(t, string(want), string(got))
			} else {
				assert.False(t, ok, "only terminal chunks: %s", ev)
			}
		}
		assert.Equal(t, 2, finishes, "one finish chunk per choice")

		s = streamPath(t, e.url, path, with(body, "stream", true, "stream_options", map[string]any{"include_usage": true}))
		last := s.events[len(s.events)-1]
		for _, ev := range s.events[:len(s.events)-1] {
			_, ok := fpOf(t, []byte(ev))
			assert.False(t, ok, "the usage chunk is the final message: %s", ev)
		}
		got, ok := fpOf(t, []byte(last))
		assert.True(t, ok, last)
		assert.Equal(t, string(want), string(got))
	}

	// Same configuration, same fingerprint; parallelism and the model show.
	other := start(t, nil, nil, fingerprintMode(sim.FingerprintFull))
	r := post(t, other.url, sim.PathChat, bodies[sim.PathChat])
	fp, _ := fpOf(t, r.Body)
	assert.Equal(t, string(want), string(fp))
	par := sim.DefaultConfig()
	par.Fingerprint, par.TPSize, par.DPSize = sim.FingerprintFull, 2, 4
	s, ok := par.SystemFingerprint()
	require.True(t, ok)
	assert.Regexp(t, `^vllm-0\.0\.0\+sim-tp2-dp4-[0-9a-f]{8}$`, *s)
	par.Fingerprint = sim.FingerprintHash
	h, _ := par.SystemFingerprint()
	assert.Regexp(t, `^vllm-0\.0\.0\+sim-[0-9a-f]{8}$`, *h)
	par.Model = "other-model"
	h2, _ := par.SystemFingerprint()
	assert.NotEqual(t, *h, *h2, "the hash covers the model")
}

func TestSystemFingerprintModes(t *testing.T) {
	tests := []struct {
		mode, value string
		want        string // JSON value on responses; "" when the key is absent
		chunks      bool   // stamped on the final chunk
	}{
		{sim.FingerprintAbsent, "", "", false},
		{"", "", "", false},
		{sim.FingerprintNone, "", "null", false},
		{sim.FingerprintCustom, "fp-abc", `"fp-abc"`, true},
		{sim.FingerprintCustom, "", "null", false},
	}
	for _, tt := range tests {
		t.Run(tt.mode+"/"+tt.value, func(t *testing.T) {
			e := start(t, nil, nil, func(c *sim.Config) { c.Fingerprint, c.FingerprintValue = tt.mode, tt.value })
			for _, path := range []string{sim.PathChat, sim.PathCompletions} {
				body := chat(msg{"user", "modes"})
				if path == sim.PathCompletions {
					body = map[string]any{"model": "sim-model", "prompt": "modes"}
				}
				r := post(t, e.url, path, body)
				require.Equal(t, http.StatusOK, r.Status)
				fp, ok := fpOf(t, r.Body)
				assert.Equal(t, tt.want != "", ok, path)
				if ok {
					assert.Equal(t, tt.want, string(fp))
				}
				for _, opts := range []map[string]any{{"include_usage": false}, {"include_usage": true}} {
					s := streamPath(t, e.url, path, with(body, "stream", true, "stream_options", opts))
					stamped := 0
					for _, ev := range s.events {
						if got, ok := fpOf(t, []byte(ev)); ok {
							stamped++
							assert.Equal(t, tt.want, string(got))
						}
					}
					assert.Equal(t, b2i(tt.chunks), stamped, "%s %v", path, opts)
				}
			}
		})
	}
	cfg := sim.DefaultConfig()
	cfg.Fingerprint = "bogus"
	_, err := sim.New(cfg)
	assert.ErrorIs(t, err, sim.ErrInvalidConfig)
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// The default engine writes no system_fingerprint key at all (the output of
// earlier versions of the simulator, byte for byte in that respect).
func TestSystemFingerprintAbsentByDefault(t *testing.T) {
	e := start(t, nil, nil, nil)
	r := post(t, e.url, sim.PathChat, chat(msg{"user", "hi"}))
	assert.NotContains(t, string(r.Body), "system_fingerprint")
	resp, err := http.Post(e.url+sim.PathChat, "application/json",
		bytes.NewReader([]byte(`{"messages":[{"role":"user","content":"hi"}],"stream":true}`)))
	require.NoError(t, err)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	assert.NotContains(t, string(b), "system_fingerprint")
}

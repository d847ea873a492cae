package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/toytok"
	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// TestCannedThroughRouter runs a four-turn conversation through a router
// over the canned engines, in both verification modes: every turn after the
// first is a hit, in token mode verified over the handle's whole sequence
// from a render.
func TestCannedThroughRouter(t *testing.T) {
	for _, mode := range []kvroute.VerificationMode{kvroute.VerifyContent, kvroute.VerifyTokens} {
		t.Run(string(mode), func(t *testing.T) {
			p, err := cannedHandler("prefill", "sim-model", cannedKV{16, 1, 0})
			require.NoError(t, err)
			d, err := cannedHandler("decode", "sim-model", cannedKV{16, 1, 0})
			require.NoError(t, err)
			ps, ds := httptest.NewServer(p), httptest.NewServer(d)
			defer ps.Close()
			defer ds.Close()
			obs := &kvroutetest.Records{}
			r, err := kvroute.New(kvroute.WithPrefill(ps.URL), kvroute.WithDecode(ds.URL), kvroute.WithVerification(kvroute.Verification{Mode: mode}),
				kvroute.WithObserver(obs))
			require.NoError(t, err)
			defer r.Close()
			msgs := []map[string]string{{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": strings.Repeat("Fix the build, please. ", 100)}}
			for turn := range 4 {
				body, _ := json.Marshal(map[string]any{"model": "sim-model", "messages": msgs, "stream": true})
				resp, err := r.Do(context.Background(), &kvroute.Request{Path: kvroute.PathChatCompletions, Header: http.Header{}, Body: body})
				require.NoError(t, err)
				_, err = resp.WriteTo(io.Discard)
				require.NoError(t, err)
				require.NoError(t, resp.Close())
				rec := obs.Last()
				require.NoError(t, rec.Err)
				assert.True(t, rec.Stored, "turn %d retained (%s)", turn, rec.StoreRefusal)
				if turn > 0 {
					assert.Equal(t, kvroute.ReuseHit, rec.Reuse, "turn %d: %s", turn, rec.MissReason)
					assert.Equal(t, mode, rec.Verification)
					if mode == kvroute.VerifyTokens {
						assert.Equal(t, kvroute.TokensFromRender, rec.TokenSource)
						assert.Equal(t, rec.HandleTokens, rec.VerifiedTokens)
						assert.False(t, rec.Partial)
					}
				}
				msgs = append(msgs, map[string]string{"role": "assistant", "content": cannedReply}, map[string]string{"role": "user", "content": "Now the next step."})
			}
		})
	}
}

func TestCannedRole(t *testing.T) {
	_, err := cannedHandler("both", "m", cannedKV{16, 1, 0})
	assert.Error(t, err)
	_, err = parseFlags([]string{"--canned", "both"}, io.Discard)
	assert.Error(t, err)
	o, err := parseFlags([]string{"--canned", "decode"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, "decode", o.canned)
}

// The canned engines' handles are the size vLLM's are: one block id per
// block of the prompt (P) or of the prompt and the reply but its last
// token (D), in each KV group, at the configured block size.
func TestCannedHandleSizes(t *testing.T) {
	msgs := []toytok.Message{{Role: "system", Content: "You are a coding agent."}, {Role: "user", Content: strings.Repeat("Fix the build, please. ", 400)}}
	prompt := len(toytok.Chat(msgs))
	held := prompt + len(toytok.Reply(cannedReply)) - 1
	for _, kv := range []cannedKV{{16, 1, 0}, {64, 2, 0}} {
		for _, c := range []struct {
			role   string
			extra  string
			tokens int
		}{{"prefill", "", prompt}, {"decode", "", held}, {"decode", `,"return_token_ids":true`, held}} {
			h, err := cannedHandler(c.role, "m", kv)
			require.NoError(t, err)
			mb, _ := json.Marshal(msgs)
			body := `{"model":"m","messages":` + string(mb) + `,"stream":true` + c.extra + `}`
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body)))
			require.Equal(t, http.StatusOK, rec.Code, rec.Body.String())
			out := rec.Body.String()
			i := strings.LastIndex(out, `"kv_transfer_params":`)
			require.Positive(t, i)
			var wrap struct {
				KV struct {
					Blocks [][]int `json:"remote_block_ids"`
					Tokens int     `json:"remote_num_tokens"`
				} `json:"kv_transfer_params"`
			}
			dec := json.NewDecoder(strings.NewReader("{" + out[i:]))
			require.NoError(t, dec.Decode(&wrap))
			assert.Equal(t, c.tokens, wrap.KV.Tokens, "%s %+v", c.role, kv)
			require.Len(t, wrap.KV.Blocks, kv.groups)
			for _, g := range wrap.KV.Blocks {
				assert.Len(t, g, (c.tokens+kv.blockSize-1)/kv.blockSize, "%s %+v", c.role, kv)
			}
		}
	}
}

// TestCannedPoolBlocks: a canned engine reports a pool of 100,000 blocks
// as num_gpu_blocks, or --num-gpu-blocks-override when it is larger (a
// router over it then holds more handles before releasing some for room);
// a smaller pool than its handles' ids is refused.
func TestCannedPoolBlocks(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--canned", "decode"}, `num_gpu_blocks="100000"`},
		{[]string{"--canned", "decode", "--num-gpu-blocks-override", "2000000"}, `num_gpu_blocks="2000000"`},
	} {
		o, err := parseFlags(tc.args, io.Discard)
		require.NoError(t, err)
		h, err := cannedHandler(o.canned, "m", cannedKV{16, 1, o.cannedBlocks})
		require.NoError(t, err)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/metrics", nil))
		assert.Contains(t, w.Body.String(), tc.want, "%v", tc.args)
	}
	_, err := parseFlags([]string{"--canned", "prefill", "--num-gpu-blocks-override", "5000"}, io.Discard)
	assert.ErrorContains(t, err, "at least 100000")
}

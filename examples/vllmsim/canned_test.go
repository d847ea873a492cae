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

	"github.com/bidikv/bidikv/kvroute"
)

// TestCannedThroughRouter runs a four-turn conversation through a router
// over the canned engines, in both verification modes: every turn after the
// first is a hit, in token mode verified over the handle's whole sequence
// from a render.
func TestCannedThroughRouter(t *testing.T) {
	for _, mode := range []kvroute.VerificationMode{kvroute.VerifyContent, kvroute.VerifyTokens} {
		t.Run(string(mode), func(t *testing.T) {
			p, err := cannedHandler("prefill", "sim-model")
			require.NoError(t, err)
			d, err := cannedHandler("decode", "sim-model")
			require.NoError(t, err)
			ps, ds := httptest.NewServer(p), httptest.NewServer(d)
			defer ps.Close()
			defer ds.Close()
			var rec kvroute.TurnRecord
			r, err := kvroute.New(kvroute.WithPrefill(ps.URL), kvroute.WithDecode(ds.URL), kvroute.WithVerification(kvroute.Verification{Mode: mode}),
				kvroute.WithObserver(kvroute.ObserverFunc(func(tr *kvroute.TurnRecord) { rec = *tr })))
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
	_, err := cannedHandler("both", "m")
	assert.Error(t, err)
	_, err = parseFlags([]string{"--canned", "both"}, io.Discard)
	assert.Error(t, err)
	o, err := parseFlags([]string{"--canned", "decode"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, "decode", o.canned)
}

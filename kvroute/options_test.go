package kvroute_test

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// The grouped options (options_*.go): a zero field keeps its default, a
// negative one turns a bound off where it can be off and is refused where
// it cannot, a later option of a group replaces the earlier one, and every
// problem is reported at once, naming the option and the field.
func TestGroupedOptions(t *testing.T) {
	base := []kvroute.Option{kvroute.WithPrefill("127.0.0.1:1"), kvroute.WithDecode("127.0.0.1:2")}
	accepted := []kvroute.Option{
		kvroute.WithTimeouts(kvroute.Timeouts{Prefill: -1, FirstByte: -1, Idle: -1}),               // no limits
		kvroute.WithHealth(kvroute.Health{EjectAfter: -1, RestartCheck: -1}),                       // off
		kvroute.WithVerification(kvroute.Verification{BlockSize: -1}),                              // no partial reads
		kvroute.WithTTLs(kvroute.TTLs{Retention: time.Minute}),                                     // the others default
		kvroute.WithFailover(kvroute.Failover{}), kvroute.WithDecodeMemory(kvroute.DecodeMemory{}), // the defaults
		kvroute.WithLimits(kvroute.Limits{Body: 1}), kvroute.WithLimits(kvroute.Limits{}), // the later one wins
	}
	for _, o := range accepted {
		r, err := kvroute.New(append(base, o)...)
		require.NoError(t, err)
		require.NoError(t, r.Close())
	}
	for _, tc := range []struct {
		opt    kvroute.Option
		option string
		fields []string
	}{
		{kvroute.WithTimeouts(kvroute.Timeouts{Render: -time.Second}), "WithTimeouts", []string{"Render"}},
		{kvroute.WithLimits(kvroute.Limits{Body: -1, Event: -1, Entry: -1, ObjectMembers: -1}), "WithLimits", []string{"Body", "Event", "Entry", "ObjectMembers"}},
		{kvroute.WithTTLs(kvroute.TTLs{Retention: 10 * time.Minute}), "WithTTLs", []string{"Retention"}},
		{kvroute.WithTTLs(kvroute.TTLs{PrefillLease: time.Second}), "WithTTLs", []string{"PrefillLease"}},
		{kvroute.WithFailover(kvroute.Failover{DecodeAttempts: -1}), "WithFailover", []string{"DecodeAttempts"}},
		{kvroute.WithHealth(kvroute.Health{EjectBackoff: time.Minute, MaxEjectBackoff: time.Second}), "WithHealth", []string{"MaxEjectBackoff"}},
		{kvroute.WithDecodeMemory(kvroute.DecodeMemory{KVBytesPerToken: -1}), "WithDecodeMemory", []string{"KVBytesPerToken"}},
		{kvroute.WithVerification(kvroute.Verification{Mode: "nonesuch"}), "WithVerification", []string{"Mode"}},
		{kvroute.WithEndpoints("nonesuch"), "WithEndpoints", []string{"phase"}},
	} {
		_, err := kvroute.New(append(base, tc.opt)...)
		require.Error(t, err, tc.option)
		assert.ErrorIs(t, err, kvroute.ErrInvalidConfig)
		for _, f := range append(tc.fields, tc.option) {
			assert.Contains(t, err.Error(), f)
		}
	}
	d := kvroute.Defaults()
	assert.Equal(t, 450*time.Second, d.TTLs.Retention)
	assert.Equal(t, int64(32<<20), d.Limits.Body)
	assert.Zero(t, d.Verification.BlockSize, "read from each engine")
	assert.Equal(t, kvroute.VerifyTokens, d.Verification.Mode)
}

// A grouped option's fields reach the turn: a body bound of 8 KiB, given
// alone, gets 413 above it while the other limits keep their defaults.
func TestGroupedOptionsApply(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1)
	url := serve(t, newRouter(t, c, kvroute.WithLimits(kvroute.Limits{Body: 8 << 10})))
	body := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("x", 9<<10) + `"}]}`
	res := send(t, url, kvroute.PathChatCompletions, []byte(body), nil)
	assert.Equal(t, http.StatusRequestEntityTooLarge, res.status)
	res = send(t, url, kvroute.PathChatCompletions, []byte(`{"model":"`+kvroutetest.DefaultModel+`","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}`), nil)
	assert.Equal(t, http.StatusOK, res.status, "%s", res.raw)
}

// Decode-local turns need a handle verified by tokens: with content
// verification WithDecodeMemory's Local would never do anything, so New
// refuses the pair, naming both options, in either order (issue 24, item
// 4).
func TestDecodeLocalNeedsTokens(t *testing.T) {
	base := []kvroute.Option{kvroute.WithPrefill("127.0.0.1:1"), kvroute.WithDecode("127.0.0.1:2")}
	local := kvroute.WithDecodeMemory(kvroute.DecodeMemory{Local: true})
	content := kvroute.WithVerification(kvroute.Verification{Mode: kvroute.VerifyContent})
	for _, opts := range [][]kvroute.Option{{local, content}, {content, local}} {
		_, err := kvroute.New(append(base, opts...)...)
		require.Error(t, err)
		assert.ErrorIs(t, err, kvroute.ErrInvalidConfig)
		for _, s := range []string{"WithDecodeMemory", "Local", "WithVerification", "VerifyTokens"} {
			assert.Contains(t, err.Error(), s)
		}
	}
	r, err := kvroute.New(append(base, local, kvroute.WithVerification(kvroute.Verification{Mode: kvroute.VerifyTokens}))...)
	require.NoError(t, err)
	require.NoError(t, r.Close())
}

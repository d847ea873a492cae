package main

import (
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/retention/redisstore"
)

// --redis-url picks the deployment by scheme and --redis-wait-replicas
// reaches the store; neither touches the network before the first turn.
func TestRedisFlags(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	for _, tc := range []struct {
		name string
		args []string
		want string // in the error; "" for a Redis store
	}{
		{"single", []string{"--redis-url", "redis://127.0.0.1:6379/0"}, ""},
		{"sentinel", []string{"--redis-url", "redis-sentinel://127.0.0.1:26379/0?master_name=bidikv&addr=127.0.0.1:26380", "--redis-wait-replicas", "1"}, ""},
		{"cluster", []string{"--redis-url", "redis-cluster://127.0.0.1:7000?addr=127.0.0.1:7001", "--redis-wait-replicas", "1"}, ""},
		{"sentinel without master", []string{"--redis-url", "redis-sentinel://127.0.0.1:26379"}, "--redis-url: redisstore: invalid configuration: NewFromURL: a Sentinel URL needs master_name=NAME"},
		{"wait without redis", []string{"--redis-wait-replicas", "1"}, "--redis-wait-replicas needs --redis-url"},
		{"negative wait", []string{"--redis-url", "redis://127.0.0.1:6379/0", "--redis-wait-replicas", "-1"}, "--redis-wait-replicas must not be negative"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := parseConfig(tc.args, noEnv, io.Discard)
			require.NoError(t, err)
			store, closeStore, err := newStore(cfg, log)
			if tc.want != "" {
				assert.ErrorIs(t, err, errUsage)
				assert.ErrorContains(t, err, tc.want)
				return
			}
			require.NoError(t, err)
			defer closeStore()
			assert.IsType(t, &redisstore.Store{}, store)
		})
	}
}

// With --redis-url and the decode memory managed, the ledger shares
// Redis's journal (--decode-memory-journal, on by default); not when the
// flag is false, the management off, or the store in memory.
func TestDecodeMemoryJournal(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	for _, tc := range []struct {
		args []string
		on   bool
	}{
		{[]string{"--redis-url", "redis://127.0.0.1:6379/0"}, true},
		{[]string{"--redis-url", "redis://127.0.0.1:6379/0", "--decode-memory-journal=false"}, false},
		{[]string{"--redis-url", "redis://127.0.0.1:6379/0", "--decode-memory-budget", "-1"}, false},
		{nil, false},
	} {
		cfg, err := parseConfig(tc.args, noEnv, io.Discard)
		require.NoError(t, err)
		store, closeStore, err := newStore(cfg, log)
		require.NoError(t, err)
		cfg.memory.shared = cfg.memory.journalOf(store)
		dm := cfg.decodeMemory()
		closeStore()
		if !tc.on {
			assert.Nil(t, dm.Journal, "%v", tc.args)
			continue
		}
		assert.IsType(t, &redisstore.Journal{}, dm.Journal, "%v", tc.args)
	}
}

// Two proxies on one Redis share the ledger through its journal, and
// /metrics shows it: a turn retained through A is appended by A and
// applied by B, both report a recent sync, and no sync failed.
func TestDecodeMemoryJournalMetrics(t *testing.T) {
	url := redisServer(t)
	cl := kvroutetest.NewCluster(t, 1, 1)
	args := []string{"--prefill", cl.Prefill[0].URL(), "--decode", cl.Decode[0].URL(), "--redis-url", url}
	a, b := startInProcess(t, nil, args...), startInProcess(t, nil, args...)
	body := plainChat(reuseSystem, "Turn 1: list the failing tests.")
	status, _, out := a.do(t, http.MethodPost, "/v1/chat/completions", body, "Content-Type", "application/json")
	require.Equal(t, http.StatusOK, status, out)
	num := func(p *inproc, sample string) float64 {
		v, err := strconv.ParseFloat(p.metric(t, sample), 64)
		if err != nil {
			return -1
		}
		return v
	}
	applied := `bidikv_decode_ledger_journal_records_total{outcome="applied"}`
	appended := `bidikv_decode_ledger_journal_records_total{outcome="appended"}`
	for i := 0; i < 100 && (num(b, applied) < 1 || num(a, appended) < 1); i++ {
		time.Sleep(50 * time.Millisecond) // the journal syncs every second
	}
	assert.GreaterOrEqual(t, num(a, appended), 1.0, "A sent its hold")
	assert.GreaterOrEqual(t, num(b, applied), 1.0, "B read it")
	assert.GreaterOrEqual(t, num(a, "bidikv_decode_ledger_journal_peers"), 0.0, "exported")
	for _, p := range []*inproc{a, b} {
		assert.Zero(t, num(p, "bidikv_decode_ledger_journal_errors_total"))
		synced := num(p, "bidikv_decode_ledger_journal_last_sync_timestamp_seconds")
		assert.InDelta(t, float64(time.Now().Unix()), synced, 30, "a recent sync")
	}
	// Without the journal, none of it is exported.
	c := startInProcess(t, nil, append(args, "--decode-memory-journal=false")...)
	assert.Equal(t, "absent", c.metric(t, "bidikv_decode_ledger_journal_errors_total"))
}

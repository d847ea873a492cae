package main

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/bidikv/bidikv/internal/turnfields"
	"github.com/bidikv/bidikv/kvroute"
)

// Every field of the turn record, today's and any added later with its
// tag, reaches /metrics (a family of its own or the field families) and
// the turn's log line: a record with every field set shows every key.
func TestTurnFieldsShown(t *testing.T) {
	rec := &kvroute.TurnRecord{}
	turnFields.SetAll(rec)
	keys := map[string]bool{}
	for _, f := range turnFields.Fields {
		keys[f.Key] = true
	}
	for k := range dedicated {
		assert.True(t, keys[k], "metrics.go's family for %q names no field of the record", k)
	}

	m := newMetrics()
	m.observe(rec)
	page := scrape(t, m)
	for _, f := range turnFields.Fields {
		if dedicated[f.Key] {
			continue
		}
		switch f.Kind {
		case turnfields.Flag:
			assert.Equal(t, "1", metricValue(page, `bidikv_turn_flags_total{field="`+f.Key+`"}`), f.Key)
		case turnfields.Enum:
			assert.Equal(t, "1", metricValue(page, `bidikv_turn_values_total{field="`+f.Key+`",value="x_`+f.Key+`"}`), f.Key)
		case turnfields.Count:
			assert.Equal(t, "7", metricValue(page, `bidikv_turn_counts_total{field="`+f.Key+`"}`), f.Key)
		case turnfields.Duration:
			assert.Equal(t, "1", metricValue(page, `bidikv_turn_field_seconds_count{field="`+f.Key+`"}`), f.Key)
		}
	}

	var buf bytes.Buffer
	logTurn(t.Context(), slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug})), rec)
	for _, f := range turnFields.Fields {
		assert.True(t, strings.Contains(buf.String(), " "+f.Key+"="), "log line lacks %q: %s", f.Key, buf.String())
	}
	assert.NotContains(t, buf.String(), "x_\n", "sanity")

	// A zero record counts nothing in the field families.
	m = newMetrics()
	m.observe(&kvroute.TurnRecord{Path: kvroute.PathChatCompletions, Reuse: kvroute.ReuseMiss})
	assert.NotContains(t, scrape(t, m), "bidikv_turn_flags_total{")
}

package main

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/bidikv/bidikv/internal/turnfields"
	"github.com/bidikv/bidikv/kvroute"
)

// dedicated is the turn-record keys that metrics.go shows in a family of
// their own; every other flag, enum, count and duration of the record is
// shown by the field families below, as its turn tag declares it.
var dedicated = map[string]bool{
	"reuse": true, "miss_reason": true, "handle_age": true, "reusable_tokens": true, "local_fallback": true,
	"prefill": true, "first_byte": true, "ttft": true, "total": true, "bytes": true, "stored": true,
	"store_refusal": true, "buffered": true, "missing": true, "phase": true, "estimated_ttft": true, "choice": true,
}

// fieldFamilies shows the record's other fields: flags counted when
// true, enums counted by value, counts summed, durations observed.
type fieldFamilies struct {
	flags     *prometheus.CounterVec   // field
	values    *prometheus.CounterVec   // field, value
	counts    *prometheus.CounterVec   // field
	durations *prometheus.HistogramVec // field
}

func newFieldFamilies(seconds []float64) *fieldFamilies {
	return &fieldFamilies{
		flags: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: namespace, Name: "turn_flags_total",
			Help: "Turns (that reached lookup) whose record had the flag set, by field (kvroute.TurnRecord's turn tags: stream, unconfirmed, partial, released, ...)."},
			[]string{"field"}),
		values: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: namespace, Name: "turn_values_total",
			Help: "Turns (that reached lookup) by the value of each enumerated record field not shown elsewhere (verification, token_source, no_handle, local_refusal, ...)."},
			[]string{"field", "value"}),
		counts: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: namespace, Name: "turn_counts_total",
			Help: "Sum over turns of each counted record field not shown elsewhere (prompt_tokens, verified_tokens, handle_tokens, cached_tokens, prefill_attempts, ...)."},
			[]string{"field"}),
		durations: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: namespace, Name: "turn_field_seconds",
			Help: "Each timed record field not shown elsewhere (render, ...), when not zero.", Buckets: seconds},
			[]string{"field"}),
	}
}

func (ff *fieldFamilies) collectors() []prometheus.Collector {
	return []prometheus.Collector{ff.flags, ff.values, ff.counts, ff.durations}
}

// observe shows rec's fields that have no family of their own.
func (ff *fieldFamilies) observe(rec *kvroute.TurnRecord) {
	turnFields.Each(rec, func(f *turnfields.Field, v turnfields.Value) {
		if dedicated[f.Key] || v.IsZero() {
			return
		}
		switch f.Kind {
		case turnfields.Flag:
			ff.flags.WithLabelValues(f.Key).Inc()
		case turnfields.Enum:
			ff.values.WithLabelValues(f.Key, labelShape(v.String())).Inc()
		case turnfields.Count:
			if n := v.Int(); n > 0 {
				ff.counts.WithLabelValues(f.Key).Add(float64(n))
			}
		case turnfields.Duration:
			ff.durations.WithLabelValues(f.Key).Observe(v.Duration().Seconds())
		}
	})
}

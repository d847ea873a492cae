package kvroutetest

import (
	"context"
	"sync/atomic"

	"github.com/bidikv/bidikv/kvroute"
)

// RoundRobin is a kvroute.Selector that rotates through the candidates of each
// phase and ignores load and affinity, as vLLM's reference proxy does. It
// is a baseline for measurements, not a recommendation.
type RoundRobin struct {
	prefill, decode atomic.Uint64
}

// Select implements kvroute.Selector.
func (r *RoundRobin) Select(_ context.Context, s *kvroute.Selection) (int, error) {
	n := &r.decode
	if s.Phase == kvroute.PhasePrefill {
		n = &r.prefill
	}
	return int((n.Add(1) - 1) % uint64(len(s.Candidates))), nil
}

var _ kvroute.Selector = (*RoundRobin)(nil)

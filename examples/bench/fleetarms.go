package main

import (
	"bytes"
	"io"
	"slices"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/retention/budget"
)

// The arms' router options. Hold everything is the router without
// decode memory management: every retained handle held on D for the TTL. Managed
// is the router's decode memory management (kvroute.DecodeMemory).

// defaultBudget is the managed arm's budget as a share of each decode
// engine's capacity: kvroute.DecodeMemory.Budget's default.
var defaultBudget = kvroute.Defaults().DecodeMemory.Budget

// decodeMemory is an arm's decode memory options, and the managed arm's
// ledger (nil for hold everything).
func decodeMemory(c fleetConfig, a armSpec) (kvroute.DecodeMemory, *budget.Budget, error) {
	m := kvroute.DecodeMemory{KVBytesPerToken: c.prof.KVBytesPerToken, Budget: -1}
	if !a.managed {
		return m, nil, nil
	}
	// The budget and the capacity as an operator gives them, in a ledger
	// of the bench's own (to settle on, and to report the gap model it
	// learned): startRig gives it to every replica (--ledger shared), or
	// makes one a replica (per-replica: each budgets its own holds
	// against whole engines).
	fraction := c.budget
	if a.holdFraction > 0 {
		fraction = a.holdFraction
	}
	ledger, err := budget.New(budget.WithFraction(fraction), budget.WithCapacity(int64(a.capacity)))
	if err != nil {
		return m, nil, err
	}
	m.Budget, m.Ledger, m.Headroom, m.Local = 0, ledger, c.headroom, a.local
	// No /metrics reads: the router makes them in the background on a
	// real-time ticker, beside the event clock, so what a read sees (and
	// which holds placement then avoids) would depend on the machine's
	// speed and the run would not repeat (--metrics turns them on).
	if !c.metrics {
		m.MetricsInterval = -1
	}
	// Every release request at once: a release waiting for a slot would
	// take its handle while no session waits for it.
	m.Releases = 1 << 20
	return m, ledger, nil
}

// budgetTokens is the managed arm's budget per decode engine of capacity
// tokens, in tokens.
func (c fleetConfig) budgetTokens(capacity int) int {
	return int(c.budget * float64(capacity))
}

func sortTurns(ts []fleetTurn) {
	slices.SortFunc(ts, func(a, b fleetTurn) int {
		if a.session != b.session {
			return a.session - b.session
		}
		return a.turn - b.turn
	})
}

func bytesReader(b []byte) io.Reader { return bytes.NewReader(b) }

// release is a count of the router's releases for one reason.
type release struct {
	reason string
	n      int64
}

// routerReleases are the routers' releases by reason, and their
// failures, summed over the replicas.
func routerReleases(ss []kvroute.Stats) []release {
	var s kvroute.Stats
	for _, r := range ss {
		s.ReleasedSuperseded += r.ReleasedSuperseded
		s.ReleasedUnusable += r.ReleasedUnusable
		s.ReleasedBudget += r.ReleasedBudget
		s.ReleasedRoom += r.ReleasedRoom
		s.ReleasedExpired += r.ReleasedExpired
		s.ReleasedNChoices += r.ReleasedNChoices
		s.ReleasedRefused += r.ReleasedRefused
		s.ReleasedStoreError += r.ReleasedStoreError
		s.ReleasedOverwritten += r.ReleasedOverwritten
		s.Unreleasable += r.Unreleasable
		s.ReleaseFailures += r.ReleaseFailures
		s.ReleaseSkipped += r.ReleaseSkipped
		s.ReleaseGone += r.ReleaseGone
	}
	var out []release
	for _, r := range []release{{"superseded", s.ReleasedSuperseded}, {"unusable", s.ReleasedUnusable},
		{"budget", s.ReleasedBudget}, {"room", s.ReleasedRoom}, {"expired", s.ReleasedExpired}, {"n_gt_1", s.ReleasedNChoices}, {"refused", s.ReleasedRefused},
		{"store_error", s.ReleasedStoreError}, {"overwritten", s.ReleasedOverwritten}, {"unreleasable", s.Unreleasable},
		{"failed", s.ReleaseFailures}, {"skipped", s.ReleaseSkipped}, {"gone", s.ReleaseGone}} {
		if r.n > 0 {
			out = append(out, r)
		}
	}
	return out
}

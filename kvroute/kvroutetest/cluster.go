package kvroutetest

import "testing"

// Cluster is a set of engines sharing one side-channel Registry and one
// Clock, as a 1P1D or xPyD deployment.
type Cluster struct {
	Prefill, Decode []*Engine
	Registry        *Registry
	// Clock is the virtual clock given with WithClock, nil for real time.
	Clock *VirtualClock
}

// NewCluster starts prefill + decode engines with opts and a shared
// registry (any WithRegistry in opts is overridden). The roles are only the
// intended ones: every engine serves both, as vLLM does.
func NewCluster(tb testing.TB, prefill, decode int, opts ...Option) *Cluster {
	tb.Helper()
	c := &Cluster{Registry: NewRegistry()}
	probe := defaultConfig()
	for _, o := range opts {
		o.apply(&probe)
	}
	if vc, ok := probe.sim.Clock.(*VirtualClock); ok {
		c.Clock = vc
	}
	all := append(append([]Option(nil), opts...), WithRegistry(c.Registry))
	for range prefill {
		c.Prefill = append(c.Prefill, NewEngine(tb, all...))
	}
	for range decode {
		c.Decode = append(c.Decode, NewEngine(tb, all...))
	}
	return c
}

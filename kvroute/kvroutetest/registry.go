package kvroutetest

import "github.com/bidikv/bidikv/internal/sim"

// Registry is the in-process side channel: engines registered in the same
// Registry can read each other's blocks by the remote_host/remote_port of a
// handle, as NIXL agents do. Safe for concurrent use.
type Registry struct{ r *sim.Registry }

// NewRegistry returns an empty registry.
func NewRegistry() *Registry { return &Registry{r: sim.NewRegistry()} }

package kvroute

import (
	"time"

	"github.com/bidikv/bidikv/transport"
)

// Health is how the router learns that an endpoint is failing and that a
// decode engine restarted: passive ejection after consecutive failures,
// active probes, and reads of a decode engine's process start.
type Health struct {
	// EjectAfter is how many consecutive failed requests (connection
	// errors, timeouts, 5xx answers, broken streams) eject an endpoint
	// from selection (default 3; negative: never). An ejected endpoint is
	// left out for an exponential backoff from EjectBackoff (default 1 s)
	// doubling up to MaxEjectBackoff (default 30 s), with jitter. When the
	// time is up it is tried again; a success re-admits it and resets the
	// backoff, a failure ejects it for the next interval. When every
	// endpoint of a phase is ejected, selection falls back to all of them.
	EjectAfter                    int
	EjectBackoff, MaxEjectBackoff time.Duration
	// ProbeInterval turns on active health checking (default 0: no
	// probes): every interval, each endpoint gets GET /health (with its
	// rank header), bounded by ProbeTimeout (0: the interval). A 200
	// re-admits an ejected endpoint at once; any other answer counts as a
	// failure. The probes run on one goroutine that Close stops.
	ProbeInterval, ProbeTimeout time.Duration
	// RestartCheck is how old the router's reading of a decode engine's
	// process_start_time_seconds (GET /metrics) may be when it attaches
	// one of the engine's handles (default 1 s); an older one is read
	// again first, on the turn's lookup, at most once per interval per
	// engine (concurrent turns share the read). A handle issued before
	// the engine's current process started is never attached (docs/kvroute.md,
	// Failure paths). Negative turns the reads off: restarts are then
	// noticed only by a new engine id in the engine's handles or by a
	// failure to reach it, so an engine with a fixed engine id that
	// restarts between two turns without the router seeing it fail is not
	// noticed.
	RestartCheck time.Duration
}

// WithHealth sets how endpoint health and decode engine restarts are
// tracked. A zero field keeps its default (Defaults); a negative
// EjectAfter disables ejection, a negative ProbeInterval probes nothing, a
// negative RestartCheck turns the reads of /metrics off; other negative
// fields are errors.
func WithHealth(h Health) Option {
	return optionFunc(func(c *config) { c.health = h })
}

// endpointConfig is the resolved Health and the endpoints of WithEndpoints.
type endpointConfig struct {
	prefill, decode []transport.Endpoint
	ejectAfter      int
	ejectBackoff    time.Duration
	maxEjectBackoff time.Duration
	probeInterval   time.Duration
	probeTimeout    time.Duration
}

func resolveHealth(c *config) {
	d, h, e := Defaults().Health, c.health, &c.ends
	c.positive("WithHealth", "EjectBackoff", int64(h.EjectBackoff))
	c.positive("WithHealth", "MaxEjectBackoff", int64(h.MaxEjectBackoff))
	c.positive("WithHealth", "ProbeTimeout", int64(h.ProbeTimeout))
	e.ejectAfter = max(orDefault(h.EjectAfter, d.EjectAfter), 0)
	e.ejectBackoff = orDefault(h.EjectBackoff, d.EjectBackoff)
	e.maxEjectBackoff = orDefault(h.MaxEjectBackoff, d.MaxEjectBackoff)
	e.probeInterval = max(h.ProbeInterval, 0)
	e.probeTimeout = h.ProbeTimeout
	c.restartCheck = orNone(h.RestartCheck, d.RestartCheck)
	if e.ejectAfter > 0 && e.maxEjectBackoff < e.ejectBackoff {
		c.fail("WithHealth", "MaxEjectBackoff %v is shorter than EjectBackoff %v", e.maxEjectBackoff, e.ejectBackoff)
	}
}

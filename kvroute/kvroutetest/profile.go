package kvroutetest

import (
	"time"

	"github.com/bidikv/bidikv/internal/sim"
)

// Profile is a cost model:
//
//	prefill  = PrefillOverhead + PrefillPerToken×computed + AttentionNanos×Σ position (ns)
//	transfer = TransferFixed + TransferPerToken×transferred (0 when nothing moves)
//	decode   = InterTokenLatency×generated
//
// The zero Profile costs nothing.
type Profile struct {
	Name              string
	PrefillOverhead   time.Duration
	PrefillPerToken   time.Duration
	AttentionNanos    float64 // nanoseconds per computed token per position of context
	TransferFixed     time.Duration
	TransferPerToken  time.Duration
	InterTokenLatency time.Duration
	RenderOverhead    time.Duration // render endpoints: fixed cost per call
	RenderPerToken    time.Duration // render endpoints: cost per prompt token
	// LocalPrefillOverhead and LocalPrefillFactor price a plain request
	// (no kv_transfer_params, as a decode-local turn is) on the engine:
	// LocalPrefillOverhead + LocalPrefillFactor × (prefill less
	// PrefillOverhead); a factor of 0 prices it as any prefill.
	LocalPrefillOverhead time.Duration
	LocalPrefillFactor   float64
	// KVBytesPerToken is the memory one token of KV occupies across the
	// engine's GPUs and KVCapacityTokens how many tokens its KV cache holds:
	// for the named profiles, one 8×H200 node at tensor parallel 8 and
	// gpu_memory_utilization 0.9 (qwen3-32b: 256 KiB, 3.7M tokens;
	// glm-5-fp8: 480 KiB, 595k tokens; the arithmetic is in
	// internal/sim/capacity.go). 0: unknown. Engines do not take their
	// capacity from the profile: WithNumBlocks(p.NumGPUBlocks(16)) does.
	KVBytesPerToken  int64
	KVCapacityTokens int
	// HostToDevicePerToken prices moving one token of KV between the GPUs
	// and the CPU tier (WithCPUTier): loads delay the request (its
	// Transfer), stores are asynchronous. PeerFixed and PeerPerToken price
	// a pull from a peer's CPU tier; PeerLookup a peer lookup that found
	// nothing to pull (its round trip and the scheduler step it holds the
	// request). The named profiles' values are an assumption
	// (internal/sim/cost.go). 0: free.
	HostToDevicePerToken    time.Duration
	PeerFixed, PeerPerToken time.Duration
	PeerLookup              time.Duration
}

// NumGPUBlocks is the profile's capacity in blocks of bs tokens, for
// WithNumBlocks (0 when unknown).
func (p Profile) NumGPUBlocks(bs int) int { return sim.Profile(p).NumGPUBlocks(bs) }

// Prefill models computing n tokens after ctx positions already held.
func (p Profile) Prefill(n, ctx int) time.Duration { return sim.Profile(p).Prefill(n, ctx) }

// LocalPrefill models a plain request computing n tokens after ctx
// positions its prefix cache held, on a decode engine.
func (p Profile) LocalPrefill(n, ctx int) time.Duration { return sim.Profile(p).LocalPrefill(n, ctx) }

// Transfer models reading n tokens of KV.
func (p Profile) Transfer(n int) time.Duration { return sim.Profile(p).Transfer(n) }

// Decode models generating n tokens.
func (p Profile) Decode(n int) time.Duration { return sim.Profile(p).Decode(n) }

// Render models a render or tokenize call for a prompt of n tokens.
func (p Profile) Render(n int) time.Duration { return sim.Profile(p).Render(n) }

// LookupProfile returns a named profile: "qwen3-32b" or "glm-5-fp8",
// calibrated on the published 1P1D P5en results (recompute TTFT 158 ms at 2k
// to 778 ms at 24k tokens and transfer 30-130 ms; 500 ms at 2k to 2,334 ms at
// 20k and transfer 29-110 ms). The fit is documented in internal/sim/cost.go.
func LookupProfile(name string) (Profile, bool) {
	p, ok := sim.LookupProfile(name)
	return Profile(p), ok
}

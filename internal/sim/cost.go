package sim

import "time"

// Profile is a cost model. Field-for-field identical to kvroutetest.Profile.
type Profile struct {
	Name              string
	PrefillOverhead   time.Duration
	PrefillPerToken   time.Duration
	AttentionNanos    float64
	TransferFixed     time.Duration
	TransferPerToken  time.Duration
	InterTokenLatency time.Duration
	// RenderOverhead and RenderPerToken model the render endpoints
	// (/v1/chat/completions/render, /v1/completions/render, /tokenize):
	// the chat template plus the tokenizer, on the API server's CPU.
	RenderOverhead time.Duration
	RenderPerToken time.Duration
}

// Render models rendering and tokenizing a prompt of n tokens.
func (p Profile) Render(n int) time.Duration {
	if n <= 0 {
		return p.RenderOverhead
	}
	return p.RenderOverhead + time.Duration(n)*p.RenderPerToken
}

// Prefill models computing n tokens after ctx positions already held:
// overhead + per-token×n + attention×Σ position over the computed positions.
func (p Profile) Prefill(n, ctx int) time.Duration {
	if n <= 0 {
		return 0
	}
	attn := p.AttentionNanos * float64(n) * float64(2*ctx+n-1) / 2
	return p.PrefillOverhead + time.Duration(n)*p.PrefillPerToken + time.Duration(attn)
}

// Transfer models a KV read of n tokens (0 when nothing is read).
func (p Profile) Transfer(n int) time.Duration {
	if n <= 0 {
		return 0
	}
	return p.TransferFixed + time.Duration(n)*p.TransferPerToken
}

// Decode models generating n tokens.
func (p Profile) Decode(n int) time.Duration { return time.Duration(n) * p.InterTokenLatency }

// The named profiles, calibrated on the published 1P1D results on P5en
// (TTFT of a recomputed prompt, and the KV transfer time, at the smallest and
// largest prompt measured).
//
// Prefill: the attention coefficient is chosen so that the quadratic term is
// about 13% (qwen3-32b, 24k) and 15% (glm-5-fp8, 20k) of the largest
// measurement; the overhead and per-token cost then solve the two points
// exactly (recompute TTFT is attributed wholly to prefill):
//
//	qwen3-32b: 158 ms at 2,000 tokens, 778 ms at 24,000
//	  attention 0.35 ns/token² → 0.70 ms at 2k, 100.8 ms at 24k
//	  per-token (778-100.80-158+0.70)/22,000 = 23.632 µs; overhead 110.04 ms
//	glm-5-fp8: 500 ms at 2,000 tokens, 2,334 ms at 20,000
//	  attention 1.75 ns/token² → 3.50 ms at 2k, 350.0 ms at 20k
//	  per-token (2334-349.98-500+3.50)/18,000 = 82.640 µs; overhead 331.22 ms
//
// Transfer: a straight line through the smallest and largest transfer time
// at the same prompt sizes: qwen3-32b 30 ms at 2k and 130 ms at 24k →
// 4.545 µs/token + 20.91 ms; glm-5-fp8 29 ms at 2k and 110 ms at 20k →
// 4.5 µs/token + 20.0 ms.
//
// Inter-token latency is not in the published results; 22 ms (qwen3-32b) and
// 30 ms (glm-5-fp8) are assumptions of typical H200 decode speed.
var profiles = []Profile{
	{
		Name:              "qwen3-32b",
		PrefillOverhead:   110040 * time.Microsecond,
		PrefillPerToken:   23632 * time.Nanosecond,
		AttentionNanos:    0.35,
		TransferFixed:     20909 * time.Microsecond,
		TransferPerToken:  4545 * time.Nanosecond,
		InterTokenLatency: 22 * time.Millisecond,
	},
	{
		Name:              "glm-5-fp8",
		PrefillOverhead:   331222 * time.Microsecond,
		PrefillPerToken:   82640 * time.Nanosecond,
		AttentionNanos:    1.75,
		TransferFixed:     20 * time.Millisecond,
		TransferPerToken:  4500 * time.Nanosecond,
		InterTokenLatency: 30 * time.Millisecond,
	},
}

// LookupProfile returns a named profile.
func LookupProfile(name string) (Profile, bool) {
	for _, p := range profiles {
		if p.Name == name {
			return p, true
		}
	}
	return Profile{}, false
}

// ProfileNames lists the named profiles.
func ProfileNames() []string {
	out := make([]string, len(profiles))
	for i, p := range profiles {
		out[i] = p.Name
	}
	return out
}

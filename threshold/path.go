package threshold

import (
	"sync/atomic"
	"time"
)

// Path is how a turn's prompt reaches the decode engine that answers it.
type Path string

// The paths a [Chooser] picks from.
const (
	// PathPull is today's hit: the prefill engine pulls the decode
	// engine's retained blocks, computes the new suffix and the decode
	// engine reads the suffix back.
	PathPull Path = "pull"
	// PathLocal sends the turn, as a plain request without
	// kv_transfer_params, to the decode engine that holds the
	// conversation: it computes only the suffix, from its own prefix
	// cache, and retains nothing (the conversation's retained handle stays
	// the candidate for its next turn).
	PathLocal Path = "decode_local"
	// PathRecompute is a plain miss: the prefill engine computes the whole
	// prompt and the decode engine reads what it lacks.
	PathRecompute Path = "recompute"
	// PathPeer is a recompute whose prefill engine first pulls, by block
	// hash, what the decode engine that last held the conversation still
	// keeps of it in its CPU tier (vLLM's OffloadingConnector with its
	// peer tier: kv_transfer_params.remote_kv_source), and computes the
	// rest; a chunk the tier no longer holds ends the pull there. The
	// router takes it for a turn with no GPU hold to attach (see
	// [Rates.PeerSaves]).
	PathPeer Path = "peer"
)

// Why a Chooser did not take PathLocal although it estimated it cheapest
// ([Choice.Refusal]).
const (
	RefuseLocalSuffix = "suffix" // the suffix is over the decode-local bound
	RefuseLocalBusy   = "busy"   // the decode engine runs its maximum of decode-local prefills
	// RefuseLocalAge: the handle is too old. A decode-local turn does not
	// renew it, so the next turn would likely find it expired; a pull
	// retains a fresh one.
	RefuseLocalAge = "age"
)

// Turn is what the router knows when it chooses a turn's path: a retained
// handle verified by tokens against the new prompt.
type Turn struct {
	// PromptTokens is the new prompt's length in tokens.
	PromptTokens int
	// ReusableTokens is the verified common prefix of the prompt and the
	// sequence the decode engine's retained blocks hold.
	ReusableTokens int
	// Decode identifies the decode engine that holds the handle (its URL).
	Decode string
	// DecodeInFlight is the number of the router's requests open on it.
	DecodeInFlight int
	// HandleAge is the handle's age and RetentionTTL how long the router
	// retains a handle; 0 when unknown.
	HandleAge, RetentionTTL time.Duration
	// FromCPU: the reusable tokens are in the decode engine's CPU tier,
	// not a GPU hold (the router released the hold; the tier kept a
	// copy). PathPull then means PathPeer (the prefill engine pulls them
	// from that tier: Rates.PeerFixed and PeerPerToken replace the pull's
	// fixed and per-token cost) and a decode-local turn reloads them from
	// the tier first (Rates.TierLoadPerToken).
	FromCPU bool
}

// Suffix returns the tokens the turn adds to what the decode engine holds:
// PromptTokens - ReusableTokens, at least 1 (an engine always computes the
// last prompt position).
func (in Turn) Suffix() int { return max(in.PromptTokens-in.ReusableTokens, 1) }

// Choice is a Chooser's answer for one turn.
type Choice struct {
	// Path is the path to take.
	Path Path
	// Estimate is the estimated engine time to first token of Path: the
	// legs' engine time, without the router's own work or the render call.
	// 0 when the Chooser gives no estimate.
	Estimate time.Duration
	// Pull, Local and Recompute are the estimates of each path, 0 when the
	// path was not considered.
	Pull, Local, Recompute time.Duration
	// Refusal is RefuseLocalSuffix or RefuseLocalBusy when PathLocal was
	// estimated cheapest but not taken, "" otherwise.
	Refusal string

	release *atomic.Int64
	done    *atomic.Bool
}

// Release ends the decode-local prefill a PathLocal choice reserved on its
// decode engine; the router calls it when the engine's first token (or its
// failure) arrives. It is safe to call on any Choice, more than once.
func (c Choice) Release() {
	if c.release != nil && c.done != nil && !c.done.Swap(true) {
		c.release.Add(-1)
	}
}

// Chooser is a [Policy] that also chooses a turn's path when a verified
// handle makes more than one possible. The router asks it only when
// decode-local turns are enabled. Implementations are safe for concurrent
// use.
type Chooser interface {
	Policy
	// Choose returns the path of the turn described by in. A PathLocal
	// choice holds a reservation on in.Decode until its Release.
	Choose(in Turn) Choice
}

// Observation is one finished turn's engine times, for a [Learner].
type Observation struct {
	// Path is the path the turn took.
	Path Path
	// Decode is the decode engine that answered.
	Decode string
	// PromptTokens and ReusableTokens are the turn's Turn figures.
	PromptTokens, ReusableTokens int
	// Prefill is the prefill leg, request to answer (0 on PathLocal).
	Prefill time.Duration
	// DecodeFirst is the decode leg, request to its first token.
	DecodeFirst time.Duration
}

// Learner is an optional capability of a Chooser: the router reports every
// turn it chose a path for, once it has seen the first token, so that the
// Chooser can learn the engines' rates.
type Learner interface {
	Observe(o Observation)
}

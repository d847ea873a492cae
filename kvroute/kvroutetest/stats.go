package kvroutetest

import (
	"encoding/json"
	"net/http"
	"time"

	"github.com/bidikv/bidikv/internal/sim"
)

// Stats is a snapshot of an engine's counters since it started (Restart
// keeps them), summed over its data-parallel ranks.
type Stats struct {
	// Requests counts completion requests received, faults included;
	// PrefillRequests, DecodeRequests and PlainRequests split those that
	// got as far as a role.
	Requests, PrefillRequests, DecodeRequests, PlainRequests int
	// TokensComputed counts prompt positions computed locally.
	TokensComputed int
	// TokensPulledIn counts tokens this engine read from a remote;
	// TokensPulledOut tokens remotes read from this engine.
	TokensPulledIn, TokensPulledOut int
	// PrefixHitTokens counts prompt tokens served by the local prefix cache.
	PrefixHitTokens int
	// FreedReads and ExpiredReads count reads (as the emitter) of handles
	// whose blocks were already freed (consumed, aborted, unknown) or had
	// expired (lease or TTL). The reader got whatever the blocks held.
	FreedReads, ExpiredReads int
	// WrongOutputs counts decode and plain outputs that differ from
	// Reference.
	WrongOutputs int
	// BlocksPinned is the number of blocks held for a remote reader now;
	// FreeBlocks the number in the free queue.
	BlocksPinned, FreeBlocks int
	// Aborted counts requests ended by a client disconnect or a cut stream.
	Aborted int
	// HandlesEmitted counts handles returned to clients.
	HandlesEmitted int
	// LoadFailures counts failed reads (declined, unreachable, wrong engine
	// id); DeclinedReads those declined within 5 s of the handle's expiry.
	LoadFailures, DeclinedReads int
	// Recomputed counts prefills that recomputed because the count was
	// below kv_recompute_threshold.
	Recomputed int
	// LeaseExpiries and TTLExpiries count handles freed by time.
	LeaseExpiries, TTLExpiries int
	// Errors counts error responses; Restarts calls to Restart.
	Errors, Restarts int
	// AssertFailures counts reads that tripped the worker's assert
	// len(local) <= len(remote) on some KV group (or whose group count
	// differs from the engine's): each got 500 and restarted the engine
	// (also counted in Restarts).
	AssertFailures int
	// PoisonedHits counts prefix-cache hits whose cached KV differs from
	// the correct KV for their tokens: a bad positional read (pulled
	// blocks are cached under this engine's own token hashes) poisoning a
	// later request that shares the prefix.
	PoisonedHits int
	// RenderRequests counts calls to the render endpoints and
	// TokenizeRequests calls to POST /tokenize and
	// POST /v1/messages/count_tokens; neither counts in Requests. They
	// appear in Requests() with Role "render", "tokenize" or
	// "count_tokens".
	RenderRequests, TokenizeRequests int
	// TotalBlocks is the KV pool's usable capacity (WithNumBlocks per
	// rank) and UsedBlocks what is allocated now: running requests and
	// holds (vllm:kv_cache_usage_perc is UsedBlocks/TotalBlocks). Running
	// and Waiting are vllm:num_requests_running and
	// vllm:num_requests_waiting now.
	TotalBlocks, UsedBlocks, Running, Waiting int
	// Queued counts requests that waited for blocks (or a running slot)
	// before they were first scheduled. Preemptions counts preemptions
	// (vllm:num_preemptions_total) and TokensRecomputed the tokens
	// recomputed after them.
	Queued, Preemptions, TokensRecomputed int
	// Holds counts handles whose blocks were held for a remote reader.
	// NotifiedHolds counts holds freed by a reader's notification (a pull,
	// or the notify-only path) and NotifiedBlocks their blocks;
	// TTLBlocks and LeaseBlocks count the blocks freed by expiry.
	// StaleNotifies counts notifications for holds unknown, expired or
	// already freed: harmless, they change nothing.
	Holds, NotifiedHolds, NotifiedBlocks, TTLBlocks, LeaseBlocks, StaleNotifies int
	// The CPU tier (WithCPUTier). CPUChunksStored counts chunks written
	// through, CPUChunksEvicted those evicted, CPUStoreFailures store
	// batches skipped for want of room (each retry counts again).
	// CPUChunksLoaded counts chunks loaded to the GPU after a prefix-cache
	// hit, CPUChunksFromPeer those of them pulled from a peer's tier.
	// CPUPeerPulls counts requests that asked a peer, CPUPeerMisses those
	// whose lookup ended on a miss before the prompt's last whole chunk
	// (rejected handshakes included), CPUPeerRejects handshakes rejected
	// for a configuration mismatch. CPUChunksResident and
	// CPUChunksCapacity are the tier's fill now (not exported on /metrics,
	// as vLLM exports none); CPUChunksServed counts chunks peers pulled
	// from this engine.
	CPUChunksStored, CPUChunksEvicted, CPUStoreFailures   int
	CPUChunksLoaded, CPUChunksFromPeer                    int
	CPUPeerPulls, CPUPeerMisses, CPUPeerRejects           int
	CPUChunksResident, CPUChunksCapacity, CPUChunksServed int
}

// RequestRecord is what an engine saw and did for one request.
type RequestRecord struct {
	Path   string
	Header http.Header
	Body   []byte
	// RequestID is the X-Request-Id header; EngineRequestID the engine's
	// internal id (remote_request_id of its handle).
	RequestID, EngineRequestID string
	// Role is "prefill", "decode" or "plain" ("" when rejected earlier) for
	// completion requests, "render" or "tokenize" for those endpoints.
	Role string
	// PromptTokens, CachedTokens (prefix-cache hit), ComputedTokens,
	// PulledTokens (read from a remote) and CompletionTokens.
	PromptTokens, CachedTokens, ComputedTokens, PulledTokens, CompletionTokens int
	// Pull is the pull decision: "none", "pull", "recompute" or "failed".
	Pull string
	// Prefill, Transfer and Decode are the modelled durations; modelled
	// TTFT on this engine is Transfer + Prefill.
	Prefill, Transfer, Decode time.Duration
	// Status is the HTTP status sent (499: client went away first).
	Status int
	// Finish is the finish reason of the first choice.
	Finish string
	// Aborted: the client went away or the stream was cut; no handle.
	Aborted bool
	// Wrong: the output differs from Reference (decode and plain only).
	Wrong bool
	// Poisoned: the prefix-cache hit held wrong KV (see
	// Stats.PoisonedHits).
	Poisoned bool
	// Handle is the kv_transfer_params emitted, nil when none.
	Handle json.RawMessage
	// Error is the error message sent, if any.
	Error string
	// Rank is the data-parallel rank that served the request (WithDPSize);
	// 0 with one rank or when the request was rejected before a rank was
	// chosen.
	Rank int
	// Queued is how long the request waited for KV blocks (or a running
	// slot) before it was first scheduled, and, read from a remote, for a
	// running slot. Preemptions counts its
	// preemptions, Requeued the time it waited to be let in again after
	// them and Recompute the modelled recomputation of its prompt and
	// generated tokens. FirstToken is the modelled time from its arrival
	// to the end of its prefill: Queued + Transfer + Prefill and whatever
	// preemptions cost before it (Transfer + Prefill without pressure).
	// Times are on the engine's clock.
	Queued, Requeued, Recompute, FirstToken time.Duration
	Preemptions                             int
	// TierTokens are the prompt tokens loaded from the CPU tier after the
	// GPU prefix-cache hit (WithCPUTier), PeerTokens those of them pulled
	// from a peer's tier; both are priced in Transfer.
	TierTokens, PeerTokens int
}

func fromSimStats(s sim.Stats) Stats {
	return Stats{
		Requests: s.Requests, PrefillRequests: s.PrefillRequests, DecodeRequests: s.DecodeRequests,
		PlainRequests: s.PlainRequests, TokensComputed: s.TokensComputed, TokensPulledIn: s.TokensPulledIn,
		TokensPulledOut: s.TokensPulledOut, PrefixHitTokens: s.PrefixHitTokens, FreedReads: s.FreedReads,
		ExpiredReads: s.ExpiredReads, WrongOutputs: s.WrongOutputs, BlocksPinned: s.BlocksPinned,
		FreeBlocks: s.FreeBlocks, Aborted: s.Aborted, HandlesEmitted: s.HandlesEmitted,
		LoadFailures: s.LoadFailures, DeclinedReads: s.DeclinedReads, Recomputed: s.Recomputed,
		LeaseExpiries: s.LeaseExpiries, TTLExpiries: s.TTLExpiries, Errors: s.Errors, Restarts: s.Restarts,
		RenderRequests: s.RenderRequests, TokenizeRequests: s.TokenizeRequests, PoisonedHits: s.PoisonedHits,
		AssertFailures: s.AssertFailures, TotalBlocks: s.TotalBlocks, UsedBlocks: s.UsedBlocks, Running: s.Running,
		Waiting: s.Waiting, Queued: s.Queued, Preemptions: s.Preemptions, TokensRecomputed: s.TokensRecomputed,
		Holds: s.Holds, NotifiedHolds: s.NotifiedHolds, NotifiedBlocks: s.NotifiedBlocks, TTLBlocks: s.TTLBlocks,
		LeaseBlocks: s.LeaseBlocks, StaleNotifies: s.StaleNotifies,
		CPUChunksStored: s.CPUChunksStored, CPUChunksEvicted: s.CPUChunksEvicted, CPUStoreFailures: s.CPUStoreFailures,
		CPUChunksLoaded: s.CPUChunksLoaded, CPUChunksFromPeer: s.CPUChunksFromPeer, CPUPeerPulls: s.CPUPeerPulls,
		CPUPeerMisses: s.CPUPeerMisses, CPUPeerRejects: s.CPUPeerRejects, CPUChunksResident: s.CPUChunksResident,
		CPUChunksCapacity: s.CPUChunksCapacity, CPUChunksServed: s.CPUChunksServed,
	}
}

func fromSimRecord(r sim.Record) RequestRecord {
	return RequestRecord{
		Path: r.Path, Header: r.Header, Body: r.Body, RequestID: r.RequestID, EngineRequestID: r.EngineRequestID,
		Role: r.Role, PromptTokens: r.PromptTokens, CachedTokens: r.CachedTokens, ComputedTokens: r.ComputedTokens,
		PulledTokens: r.PulledTokens, CompletionTokens: r.CompletionTokens, Pull: r.Pull, Prefill: r.Prefill,
		Transfer: r.Transfer, Decode: r.Decode, Status: r.Status, Finish: r.Finish, Aborted: r.Aborted,
		Wrong: r.Wrong, Poisoned: r.Poisoned, Handle: r.Handle, Error: r.Error, Rank: r.Rank,
		Queued: r.Queued, Requeued: r.Requeued, Recompute: r.Recompute, FirstToken: r.FirstToken,
		Preemptions: r.Preemptions, TierTokens: r.TierTokens, PeerTokens: r.PeerTokens,
	}
}

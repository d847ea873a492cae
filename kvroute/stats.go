package kvroute

import "sync/atomic"

// Stats are a Router's counters since New: what went wrong or was
// refused, and the decisions the cost model took. Hits and misses are per
// turn, in the TurnRecord given to the Observer (Reuse, MissReason,
// StoreRefusal); count them there, as the proxy does
// (bidikv_reuse_hits_total, bidikv_reuse_misses_total by reason).
type Stats struct {
	// Stored counts handles retained for a next turn.
	Stored int64
	// NoStreamHandle counts streaming turns whose decode stream ended
	// normally without a handle where the engine was given P's, on every
	// API: stock vLLM without PR #40186 on chat and completions, vLLM's
	// Messages streams always (TurnRecord.Missing "no_stream_handle";
	// Router.Endpoints reports it per engine and API).
	NoStreamHandle int64
	// NoPrefillHandle counts prefill answers without a usable handle (none,
	// one lacking the keys an engine needs, or a push-mode handle).
	NoPrefillHandle int64
	// NoDecodeHandle counts decode answers that finished normally (stop or
	// length) without a handle although one was expected: non-streaming
	// answers to a request that carried P's handle, and streams from an
	// engine that has sent handles in streams before (vLLM PR #40186).
	// Streams of engines never seen to send one count in NoStreamHandle.
	NoDecodeHandle int64
	// UnconfirmedHits counts hits whose prefill answer reported
	// usage.prompt_tokens_details.cached_tokens below the tokens the router
	// attached (less the last prompt token, which the engine recomputes):
	// the engine did not read what it was given. Answers without
	// prompt_tokens_details are not checked.
	UnconfirmedHits int64
	// PushHandles counts handles with transfer_mode "push", which cannot be
	// used bidirectionally: a prefill engine's is treated as no handle (and
	// counted in NoPrefillHandle too), a decode engine's is not retained.
	PushHandles int64
	// TooLarge counts decode handles not retained because their entry
	// exceeded WithLimits' Entry or the Store's own bound.
	TooLarge int64
	// HitRetries counts prefill attempts with a handle that failed and
	// were retried as plain misses.
	HitRetries int64
	// StoreErrors counts Store failures; each turn went on as a miss.
	StoreErrors int64
	// Refusals counts finished turns whose handle the Identifier refused
	// to key.
	Refusals int64
	// Failures counts turns that ended with an error.
	Failures int64
	// Renders counts render (or tokenize) calls made to verify reuse.
	Renders int64
	// RenderFailures counts render calls that failed; each such turn ran
	// without the handle unless content verification could stand in.
	RenderFailures int64
	// TokenFallbacks counts turns in token mode that fell back to content
	// rules because an engine served no render endpoint or sent no token
	// ids.
	TokenFallbacks int64
	// PartialHits counts hits that attached only a verified prefix of a
	// handle (remote_num_tokens lowered, blocks cut from the front).
	PartialHits int64
	// PartialRefused counts handles that matched only in part and could not
	// be cut (see MissPartialRefused).
	PartialRefused int64
	// PutBacks counts handles taken for verification, not attached, and
	// returned to the store for their remaining retention time.
	PutBacks int64
	// GoneHandles counts retained handles found for a decode endpoint that
	// is no longer listed (MissEndpointGone), not attached.
	GoneHandles int64
	// ChosePull, ChoseLocal and ChoseRecompute count the Chooser's
	// decisions by path (WithDecodeMemory's Local): attach the handle, answer on
	// the decode engine that holds the conversation, recompute on P.
	ChosePull, ChoseLocal, ChoseRecompute int64
	// LocalBusy counts turns estimated cheapest decode-local that pulled
	// because their decode engine ran its maximum of decode-local
	// prefills.
	LocalBusy int64
	// PeerPulls counts turns whose prefill leg pulled from a decode
	// engine's CPU tier (TurnRecord.PeerSource); PeerSkipped those with a
	// tier record that did not: the ledger estimated too little of the
	// conversation still there to beat a recompute, or its decode engine
	// was ejected or gone.
	PeerPulls, PeerSkipped int64
	// PeerShort counts those pulls whose prefill engine reported fewer
	// cached tokens than the tier was estimated to hold
	// (TurnRecord.PeerShort): a tier that evicts sooner than
	// CPUTierTokens says, or pulls that miss. Only engines that report
	// prompt_tokens_details count.
	PeerShort int64
	// LocalShort counts decode-local turns chosen on the estimate that
	// their decode engine's CPU tier held the conversation, whose engine
	// then reported fewer cached tokens than that estimate less a block
	// (TurnRecord.LocalShort): the reload missed and the decode engine
	// computed the history itself. Only engines that report
	// prompt_tokens_details count.
	LocalShort int64
	// LocalFailures counts decode-local legs that failed before any byte
	// reached the client; each turn ran again as a plain miss.
	LocalFailures int64
	// InvalidHandles counts handles refused because vLLM could not read
	// them correctly (a block id that is not an integer from 0 to 2^31-1,
	// a port out of range, fewer blocks than remote_num_tokens needs, a
	// member of the wrong type or named twice): a prefill engine's (the
	// turn fails as without a handle), a decode engine's (not retained) or
	// a retained one (not attached).
	InvalidHandles int64
	// UnvalidatedHandles counts the handles among InvalidHandles that
	// held fewer blocks than remote_num_tokens needs at their engine's
	// block size (EndpointStatus.BlockSize): the engine reports a size its
	// handles do not follow, or the configured size is not the engine's.
	// The turn is served without reuse (P's: the decode engine prefills
	// by itself; D's: not retained), and the engine serves without reuse
	// for a while (EndpointStatus.NoReuse).
	UnvalidatedHandles int64
	// RestartedHandles counts retained handles dropped because their
	// decode engine restarted since it issued them (MissRestarted);
	// DecodeRestarts counts the restarts noticed (a new
	// process_start_time_seconds or engine id); RestartChecksUnavailable
	// counts reads of a decode engine's /metrics that found no
	// process_start_time_seconds.
	RestartedHandles, DecodeRestarts, RestartChecksUnavailable int64
	// RenderBreaks counts openings of a prefill engine's render circuit
	// breaker (consecutive failures, or a call that ran out of
	// WithTimeouts' Render); RenderSkipped counts turns that went on without
	// a render because every prefill engine's renderer was behind an open
	// breaker or distrusted.
	RenderBreaks, RenderSkipped int64
	// RenderMismatches counts prefill legs whose engine computed other
	// prompt tokens than its render answered (return_token_ids on the leg
	// that carries a handle): the turn was redone as a plain miss on
	// another engine (MissRenderMismatch) when the difference lay in the
	// attached prefix, and that engine's renderer is distrusted for five
	// minutes. UncheckedPrefills counts such legs whose answer carried no
	// prompt ids to compare (engines before vLLM PR #22587).
	RenderMismatches, UncheckedPrefills int64
	// BufferedStreams counts streamed turns whose decode leg ran
	// non-streaming and whose answer was written as the API's stream
	// (WithDecodeMemory's BufferStreams; TurnRecord.Buffered, per API by
	// its Path).
	BufferedStreams int64
	// AvoidedEngineTurns counts turns that kept off a prefill engine
	// because an earlier turn of their conversation found it computing
	// other prompt tokens than its render answered, after it had pulled
	// (its prefix cache may hold those blocks; see MissRenderMismatch).
	AvoidedEngineTurns int64

	// ImplausibleMetrics counts readings of a decode engine's /metrics
	// (pressure and restart checks) with a value no real engine reports: a
	// count that overflowed, a KV capacity below one block, a usage outside
	// 0 to 1, a process start in the future. The value is ignored and the
	// last plausible one kept; each metric is logged once per engine.
	ImplausibleMetrics int64
	// CapacityUnknown counts decode engines whose /metrics answered
	// without a KV capacity (no vllm:cache_config_info, or not 200) while
	// none is configured (DecodeMemory's Capacity): decode memory
	// management is off for them (EndpointStatus.NoCapacity), logged once
	// per engine. Counted again only for an engine whose capacity was known
	// in between.
	CapacityUnknown int64

	// Decode memory (WithDecodeMemory; docs/kvroute.md, Decode memory).
	// ReleasedSuperseded counts retained handles a turn took and did not
	// attach, released through its own prefill leg (TurnRecord.Released):
	// the turn's new handle replaces them. ReleasedUnusable counts handles
	// found past the retention TTL and released the same way, while their
	// decode engine still held them. ReleasedBudget counts holds over
	// their engine's budget, worth least, released by release requests;
	// ReleasedRoom those released the same way to make room for a decode
	// leg arriving at their engine (DecodeMemory's Headroom and RoomRate);
	// ReleasedExpired those whose retention TTL ended without a next turn,
	// released then rather than left pinned until the engine's own TTL.
	ReleasedSuperseded, ReleasedUnusable, ReleasedBudget, ReleasedRoom, ReleasedExpired int64
	// Orphans: decode handles the router received and did not keep,
	// released at once by release requests rather than left pinned to the
	// engine's TTL. ReleasedNChoices counts those of answers of n > 1
	// choices; ReleasedRefused those of turns not retained (a finish the
	// router does not retain, the Identifier's refusal, no render to seal
	// them with, an entry too large for the Store, reuse off);
	// ReleasedStoreError those the Store failed to keep (after a Take
	// showed that it does not hold them); ReleasedOverwritten retained
	// handles found under the key a turn retained its own handle under
	// (two turns of one conversation at once), or put back under it.
	ReleasedNChoices, ReleasedRefused, ReleasedStoreError, ReleasedOverwritten int64
	// Unreleasable counts decode handles the router did not keep and could
	// not release either: a handle vLLM would misread or ignore, one of
	// push mode, or one whose Put failed while the Store could not say
	// whether it holds it. Their holds lapse at the engines' TTL.
	Unreleasable int64
	// RoomRejected counts decode legs that made no room on arrival
	// because their engine will reject them: max_tokens (or its kin) over
	// the engine's max_model_len, alone or with the prompt. RoomLimited
	// counts decode legs whose room on arrival was cut by their
	// principal's DecodeMemory RoomRate: other tenants' holds were left.
	RoomRejected, RoomLimited int64
	// ReleaseFailures counts releases that failed (the prefill leg or the
	// release request did not succeed, or the entry could not be sent):
	// the hold lapses at its TTL. ReleaseSkipped counts holds not
	// released because their decode engine restarted since (their blocks
	// are gone) or is no longer listed (SetEndpoints). ReleaseGone counts holds over the budget (or past their
	// retention) whose handle was no longer in the store when their release came (another router's
	// turn or release took it, or it expired): nothing to release.
	ReleaseFailures, ReleaseSkipped, ReleaseGone int64
	// PrefixUnshared counts holds whose blocks the ledger could not match
	// with other holds' (token verification): the decode engine's block
	// size, as its /metrics report it, was not the one its handle was
	// fingerprinted with; each of its blocks was counted as its own.
	PrefixUnshared int64
	// ReleasedFinal counts holds released after the turn that ended their
	// session (a request with X-Dynamo-Session-Final: true): the turn's
	// handle released at once instead of retained for the TTL; and the
	// holds of conversations their client deleted (DELETE
	// /v1/conversations/{id}, ServeHTTP).
	ReleasedFinal int64
}

type counters struct {
	stored, noStreamHandle, noPrefillHandle, hitRetries, storeErrors, refusals, failures   atomic.Int64
	renders, renderFailures, tokenFallbacks, partialHits, partialRefused, putBacks         atomic.Int64
	noDecodeHandle, unconfirmedHits, pushHandles, tooLarge, goneHandles                    atomic.Int64
	chosePull, choseLocal, choseRecompute, localBusy, localFailures                        atomic.Int64
	invalidHandles, restartedHandles, decodeRestarts, restartChecksUnavailable             atomic.Int64
	renderBreaks, renderSkipped, renderMismatches, uncheckedPrefills, avoidedEngineTurns   atomic.Int64
	buffered, peerPulls, peerSkipped, peerShort, localShort                                atomic.Int64
	releasedSuperseded, releasedUnusable, releasedBudget, releasedRoom, releasedExpired    atomic.Int64
	releasedN, releasedRefused, releasedStoreError, releasedOverwritten, unreleasable      atomic.Int64
	roomRejected, roomLimited                                                              atomic.Int64
	releaseFailures, releaseSkipped, releaseGone                                           atomic.Int64
	implausibleMetrics, unvalidatedHandles, capacityUnknown, prefixUnshared, releasedFinal atomic.Int64
	// renderedPromptIDs counts turns whose decode answer's prompt ids were
	// taken as the rendered ones (same text), not parsed; not exported in
	// Stats (a measure of the router's own work, for its tests).
	renderedPromptIDs atomic.Int64
}

func (c *counters) snapshot() Stats {
	return Stats{
		Stored:          c.stored.Load(),
		NoStreamHandle:  c.noStreamHandle.Load(),
		NoPrefillHandle: c.noPrefillHandle.Load(),
		HitRetries:      c.hitRetries.Load(),
		StoreErrors:     c.storeErrors.Load(),
		Refusals:        c.refusals.Load(),
		Failures:        c.failures.Load(),
		Renders:         c.renders.Load(),
		RenderFailures:  c.renderFailures.Load(),
		TokenFallbacks:  c.tokenFallbacks.Load(),
		PartialHits:     c.partialHits.Load(),
		PartialRefused:  c.partialRefused.Load(),
		PutBacks:        c.putBacks.Load(),
		NoDecodeHandle:  c.noDecodeHandle.Load(),
		UnconfirmedHits: c.unconfirmedHits.Load(),
		PushHandles:     c.pushHandles.Load(),
		TooLarge:        c.tooLarge.Load(),
		GoneHandles:     c.goneHandles.Load(),
		ChosePull:       c.chosePull.Load(),
		ChoseLocal:      c.choseLocal.Load(),
		ChoseRecompute:  c.choseRecompute.Load(),
		LocalBusy:       c.localBusy.Load(),
		LocalFailures:   c.localFailures.Load(),
		PeerPulls:       c.peerPulls.Load(),
		PeerSkipped:     c.peerSkipped.Load(),
		PeerShort:       c.peerShort.Load(),
		LocalShort:      c.localShort.Load(),
		InvalidHandles:  c.invalidHandles.Load(),

		RestartedHandles:         c.restartedHandles.Load(),
		DecodeRestarts:           c.decodeRestarts.Load(),
		RestartChecksUnavailable: c.restartChecksUnavailable.Load(),
		RenderBreaks:             c.renderBreaks.Load(),
		RenderSkipped:            c.renderSkipped.Load(),
		RenderMismatches:         c.renderMismatches.Load(),
		UncheckedPrefills:        c.uncheckedPrefills.Load(),
		AvoidedEngineTurns:       c.avoidedEngineTurns.Load(),
		BufferedStreams:          c.buffered.Load(),
		ImplausibleMetrics:       c.implausibleMetrics.Load(),
		CapacityUnknown:          c.capacityUnknown.Load(),
		UnvalidatedHandles:       c.unvalidatedHandles.Load(),

		ReleasedSuperseded: c.releasedSuperseded.Load(),
		ReleasedUnusable:   c.releasedUnusable.Load(),
		ReleasedBudget:     c.releasedBudget.Load(),
		ReleasedRoom:       c.releasedRoom.Load(),
		ReleasedExpired:    c.releasedExpired.Load(),

		ReleasedNChoices:    c.releasedN.Load(),
		ReleasedRefused:     c.releasedRefused.Load(),
		ReleasedStoreError:  c.releasedStoreError.Load(),
		ReleasedOverwritten: c.releasedOverwritten.Load(),
		Unreleasable:        c.unreleasable.Load(),
		RoomRejected:        c.roomRejected.Load(),
		RoomLimited:         c.roomLimited.Load(),

		ReleaseFailures: c.releaseFailures.Load(),
		ReleaseSkipped:  c.releaseSkipped.Load(),
		ReleaseGone:     c.releaseGone.Load(),
		PrefixUnshared:  c.prefixUnshared.Load(),
		ReleasedFinal:   c.releasedFinal.Load(),
	}
}

// released counts a release by its reason.
func (c *counters) released(why releaseReason) {
	switch why {
	case releaseSuperseded:
		c.releasedSuperseded.Add(1)
	case releaseUnusable:
		c.releasedUnusable.Add(1)
	case releaseBudget:
		c.releasedBudget.Add(1)
	case releaseRoom:
		c.releasedRoom.Add(1)
	case releaseExpired:
		c.releasedExpired.Add(1)
	case releaseNChoices:
		c.releasedN.Add(1)
	case releaseRefused:
		c.releasedRefused.Add(1)
	case releaseStoreError:
		c.releasedStoreError.Add(1)
	case releaseOverwritten:
		c.releasedOverwritten.Add(1)
	case releaseFinal:
		c.releasedFinal.Add(1)
	}
}

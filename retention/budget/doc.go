// Package budget manages the decode memory held for retained handles.
//
// With bidirectional KV transfer, a vLLM decode engine keeps every finished
// request's blocks for decoder_kv_blocks_ttl (480 s): pinned, counted as
// used, with no cap. Most of it is never used: in the Mooncake production
// trace, holding everything for 480 s holds 8.8x the memory that ends in a
// reuse. A [Budget] is the router's ledger of those holds by engine
// ([Budget.Add], [Budget.Return], [Budget.End]; [Budget.Usage] reports
// tokens, blocks and ages; blocks that holds share, named by their
// [Hold.Prefix], are counted once, as the engine's prefix cache stores
// them, to [PrefixGranule] tokens and never fewer than the engine
// holds), a learned [Model] of the pause before a
// conversation's next turn, and the choice of what to release when an
// engine's holds go over its budget ([Budget.Victims]): the holds worth
// least, where a hold is worth the prefill time a hit would save × the
// chance its conversation comes back before the hold expires, per block.
//
// The budget is a share of the engine's KV capacity ([WithFraction],
// default half; capacity from [Budget.SetCapacity] or [WithCapacity]).
// Under it nothing is ever released: with free memory, holding costs
// nothing. An engine whose capacity is unknown has no budget.
//
// The model ([Model]) learns per class (tenant and model, [Features.Class])
// from every hold's outcome: the next turn came after some gap, or did not
// come within the horizon ([WithHorizon], 30 min; a hold that expired or
// was released is still watched, so a late next turn counts as a gap and
// the chance of never returning is learned). It conditions on the turn
// number (later turns come back more often: 0.45 vs 0.22 within 480 s in
// the trace) and on a reply ending in tool calls, weighs recent behaviour
// more ([WithHalfLife]), and falls back to the overall figures, then to a
// prior, where a class or a feature has few observations.
// [Budget.Snapshot] reports it for metrics.
//
// The package does no I/O: the caller takes a victim's handle from its
// store (single use, as for a hit: among router replicas sharing a store,
// only the one that takes it releases it), releases it on the engine, and
// passes every time in. Budgets in several processes share one ledger
// through a [Journal] (retention/redisstore's, beside the store), which
// the caller's [Budget.Sync] reads and appends to. examples/bench --replay-trace replays the
// Mooncake trace with it against dropping the oldest hold first and a
// shorter fixed TTL.
package budget

// Package bidikv is the map of an embeddable Go router for vLLM
// prefill/decode disaggregation with bidirectional KV transfer: a decode
// engine keeps a conversation's KV after a turn, and the next turn's
// prefill pulls it back instead of recomputing the whole history.
//
// The packages:
//
//   - kvroute: the Router. kvroute.New(opts...) builds one; Router.Do runs a
//     turn (pick, prefill, decode, capture, store); Router is also an
//     http.Handler for /v1/chat/completions and /v1/completions. Start here.
//   - kvroute/capability: what an engine offers a router (version, render
//     routes, /tokenize, handles per API, prefix caching, KV pool), each
//     fact present, absent or unknown with the evidence and the fix; the
//     proxy's start-up log, /ready, metrics and `bidikv-proxy doctor` read it.
//   - kvroute/otelobserver (its own module): OpenTelemetry for the Router,
//     a kvroute.Tracer and kvroute.Observer: a span per turn and per phase,
//     the trace context on every engine request, and metrics.
//   - kvroute/kvroutetest: simulated vLLM prefill and decode engines that
//     follow the engines' bidirectional-KV rules, failure modes included,
//     and a conformance suite for Store implementations.
//   - retention: where decode handles wait between turns; retention.Memory
//     is the in-process default. retention/redisstore (its own module)
//     shares them across router replicas through Redis.
//   - retention/budget: the decode memory held for those handles: a ledger
//     of holds per decode engine, a model of the pause between turns, and
//     which holds to release when an engine's holds go over its budget.
//   - threshold: whether attaching a retained handle is worth a pull.
//   - transport: upstream HTTP: one tuned transport, per-phase deadlines,
//     retries with backoff, endpoint addresses.
//   - transport/discovery: engine endpoints from DNS (a headless Service's A/AAAA or
//     SRV records), re-resolved on an interval into Router.SetEndpoints.
//   - sse: server-sent-event parsing, pass-through with a flush per event,
//     and the scrubber that removes kv_transfer_params from every answer.
//   - examples/demo: `go run ./examples/demo` shows the win on simulated
//     engines. examples/vllmsim runs a simulated engine as a process.
//
// The wire protocol the router speaks is described in kvroute's package
// documentation.
package bidikv

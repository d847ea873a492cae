// Package sim is the engine behind kvroutetest and examples/vllmsim: a
// simulated vLLM OpenAI-compatible server running the NixlConnector in pull
// mode with bidirectional KV transfer.
//
// The pieces, one file each: a deterministic tokenizer (token.go), a
// ChatML-like chat template (template.go), the KV chain that makes every
// output a function of the KV actually held (kv.go), a paged block pool with
// prefix caching (pool.go), kv_transfer_params handles (handle.go), the side
// channel between engines (peer.go, sidechannel.go), the cost model
// (cost.go), and the HTTP engine itself (engine.go, serve.go, turn.go,
// respond.go).
package sim

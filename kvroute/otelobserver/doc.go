// Package otelobserver traces and measures kvroute turns with
// OpenTelemetry. It is its own module, so that kvroute keeps no tracing
// dependency.
//
// An *Observer is both a kvroute.Tracer and a kvroute.Observer; install it
// with both options (Options returns them):
//
//	o, err := otelobserver.New(
//		otelobserver.WithTracerProvider(tp), // an SDK TracerProvider with an exporter
//		otelobserver.WithMeterProvider(mp))
//	r, err := kvroute.New(append(opts, o.Options()...)...)
//
// # Spans
//
// One turn is one trace segment:
//
//	bidikv.turn            server (internal when Do's context holds a span)
//	├── bidikv.lookup      internal: the Identifier, the Store, verification
//	│   └── bidikv.verify  client: one per render or tokenize call
//	├── bidikv.prefill     client: one per prefill attempt
//	└── bidikv.decode      client: one per decode leg, to its last byte
//	    └── bidikv.stream  internal: a stream, from its first event to its end
//
// The turn span's parent is the span in Do's context or, when there is
// none, the trace context of the client's headers (traceparent, through
// the propagator). Its attributes, set when the turn ends, come from the
// kvroute.TurnRecord: the reuse outcome and miss reason, the reusable,
// verified, handle, prompt and cached tokens, the engines, attempts, TTFT
// and first byte, what was retained, and the failed phase (the span's
// status is then Error); every other field of the record is set as
// bidikv.<key> (durations bidikv.<key>_ms), by the key of its turn tag. Phase spans carry the engine (bidikv.endpoint,
// server.address, server.port) and, when they fail, the error and the
// engine's status (http.response.status_code). A cancelled phase (the client
// went away) is marked bidikv.canceled, not Error.
//
// Every engine request carries its phase span's context (Inject): the
// propagator's headers (traceparent and tracestate by default) are
// replaced, never forwarded from the client, so an engine that traces
// (vLLM's --otlp-traces-endpoint) joins the turn's trace under its phase.
//
// # Metrics
//
// ObserveTurn records, through the MeterProvider: bidikv.turns (turns by
// reuse outcome, miss reason, route and failed phase), bidikv.ttft,
// bidikv.turn.duration, bidikv.prefill.duration and bidikv.decode.first_byte
// (histograms in seconds), bidikv.reuse.tokens (reusable tokens of each
// hit), bidikv.prefill.attempts and bidikv.response.size. ObserveEndpoint
// counts endpoint events (bidikv.endpoint.events).
//
// Nothing is global: the providers and the propagator are given, never
// taken from the otel package's globals.
package otelobserver

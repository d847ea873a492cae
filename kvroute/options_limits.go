package kvroute

import "context"

// Limits bound the bytes a turn takes, so that its memory follows what the
// client and the engines actually sent (docs/kvroute.md, Memory).
type Limits struct {
	// Body bounds a request body accepted by ServeHTTP (a larger one gets
	// 413) and a non-streaming upstream body read by Do (default 32 MiB).
	Body int64
	// Event bounds one event of a decode stream (default 16 MiB: the final
	// chunk of a 1M-token context carries a kv_transfer_params of 62,500
	// block ids in each of two KV groups, about 1 MB, and its token ids).
	// A longer event ends the stream with an error (an *UpstreamError in
	// PhaseStream wrapping sse.ErrEventTooLarge) and nothing is retained.
	Event int
	// Entry bounds one retained entry: the decode handle, its token
	// fingerprint and the Identifier's check (default 8 MiB, also the
	// value bound of the default store; a 1M-token context with two KV
	// groups needs about 1.6 MB). A larger one is not retained
	// (TurnRecord.StoreRefusal "handle_too_large", Stats.TooLarge; logged
	// once). A Store passed with WithStore keeps its own bound; a Put it
	// refuses with an error wrapping retention.ErrTooLarge is counted the
	// same way.
	Entry int
	// ObjectMembers bounds the members of every object in a request body,
	// at any depth, duplicate keys included (default 10,000: far above
	// what the APIs' requests hold, such as a JSON schema's properties or
	// a logit_bias map, far below what an 18 MB body of one-character
	// members would make the router index). A body with a larger object is
	// refused with 400 before the router indexes it, so that the memory a
	// turn takes stays proportional to its body.
	ObjectMembers int
	// ChargeAnswer, when set, is charged the bytes of every decode answer
	// the router holds in memory: a non-streaming answer, and a buffered
	// stream's (WithDecodeMemory's BufferStreams); a stream passed through
	// is not held and not charged. It is called with the turn's context
	// and n > 0 bytes, before they are held: the answer's Content-Length
	// at once when the engine declares one, else each read's bytes as
	// they arrive; it reports whether they fit. When they do not, the
	// answer is dropped (its decode engine keeps a hold it made until its
	// TTL) and the turn fails with an error HTTPStatus maps to 503, with
	// RetryAfter's default, and is not redone. Everything charged to a
	// turn is given back once, as one call with the negated total, when
	// the answer is dropped or the Response closed. Nil (the default):
	// answers are bounded by Body alone.
	ChargeAnswer func(ctx context.Context, n int64) bool
}

// WithLimits sets the limits. A zero field keeps its default
// (Defaults); a negative one is an error.
func WithLimits(l Limits) Option {
	return optionFunc(func(c *config) { c.limits = l })
}

func resolveLimits(c *config) {
	d, l := Defaults().Limits, c.limits
	c.positive("WithLimits", "Body", l.Body)
	c.positive("WithLimits", "Event", int64(l.Event))
	c.positive("WithLimits", "Entry", int64(l.Entry))
	c.positive("WithLimits", "ObjectMembers", int64(l.ObjectMembers))
	c.maxBodyBytes = orDefault(l.Body, d.Body)
	c.maxEventBytes = orDefault(l.Event, d.Event)
	c.maxEntryBytes = orDefault(l.Entry, d.Entry)
	c.maxMembers = orDefault(l.ObjectMembers, d.ObjectMembers)
}

package sse

import "time"

// Event is one block of an SSE stream: the lines up to and including the
// blank line that ends it.
//
// The byte slices of an Event returned by Reader.Next alias the Reader's
// buffers and are valid only until the next call to Next; copy what must be
// kept.
type Event struct {
	// Raw holds the exact bytes of the block, including any blank lines
	// before it and the blank line that ends it. Concatenating Raw of every
	// event returned by a Reader reproduces its input.
	Raw []byte
	// Data is the value of the block's data fields joined with "\n", as the
	// EventSource interface delivers it.
	Data []byte
	// Name is the value of the last event field, empty if there was none.
	Name string
	// ID is the value of the last id field, valid when HasID is set.
	ID string
	// Retry is the reconnection time of the last valid retry field, valid
	// when HasRetry is set.
	Retry time.Duration
	// HasData reports whether the block had at least one data field; only
	// such blocks are dispatched as events by an EventSource.
	HasData bool
	// HasID reports whether the block had an id field without a NUL byte
	// (an empty id resets the last event ID).
	HasID bool
	// HasRetry reports whether the block had a retry field made only of
	// ASCII digits.
	HasRetry bool
	// Comment reports that the block had no field lines: only comments,
	// such as keep-alives (": ping"), or, at the end of the stream, only
	// blank lines. Such blocks are returned so that their bytes can be
	// forwarded; they carry no event.
	Comment bool
	// Incomplete reports that the stream ended before the blank line that
	// ends this block: Raw lacks it. A client discards such a block (the
	// SSE rule), and ScrubEvent never forwards it; a Reader returns it as
	// a final event so that Raw still reproduces the input.
	Incomplete bool
	// BOM reports that Raw starts with the byte order mark of the
	// stream's start, which the Reader ignored (a byte order mark
	// anywhere else is part of a field name).
	BOM bool
}

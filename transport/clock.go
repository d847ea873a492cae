package transport

import "time"

// clock starts the deadline timers of a [Client]; tests replace it with a
// virtual one.
type clock interface {
	AfterFunc(d time.Duration, f func()) timer
}

// timer is the part of *time.Timer that deadlines use.
type timer interface {
	Stop() bool
	Reset(d time.Duration) bool
}

type realClock struct{}

func (realClock) AfterFunc(d time.Duration, f func()) timer { return time.AfterFunc(d, f) }

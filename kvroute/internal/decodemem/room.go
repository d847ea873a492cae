// Package decodemem holds parts of kvroute's decode memory management
// (DecodeMemory) that keep their own state: what each principal may
// release of other tenants' holds on arrival (RoomLimits), and what was
// last read of each decode engine's pressure (Pressure).
package decodemem

import (
	"sync"
	"time"
)

// MaxPrincipals bounds the principals whose use of RoomRate is
// remembered: those that released other tenants' holds within the last
// minute. Past it, the principal idle longest is forgotten (its allowance
// full again).
const MaxPrincipals = 4096

// RoomLimits is each principal's allowance for releasing other tenants'
// holds on arrival (kvroute's DecodeMemory RoomRate): a token bucket of
// capacity shares, refilled at Rate a minute up to Rate (negative: no
// limit). A principal not in the map has a full bucket. Safe for
// concurrent use once Rate is set.
type RoomLimits struct {
	Rate float64
	mu   sync.Mutex
	m    map[string]bucket
}

type bucket struct {
	level float64 // shares of capacity left at at
	at    time.Time
}

// level is b's allowance at now, in shares of capacity.
func (l *RoomLimits) level(b bucket, now time.Time) float64 {
	return min(b.level+l.Rate*max(now.Sub(b.at), 0).Minutes(), l.Rate)
}

// Allowance is what principal may release of other tenants' holds on an
// engine of capacity tokens now; -1: no limit.
func (l *RoomLimits) Allowance(principal string, capacity int64, now time.Time) int64 {
	if l.Rate < 0 || capacity <= 0 {
		return -1
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	lv := l.Rate
	if b, ok := l.m[principal]; ok {
		lv = l.level(b, now)
	}
	return int64(max(lv, 0) * float64(capacity))
}

// Charge counts tokens of other tenants' holds released for principal on
// an engine of capacity tokens.
func (l *RoomLimits) Charge(principal string, tokens, capacity int64, now time.Time) {
	if l.Rate < 0 || tokens <= 0 || capacity <= 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	b, ok := l.m[principal]
	lv := l.Rate
	if ok {
		lv = l.level(b, now)
	} else {
		l.makeSpace(now)
	}
	if l.m == nil {
		l.m = map[string]bucket{}
	}
	l.m[principal] = bucket{level: lv - float64(tokens)/float64(capacity), at: now}
}

// makeSpace forgets the principals whose bucket is full again, and, the
// map still full, the one idle longest. l.mu held.
func (l *RoomLimits) makeSpace(now time.Time) {
	if len(l.m) < MaxPrincipals {
		return
	}
	oldest, at := "", now
	for p, b := range l.m {
		if l.level(b, now) >= l.Rate {
			delete(l.m, p)
		} else if b.at.Before(at) {
			oldest, at = p, b.at
		}
	}
	if len(l.m) >= MaxPrincipals {
		delete(l.m, oldest)
	}
}

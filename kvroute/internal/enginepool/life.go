package enginepool

import (
	"sync"
	"time"
)

// Life is what kvroute knows of one decode engine's process, for its
// restart detection (kvroute's restart.go says how it learns it): the
// engine id of its latest handle, its process start
// (process_start_time_seconds), when that was last read, and the last
// failure to reach it. The zero value knows nothing; it is safe for
// concurrent use.
type Life struct {
	mu       sync.Mutex
	engineID string    // the engine id of its latest handle, without "_dp<k>"
	start    time.Time // process_start_time_seconds; zero when unknown
	checked  time.Time // when /metrics was last read; zero: never
	gap      time.Time // the last failure to reach the engine; zero: none
	noMetric bool      // its last /metrics had no process_start_time_seconds
	// unread: the last read of /metrics failed, at checked; it is not
	// tried again (and the engine's handles are not attached) until the
	// reading is maxAge old, so that an engine that does not answer costs
	// one read per interval, not one per turn.
	unread bool
}

// BaseEngineID strips vLLM's data-parallel suffix "_dp<k>" from id: the
// ranks of one engine share the rest, which a restart changes.
func BaseEngineID(id string) string {
	for i := len(id) - 1; i >= 0; i-- {
		c := id[i]
		if c >= '0' && c <= '9' {
			continue
		}
		if i < len(id)-1 && i > 2 && id[i-2:i+1] == "_dp" {
			return id[:i-2]
		}
		break
	}
	return id
}

// MarkGap records a failure to reach the engine at now.
func (l *Life) MarkGap(now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if now.After(l.gap) {
		l.gap = now
	}
}

// SawEngineID records the engine id of a handle the engine just returned
// (BaseEngineID of it, not empty) and reports whether it differs from the
// one before: a restart.
func (l *Life) SawEngineID(id string) (restarted bool) {
	l.mu.Lock()
	prev := l.engineID
	l.engineID = id
	l.mu.Unlock()
	return prev != "" && prev != id
}

// OtherID reports whether id, a handle's base engine id, is not the
// latest one the engine returned: the handle is from another process.
func (l *Life) OtherID(id string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.engineID != "" && id != "" && id != l.engineID
}

// Fresh reports, at now, whether the last reading is younger than maxAge
// and no failure to reach the engine came after it (fresh), and whether
// that reading failed (unread: not to be tried again yet).
func (l *Life) Fresh(now time.Time, maxAge time.Duration) (fresh, unread bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	recent := !l.checked.IsZero() && now.Sub(l.checked) < maxAge
	return recent && !l.gap.After(l.checked), recent && l.unread
}

// Unreadable records a failed read at now: a gap too.
func (l *Life) Unreadable(now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.checked, l.unread = now, true
	if now.After(l.gap) {
		l.gap = now
	}
}

// Record records a successful read made at now, which had the process
// start start (ok) or none, and reports whether the start changed: a
// restart. A read older than the one recorded is ignored.
func (l *Life) Record(now, start time.Time, ok bool) (changed bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if now.Before(l.checked) {
		return false // a later reading is already recorded
	}
	l.checked, l.unread = now, false
	l.noMetric = !ok
	if ok {
		changed = !l.start.IsZero() && !start.Equal(l.start)
		l.start = start
		if !l.gap.After(now) {
			l.gap = time.Time{} // the reading explains the gap
		}
	}
	return changed
}

// NoMetric reports whether the last reading had no process start.
func (l *Life) NoMetric() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.noMetric
}

// Start returns the last plausible process start; zero when unknown.
func (l *Life) Start() time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.start
}

// StartedAfter reports whether what is known says the engine's process
// may have restarted since created: it started after, or, with no start
// time to tell a restart from a network failure, the engine could not be
// reached after created.
func (l *Life) StartedAfter(created time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.start.IsZero() && created.Before(l.start) {
		return true
	}
	return (l.start.IsZero() || l.noMetric) && !l.gap.IsZero() && created.Before(l.gap)
}

// RestartedSince reports whether what is known, without asking, says the
// process that issued a handle with base engine id id, created at
// created, is gone: another engine id since, or a process start after.
func (l *Life) RestartedSince(created time.Time, id string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return (l.engineID != "" && id != "" && id != l.engineID) || (!l.start.IsZero() && created.Before(l.start))
}

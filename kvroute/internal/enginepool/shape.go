package enginepool

import (
	"sync"
	"time"
)

// Shape is what kvroute knows of one engine's KV layout (kvroute's
// shape.go says how it learns it): the block size its /metrics reported,
// when that was read, the KV groups of its last handle that fitted, and
// a block size a handle of it did not fit. The zero value knows nothing;
// it is safe for concurrent use.
type Shape struct {
	mu     sync.Mutex
	size   int       // the block size its /metrics reported; 0 unknown
	read   time.Time // when its last read ended; zero: read at the next use
	noInfo bool      // its last /metrics had no cache configuration
	groups int       // the KV groups of its last handle that fitted its size
	// misfit is the block size a handle of the engine did not fit (0:
	// none), since misfitAt, and why.
	misfit   int
	misfitAt time.Time
	why      string
}

// Due reports whether the block size is to be read at now: unknown, or
// a handle did not fit it, and the last read is retry old (noInfo after
// an answer without a cache configuration).
func (s *Shape) Due(now time.Time, retry, noInfo time.Duration) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.size > 0 && s.misfit != s.size {
		return false
	}
	wait := retry
	if s.noInfo {
		wait = noInfo
	}
	return s.read.IsZero() || now.Sub(s.read) >= wait || now.Before(s.read)
}

// Size returns the block size the engine reported (0: unknown) and the
// KV groups of its last handle that fitted it (0: none yet).
func (s *Shape) Size() (size, groups int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.size, s.groups
}

// Record records a read at now (ok: the engine answered) that found the
// block size size (0: none).
func (s *Shape) Record(now time.Time, size int, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.read = now
	if ok {
		s.noInfo = size == 0
	}
	if size > 0 {
		s.size = size
	}
}

// Fits records that a handle fitted the block size, with groups KV groups.
func (s *Shape) Fits(groups int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.groups = groups
	s.misfit, s.why = 0, ""
}

// Misfits records that a handle did not fit size at now, and why; the size
// is read again at the next use when the last read is retry old.
func (s *Shape) Misfits(size int, why string, now time.Time, retry time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.misfit, s.misfitAt, s.why = size, now, why
	if now.Sub(s.read) >= retry {
		s.read = time.Time{}
	}
}

// NoReuse returns why the engine serves without reuse at now ("" when it
// does not): a handle did not fit size, the block size it still has,
// within window.
func (s *Shape) NoReuse(size int, now time.Time, window time.Duration) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.misfit == 0 || s.misfit != size || now.Sub(s.misfitAt) >= window || now.Before(s.misfitAt) {
		return ""
	}
	return s.why
}

// Forget drops what is known (a restart: the engine may run with another
// block size now).
func (s *Shape) Forget() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.size, s.read, s.groups, s.misfit, s.why = 0, time.Time{}, 0, 0, ""
}

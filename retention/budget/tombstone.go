package budget

import "hash/maphash"

// tombstones remember holds that ended without their conversation's next
// turn (expired, released, ended by the caller) for the horizon, so that a
// next turn that comes later is still observed as a gap, and one that does
// not come is observed as censored at the horizon. Each costs about 70
// bytes (BenchmarkRetained): a map slot (a 64-bit hash of the key, as the
// key itself is not kept, and the record) and a queue entry. Two keys
// with the same hash, about one chance in 10^9 among 200,000 remembered
// holds, share a record: one of them counts as censored early.
type tombstones struct {
	seed maphash.Seed
	m    map[uint64]tomb
	q    deadlineQueue[uint64] // by deadline, as holds end in time order
}

type tomb struct {
	created  int64 // UnixNano
	deadline int64 // UnixNano: end + horizon
	cell     uint32
}

func newTombstones() tombstones {
	return tombstones{seed: maphash.MakeSeed(), m: map[uint64]tomb{}}
}

func (t *tombstones) hash(key string) uint64 { return maphash.String(t.seed, key) }

// add remembers key's hold until deadline; it returns the tomb it
// replaced, if any.
func (t *tombstones) add(key string, tb tomb) (tomb, bool) {
	h := t.hash(key)
	old, ok := t.m[h]
	t.m[h] = tb
	t.q.push(h, tb.deadline)
	return old, ok
}

// peek returns key's tomb.
func (t *tombstones) peek(key string) (tomb, bool) {
	tb, ok := t.m[t.hash(key)]
	return tb, ok
}

// take removes and returns key's tomb.
func (t *tombstones) take(key string) (tomb, bool) {
	h := t.hash(key)
	tb, ok := t.m[h]
	if ok {
		delete(t.m, h)
	}
	return tb, ok
}

// due calls f for, and removes, each tomb whose deadline is at or before
// now (a tomb taken or replaced since is skipped).
func (t *tombstones) due(now int64, f func(tomb)) {
	t.q.expire(now, func(h uint64, deadline int64) {
		if tb, ok := t.m[h]; ok && tb.deadline == deadline {
			delete(t.m, h)
			f(tb)
		}
	})
}

func (t *tombstones) len() int { return len(t.m) }

package budget

// deadlineQueue is the queue of keys by deadline behind the ledger's
// timed records (tombstones, the prefill records, the journal's pending
// ends): each is pushed with a deadline at or after the ones before it
// (now plus a fixed span), and expire drains the queue's front as time
// passes, compacting it once most of it is drained. A record replaced or
// removed since it was pushed is recognised by its caller (its deadline
// differs, or it is gone), so nothing is ever searched for in the queue.
type deadlineQueue[K comparable] struct {
	q    []deadlineRef[K]
	head int
}

type deadlineRef[K comparable] struct {
	key      K
	deadline int64 // UnixNano
}

// push queues key until deadline.
func (d *deadlineQueue[K]) push(key K, deadline int64) {
	d.q = append(d.q, deadlineRef[K]{key: key, deadline: deadline})
}

// expire calls drop, in queue order, for each key whose deadline is at or
// before now, and forgets it.
func (d *deadlineQueue[K]) expire(now int64, drop func(key K, deadline int64)) {
	for d.head < len(d.q) && d.q[d.head].deadline <= now {
		r := d.q[d.head]
		d.q[d.head] = deadlineRef[K]{}
		d.head++
		drop(r.key, r.deadline)
	}
	if d.head > 1024 && d.head*2 > len(d.q) {
		n := copy(d.q, d.q[d.head:])
		clear(d.q[n:])
		d.q = d.q[:n]
		d.head = 0
	}
}

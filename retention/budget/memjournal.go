package budget

import (
	"context"
	"strconv"
	"sync"
)

var _ Journal = (*MemoryJournal)(nil)

// MemoryJournal is a [Journal] in memory, for tests and for Budgets of one
// process that stand for several: Budgets sharing one behave as the
// ledgers of processes sharing a journal. It keeps every record until
// [MemoryJournal.Trim]. The zero value is ready to use.
type MemoryJournal struct {
	mu      sync.Mutex
	records [][]byte
	first   int // the position of records[0]
	fail    error
}

// Append adds records, copied, at the end; it fails with the error of
// [MemoryJournal.Fail].
func (m *MemoryJournal) Append(ctx context.Context, records [][]byte) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.fail != nil {
		return m.fail
	}
	for _, r := range records {
		m.records = append(m.records, append([]byte(nil), r...))
	}
	return nil
}

// Read returns at most n records after cursor (a position; "": from
// the oldest kept); it fails with the error of [MemoryJournal.Fail].
func (m *MemoryJournal) Read(ctx context.Context, cursor string, n int) ([][]byte, string, error) {
	if err := ctx.Err(); err != nil {
		return nil, cursor, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.fail != nil {
		return nil, cursor, m.fail
	}
	pos := 0
	if cursor != "" {
		p, err := strconv.Atoi(cursor)
		if err != nil {
			return nil, cursor, err
		}
		pos = p
	}
	i := max(min(len(m.records), pos-m.first), 0)
	j := min(len(m.records), i+max(n, 0))
	out := make([][]byte, j-i)
	copy(out, m.records[i:j])
	if j == i {
		return out, strconv.Itoa(max(pos, m.first+i)), nil
	}
	return out, strconv.Itoa(m.first + j), nil
}

// Len returns the records kept.
func (m *MemoryJournal) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.records)
}

// Trim drops the oldest records, keeping the last keep.
func (m *MemoryJournal) Trim(keep int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if drop := len(m.records) - keep; drop > 0 {
		m.records = append([][]byte(nil), m.records[drop:]...)
		m.first += drop
	}
}

// Fail makes Append and Read fail with err from now on (nil: succeed
// again), as a journal that went away would.
func (m *MemoryJournal) Fail(err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.fail = err
}

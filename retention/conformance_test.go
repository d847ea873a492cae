package retention_test

import (
	"testing"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/retention"
)

var _ kvroute.Store = (*retention.Memory)(nil)

func TestMemoryConformance(t *testing.T) {
	kvroutetest.TestStore(t, func(t *testing.T) kvroute.Store {
		m, err := retention.NewMemory()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = m.Close() })
		return m
	})
}

func TestMemoryConformanceSmall(t *testing.T) {
	// The suite's largest value is 32 KiB and it holds up to 256 entries at
	// once (ConcurrentKeys: 8 workers x 32 keys).
	kvroutetest.TestStore(t, func(t *testing.T) kvroute.Store {
		m, err := retention.NewMemory(retention.WithMaxEntries(300), retention.WithMaxValueSize(32<<10))
		if err != nil {
			t.Fatal(err)
		}
		return m
	})
}

func TestMemoryConformanceSmallBytes(t *testing.T) {
	// The suite holds at most 256 small entries at once (about 450 bytes
	// each, overhead included, about 113 KiB) or one 32 KiB value: 192 KiB
	// holds either, and evicts nothing the suite expects to find.
	kvroutetest.TestStore(t, func(t *testing.T) kvroute.Store {
		m, err := retention.NewMemory(retention.WithMaxBytes(192 << 10))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if st, n := m.Stats(), m.Bytes(); st.EvictedForBytes != 0 || n > st.MaxBytes {
				t.Errorf("byte bound: %d bytes, %+v", n, st)
			}
			_ = m.Close()
		})
		return m
	})
}

package retention_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/retention"
)

// NewMemory validates as kvroute.New does: after every option is applied,
// every bad option is reported (joined), each wrapping ErrInvalidConfig
// and naming the option; nothing is clamped.
func TestNewMemoryValidation(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts []retention.MemoryOption
		want []string
	}{
		{"entries", []retention.MemoryOption{retention.WithMaxEntries(0)}, []string{"WithMaxEntries"}},
		{"entries over the limit", []retention.MemoryOption{retention.WithMaxEntries(retention.MaxEntriesLimit + 1)}, []string{"WithMaxEntries"}},
		{"value", []retention.MemoryOption{retention.WithMaxValueSize(-1)}, []string{"WithMaxValueSize"}},
		{"bytes", []retention.MemoryOption{retention.WithMaxBytes(retention.EntryOverhead - 1)}, []string{"WithMaxBytes"}},
		{"all at once", []retention.MemoryOption{retention.WithMaxEntries(-1), retention.WithMaxValueSize(0), retention.WithMaxBytes(0)},
			[]string{"WithMaxEntries", "WithMaxValueSize", "WithMaxBytes"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := retention.NewMemory(tc.opts...)
			require.Error(t, err)
			assert.Nil(t, m)
			assert.ErrorIs(t, err, retention.ErrInvalidConfig)
			for _, w := range tc.want {
				assert.Contains(t, err.Error(), w)
			}
		})
	}
	// A later option overrides an earlier bad one: validation runs once,
	// after all of them.
	m, err := retention.NewMemory(retention.WithMaxEntries(0), retention.WithMaxEntries(5))
	require.NoError(t, err)
	require.NoError(t, m.Close())
}

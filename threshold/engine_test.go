package threshold_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/threshold"
)

func TestInputCount(t *testing.T) {
	tests := []struct {
		name string
		in   threshold.Input
		want int
	}{
		{"all unknown", threshold.Input{RemoteTokens: 100}, 100},
		{"prompt shorter than remote", threshold.Input{RemoteTokens: 100, PromptTokens: 80}, 80},
		{"prompt longer than remote", threshold.Input{RemoteTokens: 100, PromptTokens: 120}, 100},
		{"cached subtracted", threshold.Input{RemoteTokens: 100, PromptTokens: 120, CachedTokens: 30}, 70},
		{"cached without prompt", threshold.Input{RemoteTokens: 100, CachedTokens: 30}, 70},
		{"cached covers all", threshold.Input{RemoteTokens: 100, CachedTokens: 100}, 0},
		{"cached beyond remote", threshold.Input{RemoteTokens: 100, CachedTokens: 150}, -50},
		{"negative prompt is unknown", threshold.Input{RemoteTokens: 100, PromptTokens: -5}, 100},
		{"negative cached is unknown", threshold.Input{RemoteTokens: 100, CachedTokens: -5}, 100},
		{"no remote tokens", threshold.Input{}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, tt.in.Count())
		})
	}
}

func TestEngineReuse(t *testing.T) {
	tests := []struct {
		name      string
		threshold int
		in        threshold.Input
		want      bool
	}{
		{"one below threshold recomputes", 64, threshold.Input{RemoteTokens: 63}, false},
		{"at threshold pulls", 64, threshold.Input{RemoteTokens: 64}, true},
		{"above threshold pulls", 64, threshold.Input{RemoteTokens: 65}, true},
		{"prompt caps count below threshold", 64, threshold.Input{RemoteTokens: 500, PromptTokens: 63}, false},
		{"prompt caps count at threshold", 64, threshold.Input{RemoteTokens: 500, PromptTokens: 64}, true},
		{"cached hit drops count below threshold", 64, threshold.Input{RemoteTokens: 127, PromptTokens: 200, CachedTokens: 64}, false},
		{"cached hit leaves count at threshold", 64, threshold.Input{RemoteTokens: 128, PromptTokens: 200, CachedTokens: 64}, true},
		{"unknown prompt uses remote minus cached", 64, threshold.Input{RemoteTokens: 100, CachedTokens: 37}, false},
		{"unknown prompt and cache uses remote", 64, threshold.Input{RemoteTokens: 1000}, true},
		{"fully cached never pulls", 64, threshold.Input{RemoteTokens: 1000, PromptTokens: 2000, CachedTokens: 1000}, false},
		{"zero remote never pulls", 64, threshold.Input{}, false},
		{"negative remote never pulls", 0, threshold.Input{RemoteTokens: -1}, false},
		{"threshold zero pulls one token", 0, threshold.Input{RemoteTokens: 1}, true},
		{"threshold zero still needs a positive count", 0, threshold.Input{RemoteTokens: 10, CachedTokens: 10}, false},
		{"threshold one pulls one token", 1, threshold.Input{RemoteTokens: 1}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := threshold.Engine(tt.threshold)
			require.NoError(t, err)
			assert.Equal(t, tt.want, p.Reuse(tt.in))
		})
	}
}

func TestEngineRejectsNegative(t *testing.T) {
	for _, n := range []int{-1, -64} {
		p, err := threshold.Engine(n)
		assert.ErrorIs(t, err, threshold.ErrNegativeThreshold)
		assert.Nil(t, p)
	}
}

func TestDefault(t *testing.T) {
	p := threshold.Default()
	assert.False(t, p.Reuse(threshold.Input{RemoteTokens: threshold.DefaultThreshold - 1}))
	assert.True(t, p.Reuse(threshold.Input{RemoteTokens: threshold.DefaultThreshold}))
}

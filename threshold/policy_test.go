package threshold_test

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/bidikv/bidikv/threshold"
)

func TestAlwaysNever(t *testing.T) {
	inputs := []threshold.Input{
		{},
		{RemoteTokens: 1},
		{RemoteTokens: 1000, PromptTokens: 10, CachedTokens: 10},
	}
	for _, in := range inputs {
		assert.True(t, threshold.Always().Reuse(in), "Always with %+v", in)
		assert.False(t, threshold.Never().Reuse(in), "Never with %+v", in)
	}
}

func TestFunc(t *testing.T) {
	var got threshold.Input
	p := threshold.Func(func(in threshold.Input) bool {
		got = in
		return in.RemoteTokens%2 == 0
	})
	in := threshold.Input{RemoteTokens: 4, PromptTokens: 5, CachedTokens: 6}
	assert.True(t, p.Reuse(in))
	assert.Equal(t, in, got)
	assert.False(t, p.Reuse(threshold.Input{RemoteTokens: 3}))
}

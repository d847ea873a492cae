package enginepool

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestBaseEngineID(t *testing.T) {
	for in, want := range map[string]string{
		"sim-3e366871e9cf":      "sim-3e366871e9cf",
		"sim-3e366871e9cf_dp0":  "sim-3e366871e9cf",
		"d-fixed_dp12":          "d-fixed",
		"x_dp":                  "x_dp",
		"_dp3":                  "_dp3",
		"a_dpx3":                "a_dpx3",
		"1f5f6e0d-uuid-like-id": "1f5f6e0d-uuid-like-id",
		"":                      "",
	} {
		assert.Equal(t, want, BaseEngineID(in), in)
	}
}

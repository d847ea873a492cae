package kvhandle

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/internal/toytok"
)

// ResetAnswer reads the block list of the handle an answer's Get returns,
// and only of that one.
func TestResetAnswer(t *testing.T) {
	good := string(toytok.Handle(1, 100, 16))
	bad := strings.Replace(good, "[[", "[[-1,", 1)
	for _, c := range []struct {
		name   string
		answer string
		known  bool
		valid  bool
	}{
		{"one handle", `{"id":"x","kv_transfer_params":` + good + `,"usage":{}}`, true, true},
		{"an invalid list", `{"kv_transfer_params":` + bad + `}`, false, false},
		{"a later handle wins", `{"kv_transfer_params":` + good + `,"kv_transfer_params":` + bad + `}`, false, false},
		{"a later handle without a list", `{"kv_transfer_params":` + good + `,"kv_transfer_params":{"remote_engine_id":"e"}}`, false, false},
		{"a nested handle is not the answer's", `{"choices":[{"kv_transfer_params":` + good + `}]}`, false, false},
		{"the list named twice", `{"kv_transfer_params":` + strings.Replace(good, `"remote_engine_id"`, `"remote_block_ids":[[1]],"remote_engine_id"`, 1) + `}`, false, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			var obj jsonraw.Object
			known, err := ResetAnswer(&obj, []byte(c.answer))
			require.NoError(t, err)
			assert.Equal(t, c.known, known.End > 0, "%+v", known)
			h, ok := obj.Get(Key)
			if !ok {
				return
			}
			_, err = CheckKnown(h, 16, known)
			assert.Equal(t, c.valid, err == nil, "%v", err)
			_, plain := Check(h, 16)
			assert.Equal(t, plain == nil, err == nil, "the same verdict as Check")
		})
	}
}

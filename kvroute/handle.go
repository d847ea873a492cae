package kvroute

import (
	"context"
	"errors"
	"log/slog"

	"github.com/bidikv/bidikv/kvroute/internal/kvhandle"
)

// The kv_transfer_params member name.
const kvKey = kvhandle.Key

var (
	jsonTrue  = []byte("true")
	jsonFalse = []byte("false")
	jsonOne   = []byte("1")
)

var errStop = errors.New("stop")

// invalidHandle counts a handle checkHandle refused as invalid, in phase
// (PhasePrefill: P's handle; PhaseDecode: D's, not retained; PhaseLookup:
// a retained one, not attached), and logs it once per phase and member.
func (r *Router) invalidHandle(phase Phase, endpoint string, err error) {
	r.stats.invalidHandles.Add(1)
	r.log.once(context.Background(), "invalid_handle:"+string(phase)+":"+kvhandle.InvalidMember(err),
		"kvroute: a KV handle holds a value vLLM cannot read correctly; it is refused (see Stats.InvalidHandles)",
		slog.String("phase", string(phase)), slog.String("endpoint", endpoint), slog.String("err", err.Error()))
}

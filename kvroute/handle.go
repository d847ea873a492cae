package kvroute

import (
	"errors"

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

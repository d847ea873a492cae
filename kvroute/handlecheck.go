package kvroute

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strconv"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// Handle validation. An engine's handle is JSON that vLLM reads with
// Python's json module into a dict and then uses as typed values: the
// block ids become numpy indices into the KV descriptors, the port a
// socket address, remote_num_tokens a token count that sizes the read. A
// value of another type or out of range is not refused there: a negative
// block id silently indexes another block, 1e999 becomes a float infinity,
// a group with fewer blocks than remote_num_tokens needs trips the
// worker's assert len(local) <= len(remote) and kills the engine. So every
// handle the router captures (a prefill engine's, before it goes to D; a
// decode engine's, before it is retained) and every handle it attaches
// goes through checkHandle, and one that vLLM could not read correctly is
// refused (Stats.InvalidHandles, logged once per reason).

// errInvalidHandle is wrapped by every checkHandle error about a member
// that is present with a type or value vLLM cannot use.
var errInvalidHandle = errors.New("kvroute: invalid KV handle")

// maxBlockID bounds a block id: ids index an engine's KV blocks, whose
// count is far below 2^31 on any device.
const maxBlockID = math.MaxInt32

// maxHandleCount bounds remote_num_tokens, tp_size, dcp_size and pp_size.
const maxHandleCount = math.MaxInt32

// handleKeys are the members the router checks; any other member is
// forwarded as the engine wrote it.
var handleKeys = [...]string{
	"do_remote_decode", "do_remote_prefill", "remote_block_ids", "remote_engine_id", "remote_request_id",
	"remote_host", "remote_port", "tp_size", "remote_num_tokens", "remote_blocks_expiry_time",
	"dcp_size", "pp_size", "transfer_mode",
}

// handleError is a checkHandle error about one member.
type handleError struct {
	key, why string
}

func (e *handleError) Error() string { return errInvalidHandle.Error() + ": " + e.key + " " + e.why }
func (e *handleError) Unwrap() error { return errInvalidHandle }

// invalid returns the error for member key, which vLLM could not read.
func invalid(key, format string, args ...any) error {
	return &handleError{key: key, why: fmt.Sprintf(format, args...)}
}

// invalidMember returns the member an invalid-handle error is about ("" for
// any other error), a bounded key for logging once.
func invalidMember(err error) string {
	var he *handleError
	if errors.As(err, &he) {
		return he.key
	}
	return ""
}

// checkHandle checks raw, an engine's kv_transfer_params, and reads what
// the router needs from it. It returns errUnusableHandle for a handle an
// engine ignores (remote_engine_id, remote_request_id, remote_host or
// remote_port absent or null, remote_block_ids absent or empty), and an
// error wrapping errInvalidHandle for one vLLM would misread:
//
//   - a member named twice (parsers disagree on which one counts);
//   - do_remote_decode or do_remote_prefill other than a boolean or null;
//   - remote_engine_id, remote_request_id, remote_host or transfer_mode
//     other than a string (the first three non-empty);
//   - remote_port other than an integer from 1 to 65535;
//   - remote_block_ids other than a list of integer lists (one per KV
//     group), or a flat list of integers (very old engines); every id an
//     integer literal from 0 to 2^31-1 (no sign, fraction or exponent);
//   - remote_num_tokens, tp_size, dcp_size or pp_size other than an
//     integer (remote_num_tokens at least 0, the others at least 1) or
//     null;
//   - remote_blocks_expiry_time other than a finite number or null;
//   - with blockSize > 0 and remote_num_tokens R > 0: fewer than
//     ceil(R/blockSize) blocks in its longest group (the full-attention
//     groups hold one block per blockSize tokens; sliding-window groups,
//     shorter, keep only the window's tail).
//
// It does not copy raw.
func checkHandle(raw []byte, blockSize int) (handleInfo, error) {
	var hi handleInfo
	obj, err := jsonraw.Parse(raw)
	if err != nil {
		return hi, invalid("kv_transfer_params", "is not a JSON object")
	}
	if k, dup := obj.Duplicate(); dup {
		return hi, invalid(k, "is given twice")
	}
	for _, k := range [...]string{"do_remote_decode", "do_remote_prefill"} {
		if v, ok := obj.Get(k); ok && !jsonraw.IsNull(v) {
			if _, isBool := jsonraw.Bool(v); !isBool {
				return hi, invalid(k, "is not a boolean")
			}
		}
	}
	for _, k := range [...]string{"remote_engine_id", "remote_request_id", "remote_host"} {
		v, ok := obj.Get(k)
		if !ok || jsonraw.IsNull(v) {
			return hi, errUnusableHandle
		}
		// A parsed value that opens with a quote is a string; "" is empty.
		if len(v) < 3 || v[0] != '"' {
			return hi, invalid(k, "is not a non-empty string")
		}
	}
	port, ok := obj.Get("remote_port")
	if !ok || jsonraw.IsNull(port) {
		return hi, errUnusableHandle
	}
	if p, isInt := jsonraw.Int(port); !isInt || p < 1 || p > 65535 {
		return hi, invalid("remote_port", "is not a port from 1 to 65535")
	}
	if v, ok := obj.Get("transfer_mode"); ok && !jsonraw.IsNull(v) {
		s, isStr := jsonraw.String(v)
		if !isStr {
			return hi, invalid("transfer_mode", "is not a string")
		}
		hi.pushMode = s == "push"
	}
	counts := [...]struct {
		key string
		min int64
	}{{"remote_num_tokens", 0}, {"tp_size", 1}, {"dcp_size", 1}, {"pp_size", 1}}
	for _, c := range counts {
		v, ok := obj.Get(c.key)
		if !ok || jsonraw.IsNull(v) {
			continue
		}
		n, isInt := jsonraw.Int(v)
		if !isInt || n < c.min || n > maxHandleCount {
			return hi, invalid(c.key, "is not an integer from %d to %d", c.min, maxHandleCount)
		}
		if c.key == "remote_num_tokens" {
			hi.tokens = int(n)
		}
	}
	if v, ok := obj.Get("remote_blocks_expiry_time"); ok && !jsonraw.IsNull(v) {
		if !finiteNumber(v) {
			return hi, invalid("remote_blocks_expiry_time", "is not a finite number")
		}
	}
	blocks, ok := obj.Get("remote_block_ids")
	if !ok || jsonraw.IsNull(blocks) {
		return hi, errUnusableHandle
	}
	longest, err := blockGroups(blocks)
	if err != nil {
		return hi, err
	}
	if longest == 0 {
		return hi, errUnusableHandle
	}
	if blockSize > 0 && hi.tokens > 0 {
		if need := (hi.tokens + blockSize - 1) / blockSize; longest < need {
			return hi, invalid("remote_block_ids", "holds %d blocks, fewer than remote_num_tokens %d needs at block size %d (%d; check WithBlockSize)",
				longest, hi.tokens, blockSize, need)
		}
	}
	return hi, nil
}

// blockGroups checks remote_block_ids (a list of integer lists, or a flat
// list of integers) and returns the length of its longest group.
func blockGroups(v []byte) (int, error) {
	if len(v) == 0 || v[0] != '[' {
		return 0, invalid("remote_block_ids", "is not a list")
	}
	nested, flat, longest, n := false, false, 0, 0
	err := jsonraw.Elements(v, func(e []byte) error {
		if len(e) > 0 && e[0] == '[' {
			nested = true
			k := 0
			err := jsonraw.Elements(e, func(id []byte) error {
				if !blockID(id) {
					return invalid("remote_block_ids", "holds %.24q, not a block id from 0 to %d", id, maxBlockID)
				}
				k++
				return nil
			})
			if err != nil {
				return err
			}
			longest = max(longest, k)
			return nil
		}
		flat = true
		if !blockID(e) {
			return invalid("remote_block_ids", "holds %.24q, not a block id from 0 to %d", e, maxBlockID)
		}
		n++
		return nil
	})
	switch {
	case errors.Is(err, errInvalidHandle):
		return 0, err
	case err != nil:
		return 0, invalid("remote_block_ids", "is not a list")
	case nested && flat:
		return 0, invalid("remote_block_ids", "mixes block ids and groups")
	case flat:
		return n, nil
	}
	return longest, nil
}

// blockID reports whether e is an integer literal from 0 to maxBlockID.
func blockID(e []byte) bool {
	if len(e) == 0 || len(e) > 10 || (len(e) > 1 && e[0] == '0') {
		return false
	}
	var v uint64
	for _, c := range e {
		if c < '0' || c > '9' {
			return false
		}
		v = v*10 + uint64(c-'0')
	}
	return v <= maxBlockID
}

// finiteNumber reports whether v is a JSON number that is finite as a
// float64 (1e999 is a valid JSON number that Python reads as infinity).
func finiteNumber(v []byte) bool {
	if len(v) == 0 || (v[0] != '-' && (v[0] < '0' || v[0] > '9')) {
		return false
	}
	f, err := strconv.ParseFloat(string(v), 64)
	return err == nil && !math.IsInf(f, 0) && !math.IsNaN(f)
}

// invalidHandle counts a handle checkHandle refused as invalid, in phase
// (PhasePrefill: P's handle; PhaseDecode: D's, not retained; PhaseLookup:
// a retained one, not attached), and logs it once per phase and member.
func (r *Router) invalidHandle(phase Phase, endpoint string, err error) {
	r.stats.invalidHandles.Add(1)
	r.logOnce(context.Background(), "invalid_handle:"+string(phase)+":"+invalidMember(err),
		"kvroute: a KV handle holds a value vLLM cannot read correctly; it is refused (see Stats.InvalidHandles)",
		slog.String("phase", string(phase)), slog.String("endpoint", endpoint), slog.String("err", err.Error()))
}

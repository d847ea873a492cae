package kvhandle

import (
	"errors"
	"strconv"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// The validation Check did before it read block lists in one pass (with a
// callback per block id) and its members in one pass (with a Get per
// member), kept as the oracle of FuzzCheckHandle: Check must accept and
// refuse exactly what it did, with the same sentinel, member and Info.

// checkElements is the former Check.
func checkElements(raw []byte, blockSize int) (Info, error) {
	var hi Info
	obj, err := jsonraw.Parse(raw)
	if err != nil {
		return hi, invalid("kv_transfer_params", "is not a JSON object")
	}
	if k, dup := obj.Duplicate(); dup {
		return hi, invalid(k, "is given twice")
	}
	if err := checkPeerGet(obj, &hi); err != nil {
		return hi, err
	}
	if err := checkCountsGet(obj, &hi); err != nil {
		return hi, err
	}
	blocks, ok := obj.Get("remote_block_ids")
	if !ok || jsonraw.IsNull(blocks) {
		return hi, ErrUnusable
	}
	longest, err := blockGroupsElements(blocks)
	if err != nil {
		return hi, err
	}
	if longest == 0 {
		return hi, ErrUnusable
	}
	if blockSize > 0 && hi.Tokens > 0 {
		if need := (hi.Tokens + blockSize - 1) / blockSize; longest < need {
			return hi, invalid("remote_block_ids", "holds %d blocks, fewer than remote_num_tokens %d needs at block size %d (%d; check WithBlockSize)",
				longest, hi.Tokens, blockSize, need)
		}
	}
	return hi, nil
}

// checkPeerGet is the former checkPeer: a Get per member.
func checkPeerGet(obj jsonraw.Object, hi *Info) error {
	for _, k := range [...]string{"do_remote_decode", "do_remote_prefill"} {
		if v, ok := obj.Get(k); ok && !jsonraw.IsNull(v) {
			if _, isBool := jsonraw.Bool(v); !isBool {
				return invalid(k, "is not a boolean")
			}
		}
	}
	for _, k := range [...]string{"remote_engine_id", "remote_request_id", "remote_host"} {
		v, ok := obj.Get(k)
		if !ok || jsonraw.IsNull(v) {
			return ErrUnusable
		}
		if len(v) < 3 || v[0] != '"' {
			return invalid(k, "is not a non-empty string")
		}
	}
	port, ok := obj.Get("remote_port")
	if !ok || jsonraw.IsNull(port) {
		return ErrUnusable
	}
	if p, isInt := jsonraw.Int(port); !isInt || p < 1 || p > 65535 {
		return invalid("remote_port", "is not a port from 1 to 65535")
	}
	if v, ok := obj.Get("transfer_mode"); ok && !jsonraw.IsNull(v) {
		s, isStr := jsonraw.String(v)
		if !isStr {
			return invalid("transfer_mode", "is not a string")
		}
		hi.PushMode = s == "push"
	}
	return nil
}

// checkCountsGet is the former checkCounts: a Get per member.
func checkCountsGet(obj jsonraw.Object, hi *Info) error {
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
		if !isInt || n < c.min || n > maxCount {
			return invalid(c.key, "is not an integer from %d to %d", c.min, maxCount)
		}
		if c.key == "remote_num_tokens" {
			hi.Tokens = int(n)
		}
	}
	if v, ok := obj.Get("remote_blocks_expiry_time"); ok && !jsonraw.IsNull(v) {
		if !finiteNumber(v) {
			return invalid("remote_blocks_expiry_time", "is not a finite number")
		}
	}
	return nil
}

// blockGroupsElements is the former blockGroups: one callback per group
// and per block id.
func blockGroupsElements(v []byte) (int, error) {
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
					return invalid("remote_block_ids", "holds %.24q, not a block id from 0 to %d", id, MaxBlockID)
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
			return invalid("remote_block_ids", "holds %.24q, not a block id from 0 to %d", e, MaxBlockID)
		}
		n++
		return nil
	})
	switch {
	case errors.Is(err, ErrInvalid):
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

// blockID reports whether e is an integer literal from 0 to MaxBlockID.
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
	return v <= MaxBlockID
}

// sameVerdict reports how Check's verdict on a handle differs from the
// former per-element check's ("" when it does not): acceptance, the
// sentinel wrapped, the member named, and the Info read.
func sameVerdict(raw []byte, hi Info, err error, old Info, oldErr error) string {
	switch {
	case (err == nil) != (oldErr == nil):
		return "one accepts, the other refuses"
	case errors.Is(err, ErrInvalid) != errors.Is(oldErr, ErrInvalid) || errors.Is(err, ErrUnusable) != errors.Is(oldErr, ErrUnusable):
		return "different sentinels"
	case InvalidMember(err) != InvalidMember(oldErr):
		return "different members"
	case err == nil && (hi.Tokens != old.Tokens || hi.PushMode != old.PushMode || hi.EngineID() != EngineID(raw)):
		return "different Info"
	}
	return ""
}

// knownBlocks reports what is wrong with the Blocks Check reported for an
// accepted handle ("" when nothing): the span must hold remote_block_ids
// with the shape given.
func knownBlocks(raw []byte, hi Info) string {
	k := hi.Blocks
	if k.End == 0 {
		return ""
	}
	obj, err := jsonraw.Parse(raw)
	if err != nil {
		return "not an object"
	}
	v, _ := obj.Get("remote_block_ids")
	if k.Start < 0 || k.End > len(raw) || string(raw[k.Start:k.End]) != string(v) {
		return "the span is not remote_block_ids"
	}
	if sh, ok := jsonraw.IntLists(v, MaxBlockID); !ok || sh != k.Lists || k.Max != MaxBlockID {
		return "another shape"
	}
	return ""
}

// cutElements is the former Cut: a callback per group and per block id.
func cutElements(raw []byte, tokens, blockSize int) ([]byte, error) {
	obj, blocks, c, err := cutStart(raw, tokens, blockSize)
	if err != nil {
		return nil, err
	}
	nested := false
	_ = jsonraw.Elements(blocks, func(e []byte) error {
		nested = len(e) > 0 && e[0] == '['
		return errStop
	})
	var out []byte
	if !nested {
		out, err = c.groupElements(make([]byte, 0, len(blocks)), blocks)
	} else {
		out = append(make([]byte, 0, len(blocks)), '[')
		g := 0
		err = jsonraw.Elements(blocks, func(group []byte) error {
			if len(group) == 0 || group[0] != '[' {
				return ErrPartialGroups
			}
			if g > 0 {
				out = append(out, ',')
			}
			g++
			var err error
			out, err = c.groupElements(out, group)
			if errors.Is(err, ErrPartialBlocks) && g > 1 {
				return ErrPartialGroups
			}
			return err
		})
		out = append(out, ']')
	}
	if err != nil {
		return nil, err
	}
	return obj.Edit(nil,
		jsonraw.Member{Key: "remote_num_tokens", Value: []byte(strconv.Itoa(tokens))},
		jsonraw.Member{Key: "remote_block_ids", Value: out}), nil
}

// groupElements is the former cutter.group.
func (c cutter) groupElements(dst, group []byte) ([]byte, error) {
	n := 0
	dst = append(dst, '[')
	err := jsonraw.Elements(group, func(e []byte) error {
		if n < c.keep {
			if n > 0 {
				dst = append(dst, ',')
			}
			dst = append(dst, e...)
		}
		n++
		return nil
	})
	if err != nil {
		return nil, err
	}
	if n != c.want {
		return nil, ErrPartialBlocks
	}
	return append(dst, ']'), nil
}

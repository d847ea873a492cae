package kvhandle

import (
	"bytes"
	"errors"
	"strconv"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// Key is the member of a body that carries a KV handle.
const Key = "kv_transfer_params"

// Miss is message 1 of kvroute's wire protocol: "prefill here, decode
// elsewhere", the handle of a prefill leg without a retained handle.
var Miss = []byte(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

var (
	jsonTrue  = []byte("true")
	jsonFalse = []byte("false")
	jsonZero  = []byte("0")
)

var errStop = errors.New("stop")

// ForHit turns a retained decode handle into message 2: the two role
// flags forced, every other key verbatim. The handle is checked again
// (Check): an entry may come from another router sharing the store.
func ForHit(dHandle []byte, blockSize int) ([]byte, error) {
	return asMessage2(dHandle, blockSize, jsonraw.Known{})
}

// ForHitKnown is ForHit for a handle whose remote_block_ids the router
// wrote itself, as known says (CheckKnown).
func ForHitKnown(dHandle []byte, blockSize int, known jsonraw.Known) ([]byte, error) {
	return asMessage2(dHandle, blockSize, known)
}

// asMessage2 checks a retained decode handle again and returns it with the
// two role flags forced for a prefill leg (do_remote_decode true,
// do_remote_prefill false), then the extra members, every other key
// verbatim.
func asMessage2(dHandle []byte, blockSize int, known jsonraw.Known, extra ...jsonraw.Member) ([]byte, error) {
	_, obj, err := check(dHandle, blockSize, known)
	if err != nil {
		return nil, err
	}
	return obj.Edit(nil, append([]jsonraw.Member{
		{Key: "do_remote_decode", Value: jsonTrue},
		{Key: "do_remote_prefill", Value: jsonFalse}}, extra...)...), nil
}

// Release turns a retained decode handle into a handle that releases its
// hold (the protocol's "Decode memory"): message 2 with remote_num_tokens
// 0, so that the prefill engine counts nothing to pull
// (min(remote_num_tokens, prompt) - local hit <= 0), takes the notify-only
// path and tells the decode engine to free the whole hold, while it
// computes its own prompt as on a miss. The role flags are forced as for
// a hit (do_remote_decode true, do_remote_prefill false); every other key
// is kept verbatim: remote_block_ids non-empty and the four keys the
// engine needs to reach the decode engine (Check refuses a handle without
// them). Like ForHit, the handle is checked again.
func Release(dHandle []byte, blockSize int) ([]byte, error) {
	return ReleaseKnown(dHandle, blockSize, jsonraw.Known{})
}

// ReleaseKnown is Release for a handle whose remote_block_ids the router
// wrote itself, as known says (CheckKnown).
func ReleaseKnown(dHandle []byte, blockSize int, known jsonraw.Known) ([]byte, error) {
	return asMessage2(dHandle, blockSize, known, jsonraw.Member{Key: "remote_num_tokens", Value: jsonZero})
}

// Why a handle cannot be read partially (TurnRecord.MissReason detail and
// Stats.PartialRefused).
var (
	ErrPartialDCP    = errors.New("handle has dcp_size > 1: decode-context-parallel blocks cannot be cut from the front")
	ErrPartialGroups = errors.New("handle's KV groups differ in length (sliding-window or state groups cannot be cut from the front)")
	ErrPartialBlocks = errors.New("handle's block count does not match remote_num_tokens at its engine's block size")
	ErrPartialFlat   = errors.New("handle has no remote_block_ids list")
)

// Cut returns a copy of a decode handle that lets the prefill engine read
// only the first tokens positions (docs/kvroute.md, Verification):
// remote_num_tokens lowered to tokens and every KV group's
// remote_block_ids cut from the front to its first ceil(tokens/blockSize)
// blocks. The handle must be one whose blocks can be cut: dcp_size 1 (or
// absent), every group of equal length, and that length
// ceil(remote_num_tokens/blockSize), which catches a block size that
// differs from the engine's.
func Cut(raw []byte, tokens, blockSize int) ([]byte, error) {
	obj, blocks, c, err := cutStart(raw, tokens, blockSize)
	if err != nil {
		return nil, err
	}
	out, err := c.blocks(make([]byte, 0, len(blocks)), blocks)
	if err != nil {
		return nil, err
	}
	return obj.Edit(nil,
		jsonraw.Member{Key: "remote_num_tokens", Value: strconv.AppendInt(nil, int64(tokens), 10)},
		jsonraw.Member{Key: "remote_block_ids", Value: out}), nil
}

// cutStart checks that raw's blocks can be cut to tokens at blockSize
// (dcp_size 1 or absent, 0 < tokens <= remote_num_tokens, a list of
// block ids) and returns the parsed handle, its remote_block_ids and the
// cutter for them.
func cutStart(raw []byte, tokens, blockSize int) (jsonraw.Object, []byte, cutter, error) {
	obj, err := jsonraw.Parse(raw)
	if err != nil {
		return obj, nil, cutter{}, err
	}
	if v, ok := obj.Get("dcp_size"); ok && !jsonraw.IsNull(v) {
		if n, ok := jsonraw.Int(v); !ok || n > 1 {
			return obj, nil, cutter{}, ErrPartialDCP
		}
	}
	rv, _ := obj.Get("remote_num_tokens")
	r, ok := jsonraw.Int(rv)
	if !ok || r <= 0 || tokens <= 0 || int64(tokens) > r {
		return obj, nil, cutter{}, ErrUnusable
	}
	blocks, ok := obj.Get("remote_block_ids")
	if !ok || len(blocks) == 0 || blocks[0] != '[' {
		return obj, nil, cutter{}, ErrPartialFlat
	}
	c := cutter{want: int((r + int64(blockSize) - 1) / int64(blockSize)), keep: (tokens + blockSize - 1) / blockSize}
	return obj, blocks, c, nil
}

// cutter cuts remote_block_ids groups of want blocks to their first keep.
type cutter struct{ want, keep int }

// blocks appends the cut remote_block_ids: nested [[...], ...] per group,
// or the flat [...] of very old engines (one group).
func (c cutter) blocks(out, blocks []byte) ([]byte, error) {
	if cut, err, ok := c.plainBlocks(out, blocks); ok {
		return cut, err
	}
	nested := false
	_ = jsonraw.Elements(blocks, func(e []byte) error {
		nested = len(e) > 0 && e[0] == '['
		return errStop
	})
	if !nested {
		return c.group(out, blocks)
	}
	out = append(out, '[')
	g := 0
	err := jsonraw.Elements(blocks, func(group []byte) error {
		if len(group) == 0 || group[0] != '[' {
			return ErrPartialGroups
		}
		if g > 0 {
			out = append(out, ',')
		}
		g++
		var err error
		out, err = c.group(out, group)
		if errors.Is(err, ErrPartialBlocks) && g > 1 {
			return ErrPartialGroups
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	return append(out, ']'), nil
}

// group appends one group's first keep block ids; the group must hold
// want.
func (c cutter) group(dst, group []byte) ([]byte, error) {
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

// plainBlocks is blocks for lists written as the engines and the store
// entry write them, digits and commas only ("[[1,2],[3,4]]"): each group
// read once, its ids counted between commas, its first keep copied as
// they are. ok is false for any other text (spaces, other elements), which
// the general path then cuts.
func (c cutter) plainBlocks(out, blocks []byte) (_ []byte, _ error, ok bool) {
	if len(blocks) < 2 || blocks[0] != '[' {
		return out, nil, false
	}
	if blocks[1] != '[' {
		return c.plainGroup(out, blocks)
	}
	n := len(out)
	out = append(out, '[')
	for g, i := 0, 1; ; g++ {
		j := bytes.IndexByte(blocks[i:], ']')
		if j < 0 || blocks[i] != '[' {
			return out[:n], nil, false
		}
		var err error
		if out, err, ok = c.plainGroup(out, blocks[i:i+j+1]); !ok {
			return out[:n], nil, false
		}
		if err != nil {
			if errors.Is(err, ErrPartialBlocks) && g > 0 {
				err = ErrPartialGroups
			}
			return nil, err, true
		}
		i += j + 1
		switch {
		case i == len(blocks)-1 && blocks[i] == ']':
			return append(out, ']'), nil, true
		case i < len(blocks)-1 && blocks[i] == ',':
			out = append(out, ',')
			i++
		default:
			return out[:n], nil, false
		}
	}
}

// plainGroup is group for a list of digits and commas only: ok is false
// (out unchanged) for any other text.
func (c cutter) plainGroup(out, group []byte) (_ []byte, _ error, ok bool) {
	inner := group[1 : len(group)-1]
	ids, end := 0, len(inner)
	if len(inner) > 0 {
		ids = 1
	}
	for k, ch := range inner {
		if ch == ',' {
			if ids == c.keep {
				end = k
			}
			ids++
		} else if ch-'0' > 9 {
			return out, nil, false
		}
	}
	if ids != c.want {
		return nil, ErrPartialBlocks, true
	}
	out = append(out, '[')
	return append(append(out, inner[:end]...), ']'), nil, true
}

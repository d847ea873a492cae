package kvroute

import (
	"encoding/binary"
	"errors"
	"time"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// The kv_transfer_params member name.
const kvKey = "kv_transfer_params"

// missHandle is message 1 of protocol.md: "prefill here, decode elsewhere".
var missHandle = []byte(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

var (
	jsonTrue  = []byte("true")
	jsonFalse = []byte("false")
)

// handleInfo is what the router reads from an engine's handle.
type handleInfo struct {
	tokens int // remote_num_tokens, 0 when absent
}

var errUnusableHandle = errors.New("handle lacks remote_engine_id, remote_request_id, remote_host, remote_port or remote_block_ids")

// inspectHandle checks that raw is a handle an engine would act on (the
// four address keys present and non-null, remote_block_ids non-empty) and
// reads remote_num_tokens. It does not copy raw.
func inspectHandle(raw []byte) (handleInfo, error) {
	var hi handleInfo
	obj, err := jsonraw.Parse(raw)
	if err != nil {
		return hi, err
	}
	for _, k := range [...]string{"remote_engine_id", "remote_request_id", "remote_host", "remote_port"} {
		v, ok := obj.Get(k)
		if !ok || jsonraw.IsNull(v) {
			return hi, errUnusableHandle
		}
	}
	blocks, ok := obj.Get("remote_block_ids")
	if !ok || !nonEmptyBlocks(blocks) {
		return hi, errUnusableHandle
	}
	if v, ok := obj.Get("remote_num_tokens"); ok {
		if n, ok := jsonraw.Int(v); ok && n > 0 {
			hi.tokens = int(n)
		}
	}
	return hi, nil
}

// nonEmptyBlocks reports whether remote_block_ids holds at least one id:
// [[1,2]] per KV group, or the flat [1,2] of very old engines.
func nonEmptyBlocks(v []byte) bool {
	if len(v) == 0 || v[0] != '[' {
		return false
	}
	found := false
	_ = jsonraw.Elements(v, func(e []byte) error {
		switch {
		case len(e) > 0 && e[0] == '[':
			_ = jsonraw.Elements(e, func([]byte) error { found = true; return errStop })
		case len(e) > 0 && (e[0] == '-' || (e[0] >= '0' && e[0] <= '9')):
			found = true
		}
		if found {
			return errStop
		}
		return nil
	})
	return found
}

var errStop = errors.New("stop")

// hitHandle turns a retained decode handle into message 2: the two role
// flags forced, every other key verbatim.
func hitHandle(dHandle []byte) ([]byte, error) {
	obj, err := jsonraw.Parse(dHandle)
	if err != nil {
		return nil, err
	}
	return obj.Edit(nil,
		jsonraw.Member{Key: "do_remote_decode", Value: jsonTrue},
		jsonraw.Member{Key: "do_remote_prefill", Value: jsonFalse}), nil
}

// entry is a retained decode handle with what the router knows about it.
type entry struct {
	created  time.Time // when the router saw D finish (router clock)
	endpoint string    // the decode endpoint that holds the blocks
	tokens   int       // remote_num_tokens
	check    []byte    // the Identifier's Retention.Check
	handle   []byte    // D's kv_transfer_params, verbatim
}

const entryVersion = 1

// encode serialises e compactly: a version byte, varints, the endpoint and
// the check, then the handle JSON as is.
func (e entry) encode() []byte {
	b := make([]byte, 0, 1+4*binary.MaxVarintLen64+len(e.endpoint)+len(e.check)+len(e.handle))
	b = append(b, entryVersion)
	b = binary.AppendVarint(b, e.created.UnixNano())
	b = binary.AppendUvarint(b, uint64(e.tokens))
	b = binary.AppendUvarint(b, uint64(len(e.endpoint)))
	b = append(b, e.endpoint...)
	b = binary.AppendUvarint(b, uint64(len(e.check)))
	b = append(b, e.check...)
	return append(b, e.handle...)
}

var errBadEntry = errors.New("kvroute: retained value is not a kvroute entry")

func decodeEntry(b []byte) (entry, error) {
	var e entry
	if len(b) < 1 || b[0] != entryVersion {
		return e, errBadEntry
	}
	b = b[1:]
	created, n := binary.Varint(b)
	if n <= 0 {
		return e, errBadEntry
	}
	b = b[n:]
	tokens, n := binary.Uvarint(b)
	if n <= 0 {
		return e, errBadEntry
	}
	b = b[n:]
	el, n := binary.Uvarint(b)
	if n <= 0 || uint64(len(b)-n) < el {
		return e, errBadEntry
	}
	b = b[n:]
	e.endpoint = string(b[:el])
	b = b[el:]
	cl, n := binary.Uvarint(b)
	if n <= 0 || uint64(len(b)-n) < cl {
		return e, errBadEntry
	}
	b = b[n:]
	e.check = b[:cl]
	e.handle = b[cl:]
	e.created = time.Unix(0, created)
	e.tokens = int(tokens)
	if len(e.handle) == 0 {
		return e, errBadEntry
	}
	return e, nil
}

package kvhandle

import (
	"bytes"
	"errors"
	"fmt"
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
// goes through Check, and one that vLLM could not read correctly is
// refused (Stats.InvalidHandles, logged once per reason).

// ErrInvalid is wrapped by every Check error about a member that is
// present with a type or value vLLM cannot use.
var ErrInvalid = errors.New("kvroute: invalid KV handle")

// ErrBlockCount is wrapped, with ErrInvalid, by Check's error for a handle
// whose longest group holds fewer blocks than remote_num_tokens needs at
// the block size Check was given: either the handle is wrong or the block
// size is not the engine's.
var ErrBlockCount = errors.New("fewer blocks than remote_num_tokens needs")

// ErrUnusable is Check's error for a handle an engine ignores.
var ErrUnusable = errors.New("handle lacks remote_engine_id, remote_request_id, remote_host, remote_port or remote_block_ids")

// MaxBlockID bounds a block id: ids index an engine's KV blocks, whose
// count is far below 2^31 on any device.
const MaxBlockID = math.MaxInt32

// maxCount bounds remote_num_tokens, tp_size, dcp_size and pp_size.
const maxCount = math.MaxInt32

// Info is what the router reads from an engine's handle.
type Info struct {
	Tokens   int  // remote_num_tokens, 0 when absent
	PushMode bool // transfer_mode "push": not usable bidirectionally
	Groups   int  // KV-cache groups in remote_block_ids (1 for a flat list)
	// Blocks is where remote_block_ids is in the handle, with its shape
	// (the zero Known when Check did not read it in its pass): what the
	// store entry needs to compact the handle without reading it again.
	Blocks jsonraw.Known

	engineID []byte // remote_engine_id as written
}

// EngineID returns the handle's remote_engine_id.
func (hi Info) EngineID() string {
	s, _ := jsonraw.String(hi.engineID)
	return s
}

// handleError is a Check error about one member; count marks the
// block-count check's (ErrBlockCount).
type handleError struct {
	key, why string
	count    bool
}

func (e *handleError) Error() string { return ErrInvalid.Error() + ": " + e.key + " " + e.why }

func (e *handleError) Unwrap() []error {
	if e.count {
		return []error{ErrInvalid, ErrBlockCount}
	}
	return []error{ErrInvalid}
}

// invalid returns the error for member key, which vLLM could not read.
func invalid(key, format string, args ...any) error {
	return &handleError{key: key, why: fmt.Sprintf(format, args...)}
}

// InvalidMember returns the member an invalid-handle error is about ("" for
// any other error), a bounded key for logging once.
func InvalidMember(err error) string {
	var he *handleError
	if errors.As(err, &he) {
		return he.key
	}
	return ""
}

// Check checks raw, an engine's kv_transfer_params, and reads what the
// router needs from it. It returns ErrUnusable for a handle an engine
// ignores (remote_engine_id, remote_request_id, remote_host or
// remote_port absent or null, remote_block_ids absent or empty), and an
// error wrapping ErrInvalid for one vLLM would misread:
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
//     ceil(R/blockSize) blocks in its longest group (also ErrBlockCount).
//     blockSize is the block size of the engine that emitted the handle,
//     whose full-attention group holds one block per blockSize tokens;
//     sliding-window groups keep only the window's tail and state (Mamba)
//     groups one slot (vLLM's get_exchange_clipped_blocks), so they are
//     shorter. 0 skips the check (the size is unknown, or the handle
//     only releases: remote_num_tokens 0 reads nothing).
//
// It does not copy raw, and reads it in one pass: the block lists are
// validated, counted and bounded as the document is validated, without a
// call per block id.
func Check(raw []byte, blockSize int) (Info, error) {
	hi, _, err := check(raw, blockSize, jsonraw.Known{})
	return hi, err
}

// CheckKnown is Check for a handle whose remote_block_ids the router
// wrote or read itself, as known says (a store entry's expansion:
// Entry.Blocks; the answer's parse: ResetAnswer): that list is not read
// again, every other rule applies.
func CheckKnown(raw []byte, blockSize int, known jsonraw.Known) (Info, error) {
	hi, _, err := check(raw, blockSize, known)
	return hi, err
}

// check is CheckKnown; it also returns the parsed handle.
func check(raw []byte, blockSize int, known jsonraw.Known) (Info, jsonraw.Object, error) {
	var (
		hi  Info
		obj jsonraw.Object
	)
	lists, member, err := obj.ResetListsKnown(raw, "remote_block_ids", MaxBlockID, known)
	if err != nil {
		return hi, obj, invalid("kv_transfer_params", "is not a JSON object")
	}
	if k, dup := obj.Duplicate(); dup {
		return hi, obj, invalid(k, "is given twice")
	}
	m := readMembers(obj)
	if err := checkPeer(&m, &hi); err != nil {
		return hi, obj, err
	}
	if err := checkCounts(&m, &hi); err != nil {
		return hi, obj, err
	}
	blocks := m.blocks
	if null(blocks) {
		return hi, obj, ErrUnusable
	}
	if member < 0 {
		// Not read while parsing: a key spelled with escapes, or a value
		// of another shape.
		if lists, err = blockGroups(blocks); err != nil {
			return hi, obj, err
		}
	} else {
		start, end := obj.ValueSpan(member)
		hi.Blocks = jsonraw.Known{Start: start, End: end, Lists: lists, Max: MaxBlockID}
	}
	longest := lists.Longest
	if longest == 0 {
		return hi, obj, ErrUnusable
	}
	hi.Groups = max(lists.Lists, 1) // a flat list is one group
	if blockSize > 0 && hi.Tokens > 0 {
		if need := (hi.Tokens + blockSize - 1) / blockSize; longest < need {
			err := invalid("remote_block_ids", "holds %d blocks, fewer than remote_num_tokens %d needs at block size %d (%d)",
				longest, hi.Tokens, blockSize, need)
			err.(*handleError).count = true
			return hi, obj, err
		}
	}
	return hi, obj, nil
}

// handleMembers are the values of the members of a handle that Check reads,
// read in one pass (nil: absent; the last of a name, as Get).
type handleMembers struct {
	decode, prefill, engineID, requestID, host, port, mode []byte
	tokens, tp, dcp, pp, expiry, blocks                    []byte
}

// readMembers reads the members Check looks at.
func readMembers(obj jsonraw.Object) handleMembers {
	var m handleMembers
	for i := range obj.Len() {
		k, v := obj.Member(i)
		switch k {
		case "do_remote_decode":
			m.decode = v
		case "do_remote_prefill":
			m.prefill = v
		case "remote_engine_id":
			m.engineID = v
		case "remote_request_id":
			m.requestID = v
		case "remote_host":
			m.host = v
		case "remote_port":
			m.port = v
		case "transfer_mode":
			m.mode = v
		case "remote_num_tokens":
			m.tokens = v
		case "tp_size":
			m.tp = v
		case "dcp_size":
			m.dcp = v
		case "pp_size":
			m.pp = v
		case "remote_blocks_expiry_time":
			m.expiry = v
		case "remote_block_ids":
			m.blocks = v
		}
	}
	return m
}

// null reports whether a member is absent or null.
func null(v []byte) bool { return v == nil || jsonraw.IsNull(v) }

// checkPeer checks the role flags, the remote engine's identity and
// address, and the transfer mode.
func checkPeer(m *handleMembers, hi *Info) error {
	for _, f := range [...]struct {
		key string
		v   []byte
	}{{"do_remote_decode", m.decode}, {"do_remote_prefill", m.prefill}} {
		if !null(f.v) {
			if _, isBool := jsonraw.Bool(f.v); !isBool {
				return invalid(f.key, "is not a boolean")
			}
		}
	}
	for _, f := range [...]struct {
		key string
		v   []byte
	}{{"remote_engine_id", m.engineID}, {"remote_request_id", m.requestID}, {"remote_host", m.host}} {
		if null(f.v) {
			return ErrUnusable
		}
		// A parsed value that opens with a quote is a string; "" is empty.
		if len(f.v) < 3 || f.v[0] != '"' {
			return invalid(f.key, "is not a non-empty string")
		}
	}
	hi.engineID = m.engineID
	if null(m.port) {
		return ErrUnusable
	}
	if p, isInt := jsonraw.Int(m.port); !isInt || p < 1 || p > 65535 {
		return invalid("remote_port", "is not a port from 1 to 65535")
	}
	if !null(m.mode) {
		// A parsed value that opens with a quote is a string.
		if m.mode[0] != '"' {
			return invalid("transfer_mode", "is not a string")
		}
		hi.PushMode = string(m.mode) == `"push"` || (bytes.IndexByte(m.mode, '\\') >= 0 && stringIs(m.mode, "push"))
	}
	return nil
}

// stringIs reports whether the JSON string v decodes to s.
func stringIs(v []byte, s string) bool {
	d, ok := jsonraw.String(v)
	return ok && d == s
}

// checkCounts checks the counts and the expiry time.
func checkCounts(m *handleMembers, hi *Info) error {
	for _, c := range [...]struct {
		key string
		v   []byte
		min int64
	}{{"remote_num_tokens", m.tokens, 0}, {"tp_size", m.tp, 1}, {"dcp_size", m.dcp, 1}, {"pp_size", m.pp, 1}} {
		if null(c.v) {
			continue
		}
		n, isInt := jsonraw.Int(c.v)
		if !isInt || n < c.min || n > maxCount {
			return invalid(c.key, "is not an integer from %d to %d", c.min, maxCount)
		}
		if c.key == "remote_num_tokens" {
			hi.Tokens = int(n)
		}
	}
	if !null(m.expiry) && !finiteNumber(m.expiry) {
		return invalid("remote_blocks_expiry_time", "is not a finite number")
	}
	return nil
}

// blockGroups checks remote_block_ids: a list of integer lists (one per KV
// group), or a flat list of integers (very old engines), every id from 0
// to MaxBlockID written with digits only; it returns the lists' shape.
func blockGroups(v []byte) (jsonraw.Lists, error) {
	if len(v) == 0 || v[0] != '[' {
		return jsonraw.Lists{}, invalid("remote_block_ids", "is not a list")
	}
	sh, ok := jsonraw.IntLists(v, MaxBlockID)
	if !ok {
		return sh, invalid("remote_block_ids", "is not a list of KV groups of block ids from 0 to %d", MaxBlockID)
	}
	return sh, nil
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

// EngineID returns the remote_engine_id of a handle, "" when it has none.
func EngineID(h []byte) string {
	return EngineIDKnown(h, jsonraw.Known{})
}

// EngineIDKnown is EngineID for a handle whose remote_block_ids the router
// wrote itself, as known says: that list is not read again.
func EngineIDKnown(h []byte, known jsonraw.Known) string {
	if known.End == 0 {
		v, _ := jsonraw.Lookup(h, "remote_engine_id")
		s, _ := jsonraw.String(v)
		return s
	}
	var obj jsonraw.Object
	if _, _, err := obj.ResetListsKnown(h, "remote_block_ids", MaxBlockID, known); err != nil {
		return ""
	}
	v, _ := obj.Get("remote_engine_id")
	s, _ := jsonraw.String(v)
	return s
}

// ResetAnswer is obj.Reset(b) for an engine's answer or stream event b
// that also reads, in the same pass, the block list of its top-level
// handle (the member Key): it returns where that list is in the handle
// obj.Get(Key) returns, for CheckKnown, or the zero Known when it read
// none (no handle, a list of another shape, or a member named twice).
func ResetAnswer(obj *jsonraw.Object, b []byte) (jsonraw.Known, error) {
	known, parent, err := obj.ResetListsIn(b, Key, "remote_block_ids", MaxBlockID)
	if err != nil || parent < 0 || parent != obj.Index(Key) {
		return jsonraw.Known{}, err
	}
	start, _ := obj.ValueSpan(parent)
	known.Start -= start
	known.End -= start
	return known, nil
}

package kvhandle

import (
	"bytes"
	"encoding/json"
	"errors"
	"math"
	"strconv"
	"strings"
	"testing"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/internal/toytok"
)

// FuzzCheckHandle feeds engine handles to Check and compares its verdict
// with two oracles: the former per-element check (checkElements), whose
// verdict it must give exactly (acceptance, sentinel, member, Info); and
// an independent one, encoding/json with UseNumber, as vLLM's Python json
// reads a handle (the last of duplicate keys wins; numbers are kept as
// written), and the rules of Check's doc spelled out again. Nothing may
// panic; an accepted handle must be one the oracle accepts with the same
// remote_num_tokens, and a refused one one it refuses.
func FuzzCheckHandle(f *testing.F) {
	valid := `{"do_remote_prefill":false,"do_remote_decode":true,"remote_block_ids":[[11,12,13,14,15,16,17]],"remote_engine_id":"d","remote_request_id":"r","remote_host":"10.0.0.2","remote_port":5601,"tp_size":1,"remote_num_tokens":100,"remote_blocks_expiry_time":12345.5,"dcp_size":1,"pp_size":1,"transfer_mode":"pull"}`
	for _, s := range []string{
		valid,
		strings.Replace(valid, "[[11,", "[[1e999,", 1),
		strings.Replace(valid, "[[11,", "[[-1,", 1),
		strings.Replace(valid, "[[11,", "[[18446744073709551616,", 1),
		strings.Replace(valid, "5601", "70000", 1),
		strings.Replace(valid, "100", "1000", 1),
		strings.Replace(valid, `"tp_size":1`, `"tp_size":1,"tp_size":0`, 1),
		strings.Replace(valid, `"remote_port"`, `"\u0072emote_port"`, 1),
		strings.Replace(valid, `"remote_block_ids"`, `"remote\u005fblock_ids"`, 1),
		strings.Replace(valid, "[[11,", "[[2147483647,", 1),
		strings.Replace(valid, "[[11,", "[[2147483648,", 1),
		strings.Replace(valid, "[[11,", "[[011,", 1),
		strings.Replace(valid, "[[11,", "[ [ 11 ,", 1),
		strings.Replace(valid, "[[11,", "[[11],[", 1),
		strings.Replace(valid, "[[11,", "[11,[", 1),
		strings.Replace(valid, "[[11,", "[[[11],", 1),
		strings.Replace(valid, "]]", "],[]]", 1),
		strings.Replace(valid, "[[11,12,13,14,15,16,17]]", "[[]]", 1),
		string(toytok.Handle(3, 1000, 16)),
		string(toytok.GroupHandle(3, 1000, 16, 2, true)),
		`{"remote_block_ids":[1,2],"remote_engine_id":"p","remote_request_id":"q","remote_host":"h","remote_port":1}`,
		`{"remote_block_ids":[[1],[2,3]],"remote_engine_id":"p","remote_request_id":"q","remote_host":"h","remote_port":1,"remote_num_tokens":32}`,
		`{"remote_block_ids":[],"remote_engine_id":"p","remote_request_id":"q","remote_host":"h","remote_port":1}`,
		`{"remote_block_ids":[[]],"remote_engine_id":null,"remote_request_id":"q","remote_host":"h","remote_port":1}`,
		`[]`, `{}`, `{"remote_block_ids":"x"}`,
	} {
		f.Add([]byte(s), uint8(16))
	}
	f.Fuzz(func(t *testing.T, raw []byte, bs uint8) {
		blockSize := int(bs % 65)
		hi, err := Check(raw, blockSize)
		old, oldErr := checkElements(raw, blockSize)
		if diff := sameVerdict(raw, hi, err, old, oldErr); diff != "" {
			t.Fatalf("Check and the per-element check differ (%s) on %s: %+v, %v; %+v, %v", diff, raw, hi, err, old, oldErr)
		}
		// Read from an answer that carries it, the list gives the same
		// verdict (ResetAnswer, then CheckKnown).
		answer := append(append([]byte(`{"id":"x","kv_transfer_params":`), raw...), '}')
		var obj jsonraw.Object
		// (Only where the answer's handle is raw itself: a raw that
		// closes the object early, {...},"k":v, makes an answer whose
		// handle is another value.)
		if known, aerr := ResetAnswer(&obj, answer); aerr == nil {
			h, _ := obj.Get(Key)
			if !bytes.Equal(h, bytes.TrimSpace(raw)) {
				return
			}
			ahi, aerr := CheckKnown(h, blockSize, known)
			if diff := sameVerdict(raw, ahi, aerr, hi, err); diff != "" {
				t.Fatalf("the answer's Known %+v gives another verdict (%s) on %s: %v; Check %v", known, diff, raw, aerr, err)
			}
		}
		if err == nil {
			if bad := knownBlocks(raw, hi); bad != "" {
				t.Fatalf("Check's Blocks %+v: %s: %s", hi.Blocks, bad, raw)
			}
			// Given back as known, the list gives the same verdict.
			if khi, kerr := CheckKnown(raw, blockSize, hi.Blocks); kerr != nil || khi.Tokens != hi.Tokens || khi.EngineID() != hi.EngineID() {
				t.Fatalf("CheckKnown with Check's Blocks: %+v, %v", khi, kerr)
			}
			if got := EngineIDKnown(raw, hi.Blocks); got != hi.EngineID() || got != EngineID(raw) {
				t.Fatalf("engine ids %q, %q, %q", got, hi.EngineID(), EngineID(raw))
			}
		}
		verdict, tokens, skip := oracleHandle(raw, blockSize)
		if skip {
			return
		}
		switch {
		case err == nil && verdict != nil:
			t.Fatalf("checkHandle accepted %s; oracle: %v", raw, verdict)
		case err != nil && verdict == nil:
			t.Fatalf("checkHandle refused %s (%v); oracle accepts", raw, err)
		case err == nil && hi.Tokens != tokens:
			t.Fatalf("checkHandle read remote_num_tokens %d, oracle %d: %s", hi.Tokens, tokens, raw)
		case err != nil && !errors.Is(err, ErrInvalid) && !errors.Is(err, ErrUnusable):
			t.Fatalf("checkHandle error %v wraps neither sentinel", err)
		}
	})
}

// oracleHandle applies checkHandle's rules with encoding/json. skip is
// true when encoding/json and jsonraw disagree on the document itself
// (they differ on invalid UTF-8 in keys, which is not what is tested).
func oracleHandle(raw []byte, blockSize int) (verdict error, tokens int, skip bool) {
	if json.Valid(raw) != jsonraw.Valid(raw) {
		return nil, 0, true
	}
	if !json.Valid(raw) {
		return errors.New("not JSON"), 0, false
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	tok, err := dec.Token()
	if err != nil || tok != json.Delim('{') {
		return errors.New("not an object"), 0, false
	}
	m := map[string]json.RawMessage{}
	for dec.More() {
		k, err := dec.Token()
		if err != nil {
			return nil, 0, true
		}
		key := k.(string)
		if strings.ContainsRune(key, 0xFFFD) {
			return nil, 0, true
		}
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return nil, 0, true
		}
		if _, dup := m[key]; dup {
			return errors.New("duplicate " + key), 0, false
		}
		m[key] = v
	}
	isNull := func(k string) bool { v, ok := m[k]; return !ok || string(v) == "null" }
	integer := func(v json.RawMessage) (int64, bool) {
		s := string(v)
		if strings.ContainsAny(s, ".eE") {
			return 0, false
		}
		n, err := strconv.ParseInt(s, 10, 64)
		return n, err == nil
	}
	for _, k := range []string{"do_remote_decode", "do_remote_prefill"} {
		if !isNull(k) && string(m[k]) != "true" && string(m[k]) != "false" {
			return errors.New(k), 0, false
		}
	}
	for _, k := range []string{"remote_engine_id", "remote_request_id", "remote_host"} {
		if isNull(k) {
			return errors.New("unusable " + k), 0, false
		}
		var s any
		if json.Unmarshal(m[k], &s) != nil {
			return errors.New(k), 0, false
		}
		if str, ok := s.(string); !ok || str == "" {
			return errors.New(k), 0, false
		}
	}
	if isNull("remote_port") {
		return errors.New("unusable port"), 0, false
	}
	if p, ok := integer(m["remote_port"]); !ok || p < 1 || p > 65535 {
		return errors.New("port"), 0, false
	}
	if !isNull("transfer_mode") {
		var s any
		if json.Unmarshal(m["transfer_mode"], &s) != nil {
			return errors.New("transfer_mode"), 0, false
		}
		if _, ok := s.(string); !ok {
			return errors.New("transfer_mode"), 0, false
		}
	}
	for _, c := range []struct {
		k   string
		min int64
	}{{"remote_num_tokens", 0}, {"tp_size", 1}, {"dcp_size", 1}, {"pp_size", 1}} {
		if isNull(c.k) {
			continue
		}
		n, ok := integer(m[c.k])
		if !ok || n < c.min || n > math.MaxInt32 {
			return errors.New(c.k), 0, false
		}
		if c.k == "remote_num_tokens" {
			tokens = int(n)
		}
	}
	if !isNull("remote_blocks_expiry_time") {
		var n json.Number
		d := json.NewDecoder(bytes.NewReader(m["remote_blocks_expiry_time"]))
		d.UseNumber()
		if d.Decode(&n) != nil {
			return errors.New("expiry"), 0, false
		}
		if f, err := n.Float64(); err != nil || math.IsInf(f, 0) {
			return errors.New("expiry"), 0, false
		}
	}
	if isNull("remote_block_ids") {
		return errors.New("unusable blocks"), 0, false
	}
	var list []json.RawMessage
	if json.Unmarshal(m["remote_block_ids"], &list) != nil {
		return errors.New("blocks"), 0, false
	}
	id := func(v json.RawMessage) bool {
		n, ok := integer(v)
		return ok && n >= 0 && n <= math.MaxInt32 && !strings.HasPrefix(string(v), "-")
	}
	longest, nested, flat := 0, false, false
	for _, e := range list {
		var group []json.RawMessage
		if json.Unmarshal(e, &group) == nil && len(e) > 0 && e[0] == '[' {
			nested = true
			for _, g := range group {
				if !id(g) {
					return errors.New("block id"), 0, false
				}
			}
			longest = max(longest, len(group))
			continue
		}
		flat = true
		if !id(e) {
			return errors.New("block id"), 0, false
		}
	}
	switch {
	case nested && flat:
		return errors.New("mixed"), 0, false
	case flat:
		longest = len(list)
	}
	if longest == 0 {
		return errors.New("unusable: no block"), 0, false
	}
	if blockSize > 0 && tokens > 0 && longest < (tokens+blockSize-1)/blockSize {
		return errors.New("too few blocks"), 0, false
	}
	return nil, tokens, false
}

package sim

import (
	"encoding/json"
	"strconv"
)

// Params is a parsed kv_transfer_params object as an engine reads it.
type Params struct {
	DoRemoteDecode  bool
	DoRemotePrefill bool
	EngineID        string
	RequestID       string
	Host            string
	Port            int
	Blocks          []int   // KV group 0
	Groups          [][]int // every KV group's block ids (a flat list is one group)
	NumTokens       int     // -1 when absent
	Expiry          *float64
	TPSize          int
}

// Usable reports whether the handle names a remote to read from: the four
// address keys present and remote_block_ids non-empty, or the engine ignores
// it.
func (p *Params) Usable() bool {
	return p.EngineID != "" && p.RequestID != "" && p.Host != "" && p.Port > 0 && len(p.Blocks) > 0
}

// ParseParams reads kv_transfer_params leniently: a key with the wrong JSON
// type counts as absent.
func ParseParams(raw json.RawMessage) (*Params, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, badRequest("kv_transfer_params: must be an object")
	}
	p := &Params{NumTokens: -1}
	_ = json.Unmarshal(m["do_remote_decode"], &p.DoRemoteDecode)
	_ = json.Unmarshal(m["do_remote_prefill"], &p.DoRemotePrefill)
	_ = json.Unmarshal(m["remote_engine_id"], &p.EngineID)
	_ = json.Unmarshal(m["remote_request_id"], &p.RequestID)
	_ = json.Unmarshal(m["remote_host"], &p.Host)
	p.Port = intField(m["remote_port"], 0)
	p.NumTokens = intField(m["remote_num_tokens"], -1)
	p.TPSize = intField(m["tp_size"], 1)
	if raw, ok := m["remote_blocks_expiry_time"]; ok {
		var f float64
		if json.Unmarshal(raw, &f) == nil && string(raw) != "null" {
			p.Expiry = &f
		}
	}
	if raw, ok := m["remote_block_ids"]; ok {
		var nested [][]int
		var flat []int
		if json.Unmarshal(raw, &nested) == nil && len(nested) > 0 {
			p.Blocks, p.Groups = nested[0], nested
		} else if json.Unmarshal(raw, &flat) == nil {
			p.Blocks, p.Groups = flat, [][]int{flat}
		}
	}
	return p, nil
}

func intField(raw json.RawMessage, def int) int {
	if raw == nil {
		return def
	}
	n, err := strconv.Atoi(string(raw))
	if err != nil {
		return def
	}
	return n
}

// handle is an emitted kv_transfer_params object, keys in vLLM's order.
type handle struct {
	DoRemoteDecode         bool     `json:"do_remote_decode"`
	DoRemotePrefill        bool     `json:"do_remote_prefill"`
	RemoteBlockIDs         [][]int  `json:"remote_block_ids"`
	RemoteEngineID         string   `json:"remote_engine_id"`
	RemoteRequestID        string   `json:"remote_request_id"`
	RemoteHost             string   `json:"remote_host"`
	RemotePort             int      `json:"remote_port"`
	TPSize                 int      `json:"tp_size"`
	RemoteNumTokens        int      `json:"remote_num_tokens"`
	RemoteBlocksExpiryTime *float64 `json:"remote_blocks_expiry_time"`
	DCPSize                int      `json:"dcp_size"`
	PPSize                 int      `json:"pp_size"`
	TransferMode           string   `json:"transfer_mode"`
}

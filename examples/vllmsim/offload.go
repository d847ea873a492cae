package main

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/bidikv/bidikv/internal/sim"
)

// offloadConfig is the OffloadingConnector child of a MultiConnector
// --kv-transfer-config, its kv_connector_extra_config as vLLM reads it
// (offloading/config.py, build_offloading_config; docs/cpu-tier.md).
type offloadConfig struct {
	SpecName       string          `json:"spec_name"`
	CPUBytes       *int64          `json:"cpu_bytes_to_use"`
	NumCPUBlocks   *int            `json:"num_cpu_blocks"`
	BlockSize      *int            `json:"block_size"`
	BlocksPerChunk *int            `json:"blocks_per_chunk"`
	PromptOnly     *bool           `json:"offload_prompt_only"`
	EvictionPolicy string          `json:"eviction_policy"`
	SecondaryTiers []secondaryTier `json:"secondary_tiers"`
	p2pPort        int             // the p2p tier's port (VLLM_P2P_SIDE_CHANNEL_PORT's 5710 when absent)
	p2p, present   bool
}

type secondaryTier struct {
	Type string `json:"type"`
	Port *int   `json:"port"`
}

// parseMultiConnector reads a MultiConnector --kv-transfer-config: its
// kv_connector_extra_config.connectors must be [NixlConnector,
// OffloadingConnector] in that order, each a full KVTransferConfig
// (multi_connector.py, MultiConnector: children are asked in config order
// and the first with a positive count loads; the simulator models NIXL
// first). It returns the NIXL child's raw config, read as a plain
// NixlConnector config is, and the offloading child.
func parseMultiConnector(extra map[string]json.RawMessage) (nixl []byte, off offloadConfig, err error) {
	var children []json.RawMessage
	if err := json.Unmarshal(extra["connectors"], &children); err != nil || len(children) != 2 {
		return nil, off, errors.New(`--kv-transfer-config: MultiConnector: kv_connector_extra_config.connectors must be [NixlConnector, OffloadingConnector] (the combination the simulator models)`)
	}
	var names [2]struct {
		KVConnector string          `json:"kv_connector"`
		Extra       json.RawMessage `json:"kv_connector_extra_config"`
	}
	for i, c := range children {
		_ = json.Unmarshal(c, &names[i])
	}
	if names[0].KVConnector != "NixlConnector" || names[1].KVConnector != "OffloadingConnector" {
		return nil, off, fmt.Errorf("--kv-transfer-config: MultiConnector children %q, %q: the simulator models [NixlConnector, OffloadingConnector], NIXL first",
			names[0].KVConnector, names[1].KVConnector)
	}
	if len(names[1].Extra) > 0 {
		if err := json.Unmarshal(names[1].Extra, &off); err != nil {
			return nil, off, fmt.Errorf("--kv-transfer-config: OffloadingConnector: %w", err)
		}
	}
	off.present = true
	switch off.SpecName {
	case "", "CPUOffloadingSpec":
		if len(off.SecondaryTiers) > 0 {
			return nil, off, errors.New("--kv-transfer-config: OffloadingConnector: secondary_tiers need spec_name TieringOffloadingSpec")
		}
	case "TieringOffloadingSpec":
	default:
		return nil, off, fmt.Errorf("--kv-transfer-config: OffloadingConnector: spec_name %q: the simulator models CPUOffloadingSpec and TieringOffloadingSpec", off.SpecName)
	}
	if off.EvictionPolicy != "" && off.EvictionPolicy != "lru" {
		return nil, off, fmt.Errorf("--kv-transfer-config: OffloadingConnector: eviction_policy %q: the simulator models lru", off.EvictionPolicy)
	}
	for _, st := range off.SecondaryTiers {
		if st.Type != "p2p" {
			return nil, off, fmt.Errorf("--kv-transfer-config: OffloadingConnector: secondary tier type %q: the simulator models p2p", st.Type)
		}
		off.p2p, off.p2pPort = true, 5710
		if st.Port != nil {
			off.p2pPort = *st.Port
		}
	}
	return children[0], off, nil
}

// cpuTier turns the offloading child into the engine's CPU tier, once the
// GPU block size and the profile are known: the chunk is block_size tokens
// (a multiple of --block-size) or blocks_per_chunk blocks, exclusive; the
// capacity num_cpu_blocks chunks, or cpu_bytes_to_use over the bytes of one
// chunk, which needs the profile's KV bytes per token.
func (off offloadConfig) cpuTier(c *sim.Config) error {
	if !off.present {
		return nil
	}
	bpc := 1
	switch {
	case off.BlockSize != nil && off.BlocksPerChunk != nil:
		return errors.New("--kv-transfer-config: OffloadingConnector: block_size and blocks_per_chunk are exclusive")
	case off.BlockSize != nil:
		if *off.BlockSize < c.BlockSize || *off.BlockSize%c.BlockSize != 0 {
			return fmt.Errorf("--kv-transfer-config: OffloadingConnector: block_size %d must be a multiple of --block-size %d", *off.BlockSize, c.BlockSize)
		}
		bpc = *off.BlockSize / c.BlockSize
	case off.BlocksPerChunk != nil:
		if *off.BlocksPerChunk < 1 {
			return fmt.Errorf("--kv-transfer-config: OffloadingConnector: blocks_per_chunk %d must be at least 1", *off.BlocksPerChunk)
		}
		bpc = *off.BlocksPerChunk
	}
	chunks := 0
	switch {
	case off.NumCPUBlocks != nil:
		chunks = *off.NumCPUBlocks
	case off.CPUBytes != nil:
		if c.Profile.KVBytesPerToken <= 0 {
			return errors.New("--kv-transfer-config: OffloadingConnector: cpu_bytes_to_use needs a --profile (its KV bytes per token), or give num_cpu_blocks")
		}
		chunks = int(*off.CPUBytes / (c.Profile.KVBytesPerToken * int64(bpc*c.BlockSize)))
	default:
		return errors.New("--kv-transfer-config: OffloadingConnector: cpu_bytes_to_use is required")
	}
	if chunks < 1 {
		return fmt.Errorf("--kv-transfer-config: OffloadingConnector: a CPU tier of %d chunks holds nothing", chunks)
	}
	t := &c.CPUTier
	t.Chunks, t.BlocksPerChunk, t.P2P, t.P2PPort = chunks, bpc, off.p2p, off.p2pPort
	t.OffloadGenerated = off.PromptOnly != nil && !*off.PromptOnly
	return nil
}

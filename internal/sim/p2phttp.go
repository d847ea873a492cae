package sim

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
)

// The peer tier over HTTP lets engines in separate processes pull from
// each other's CPU tiers, standing in for the P2P tier's session messages
// (ConnectMsg, LookupMsg) and its NIXL writes:
//
//	GET  /p2p/hello → {"model", "block_size", "chunk_tokens", "tp", "seed"}
//	POST /p2p/fetch {"keys": [...]} → {"chunks": {"<index>": [kv...]}}
//
// A port that does not serve them (a NIXL side channel, nothing) makes
// the pull fail: every chunk misses.

type helloMsg struct {
	Model       string `json:"model"`
	BlockSize   int    `json:"block_size"`
	ChunkTokens int    `json:"chunk_tokens"`
	TP          int    `json:"tp"`
	Seed        uint64 `json:"seed"`
}

// RankP2PHandler serves the peer tier of e's data-parallel rank k over
// HTTP, the one a puller reaches at e.RankP2PAddr(k); without a peer tier
// it answers 404.
func RankP2PHandler(e *Engine, k int) http.Handler {
	mux := http.NewServeMux()
	if !e.cfg.CPUTier.enabled() || !e.cfg.CPUTier.P2P {
		return mux
	}
	src := &p2pEndpoint{e: e, k: k}
	mux.HandleFunc("GET /p2p/hello", func(w http.ResponseWriter, r *http.Request) {
		h, err := src.hello(r.Context())
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		writeJSON(w, helloMsg{h.model, h.blockSize, h.chunkTokens, h.tp, h.seed})
	})
	mux.HandleFunc("POST /p2p/fetch", func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Keys []uint64 `json:"keys"`
		}
		if err := json.NewDecoder(io.LimitReader(r.Body, maxBody)).Decode(&req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		got, err := src.fetch(r.Context(), req.Keys)
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		out := make(map[string][]uint64, len(got))
		for i, kv := range got {
			out[strconv.Itoa(i)] = kv
		}
		writeJSON(w, map[string]any{"chunks": out})
	})
	return mux
}

func (p *httpPeer) hello(ctx context.Context) (p2pHello, error) {
	var m helloMsg
	if err := p.do(ctx, http.MethodGet, "/p2p/hello", nil, &m); err != nil {
		return p2pHello{}, err
	}
	return p2pHello{model: m.Model, blockSize: m.BlockSize, chunkTokens: m.ChunkTokens, tp: m.TP, seed: m.Seed}, nil
}

func (p *httpPeer) fetch(ctx context.Context, keys []uint64) (map[int][]uint64, error) {
	var m struct {
		Chunks map[string][]uint64 `json:"chunks"`
	}
	if err := p.do(ctx, http.MethodPost, "/p2p/fetch", map[string]any{"keys": keys}, &m); err != nil {
		return nil, err
	}
	out := make(map[int][]uint64, len(m.Chunks))
	for k, kv := range m.Chunks {
		i, err := strconv.Atoi(k)
		if err != nil || i < 0 || i >= len(keys) {
			continue
		}
		out[i] = kv
	}
	return out, nil
}

var _ tierSource = (*httpPeer)(nil)

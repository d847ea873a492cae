package sim

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
)

// The HTTP side channel lets engines in separate processes read each other's
// blocks, standing in for NIXL's side channel and RDMA reads:
//
//	GET  /meta    → {"engine_id": "...", "mono": 1234.5}
//	POST /read    {"engine_id","request_id","blocks":[...],"tokens":n} → {"data": [[kv...]...]}
//	POST /notify  {"engine_id","request_id"} → 204
//	POST /heartbeat {"engine_id","request_id"} → 204
//
// A wrong engine id answers 409, bad block ids 400.

type readReq struct {
	EngineID  string `json:"engine_id"`
	RequestID string `json:"request_id"`
	Blocks    []int  `json:"blocks"`
	Tokens    int    `json:"tokens"`
}

// SideChannelHandler serves e's side channel over HTTP (rank 0's when e has
// several data-parallel ranks).
func SideChannelHandler(e *Engine) http.Handler { return peerHandler(e) }

// RankSideChannelHandler serves the side channel of e's data-parallel rank
// k over HTTP, the one a reader reaches at e.RankSideChannel(k). It panics
// when k is out of range.
func RankSideChannelHandler(e *Engine, k int) http.Handler { return peerHandler(e.RankPeer(k)) }

func peerHandler(e Peer) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /meta", func(w http.ResponseWriter, r *http.Request) {
		id, mono, err := e.Meta(r.Context())
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		writeJSON(w, map[string]any{"engine_id": id, "mono": mono})
	})
	mux.HandleFunc("POST /read", func(w http.ResponseWriter, r *http.Request) {
		var req readReq
		if err := json.NewDecoder(io.LimitReader(r.Body, maxBody)).Decode(&req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		data, err := e.Read(r.Context(), req.EngineID, req.RequestID, req.Blocks, req.Tokens)
		if err != nil {
			http.Error(w, err.Error(), sideStatus(err))
			return
		}
		writeJSON(w, map[string]any{"data": data})
	})
	mux.HandleFunc("POST /notify", func(w http.ResponseWriter, r *http.Request) {
		var req readReq
		if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		if err := e.Notify(r.Context(), req.EngineID, req.RequestID); err != nil {
			http.Error(w, err.Error(), sideStatus(err))
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	mux.HandleFunc("POST /heartbeat", func(w http.ResponseWriter, r *http.Request) {
		var req readReq
		if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		if err := e.Heartbeat(r.Context(), req.EngineID, req.RequestID); err != nil {
			http.Error(w, err.Error(), sideStatus(err))
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	return mux
}

func sideStatus(err error) int {
	switch {
	case errors.Is(err, ErrEngineID):
		return http.StatusConflict
	case errors.Is(err, errBlockID):
		return http.StatusBadRequest
	default:
		return http.StatusServiceUnavailable
	}
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

// HTTPDialer returns a Registry.Dial that reaches side channels over HTTP
// with client.
func HTTPDialer(client *http.Client) func(host string, port int) Peer {
	return func(host string, port int) Peer {
		return &httpPeer{client: client, base: "http://" + addrKey(host, port)}
	}
}

type httpPeer struct {
	client *http.Client
	base   string
}

func (p *httpPeer) do(ctx context.Context, method, path string, in, out any) error {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, p.base+path, body)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrUnreachable, err)
	}
	resp, err := p.client.Do(req)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrUnreachable, err)
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusConflict:
		return ErrEngineID
	case resp.StatusCode == http.StatusBadRequest:
		return errBlockID
	case resp.StatusCode >= 300:
		return fmt.Errorf("%w: %s answered %d", ErrUnreachable, req.URL.Host, resp.StatusCode)
	}
	if out == nil {
		return nil
	}
	return json.NewDecoder(resp.Body).Decode(out)
}

func (p *httpPeer) Meta(ctx context.Context) (string, float64, error) {
	var m struct {
		EngineID string  `json:"engine_id"`
		Mono     float64 `json:"mono"`
	}
	err := p.do(ctx, http.MethodGet, "/meta", nil, &m)
	return m.EngineID, m.Mono, err
}

func (p *httpPeer) Read(ctx context.Context, engineID, requestID string, blocks []int, tokens int) ([][]uint64, error) {
	var out struct {
		Data [][]uint64 `json:"data"`
	}
	err := p.do(ctx, http.MethodPost, "/read", readReq{engineID, requestID, blocks, tokens}, &out)
	return out.Data, err
}

func (p *httpPeer) Notify(ctx context.Context, engineID, requestID string) error {
	return p.do(ctx, http.MethodPost, "/notify", readReq{EngineID: engineID, RequestID: requestID}, nil)
}

func (p *httpPeer) Heartbeat(ctx context.Context, engineID, requestID string) error {
	return p.do(ctx, http.MethodPost, "/heartbeat", readReq{EngineID: engineID, RequestID: requestID}, nil)
}

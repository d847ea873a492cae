// Package peertier is the router's side of a decode engine's CPU tier
// (vLLM's OffloadingConnector behind the NixlConnector, with the peer tier
// of TieringOffloadingSpec; docs/cpu-tier.md): where a decode engine's
// tier answers peer pulls, what a turn leaves there, and the
// remote_kv_source a prefill leg carries to pull it (what is still there
// is budget.Placement.Resident's estimate).
package peertier

import (
	"encoding/json"
	"net"
	"net/url"
	"strconv"
)

// DefaultPort is the peer tier's base port (VLLM_P2P_SIDE_CHANNEL_PORT's
// default); a data-parallel rank k listens on the base plus k.
const DefaultPort = 5710

// Config is the decode engines' CPU tier as the router is told it: vLLM
// exports neither its capacity nor its address.
type Config struct {
	// Tokens is each decode engine's CPU tier capacity in tokens; 0: no
	// tier.
	Tokens int
	// Port is the peer tier's port on a decode engine's host (0:
	// DefaultPort).
	Port int
	// Peers maps a decode engine's URL to its peer tier's "host:port",
	// overriding its URL's host and Port.
	Peers map[string]string
	// PromptOnly: the decode engines run with offload_prompt_only true
	// (vLLM's default), so their tiers hold prompts, not answers.
	PromptOnly bool
}

// On reports whether the decode engines have a tier.
func (c Config) On() bool { return c.Tokens > 0 }

// Addr returns the peer-tier host and port of a decode engine: Peers'
// entry for its id (its URL, with " (rank N)" for a data-parallel rank)
// or, for a rank, for its base URL (the rank's port is that entry's plus
// the rank, as vLLM binds it); else base's host and Port plus the rank.
// ok is false when neither gives a host and a port.
func (c Config) Addr(id string, base *url.URL, rank int) (host string, port int, ok bool) {
	rank = max(rank, 0)
	if hp, found := c.Peers[id]; found {
		return splitHostPort(hp, 0)
	}
	if base != nil {
		if hp, found := c.Peers[base.String()]; found {
			return splitHostPort(hp, rank)
		}
	}
	if base == nil || base.Hostname() == "" {
		return "", 0, false
	}
	port = c.Port
	if port == 0 {
		port = DefaultPort
	}
	if port+rank > 65535 {
		return "", 0, false
	}
	return base.Hostname(), port + rank, true
}

// ValidPeer reports whether hp is a Peers value: host:port.
func ValidPeer(hp string) bool {
	_, _, ok := splitHostPort(hp, 0)
	return ok
}

// splitHostPort parses hp, host:port, and adds rank to the port.
func splitHostPort(hp string, rank int) (string, int, bool) {
	h, p, err := net.SplitHostPort(hp)
	if err != nil {
		return "", 0, false
	}
	n, err := strconv.Atoi(p)
	if err != nil || n <= 0 || n+rank > 65535 || h == "" {
		return "", 0, false
	}
	return h, n + rank, true
}

// Held returns the tokens a turn of tokens leaves in its decode engine's
// tier: its prompt, or its prompt and answer, in whole blocks (a partial
// last block stays on the GPU).
func (c Config) Held(prompt, tokens, blockSize int) int {
	if c.PromptOnly && prompt > 0 {
		tokens = min(tokens, prompt)
	}
	if blockSize > 1 {
		tokens -= tokens % blockSize
	}
	return max(tokens, 0)
}

// Loadable returns what an engine can load of the resident tokens for a
// prompt of prompt tokens (0: unknown, resident unchanged): vLLM computes
// a prompt's last token and a tier's chunks are whole blocks, so at most
// the whole blocks short of that token.
func Loadable(resident, prompt, blockSize int) int {
	if prompt <= 0 {
		return resident
	}
	bs := max(blockSize, 1)
	return max(min(resident, (prompt-1)/bs*bs), 0)
}

// WithSource returns params, a kv_transfer_params JSON object, with a
// remote_kv_source member naming the peer tier at host:port under the
// transaction id, appended to dst. params must be a JSON object; it is
// returned unchanged (copied) when it is not.
func WithSource(dst, params []byte, id, host string, port int) []byte {
	end := len(params) - 1
	for end >= 0 && isSpace(params[end]) {
		end--
	}
	if end < 1 || params[end] != '}' {
		return append(dst, params...)
	}
	dst = append(dst, params[:end]...)
	if !emptyObject(params[:end]) {
		dst = append(dst, ',')
	}
	dst = append(dst, `"remote_kv_source":{"kv_request_id":`...)
	dst = appendString(dst, id)
	dst = append(dst, `,"remote_host":`...)
	dst = appendString(dst, host)
	dst = append(dst, `,"remote_port":`...)
	dst = strconv.AppendInt(dst, int64(port), 10)
	return append(dst, "}}"...)
}

// emptyObject reports whether b, an object without its closing brace,
// has no member.
func emptyObject(b []byte) bool {
	for i := len(b) - 1; i >= 0; i-- {
		if !isSpace(b[i]) {
			return b[i] == '{'
		}
	}
	return false
}

// appendString appends s as a JSON string.
func appendString(dst []byte, s string) []byte {
	b, _ := json.Marshal(s) // a string always marshals
	return append(dst, b...)
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

package kvroute

import (
	"slices"
	"sync"
	"time"
)

// DecodeKV is the KV one decode engine holds for the live handles this
// Router retained: stored, not yet attached to a prefill request, and not
// past the retention TTL. It is the memory the retention TTL trades against
// the hit rate. A handle the Store dropped early (evicted, or replaced by a
// later turn of the same conversation) is counted until its TTL; other
// Router replicas' handles are not counted.
type DecodeKV struct {
	// Endpoint is the decode endpoint (its URL).
	Endpoint string
	// Handles is the number of live retained handles on it.
	Handles int
	// Tokens is their remote_num_tokens, summed.
	Tokens int64
	// Bytes is Tokens × WithKVBytesPerToken, 0 when that is unset.
	Bytes int64
}

// kvLedger mirrors the Store's live handles: store key -> where its blocks
// are, how many tokens, until when.
type kvLedger struct {
	mu    sync.Mutex
	m     map[string]heldKV
	swept time.Time
}

type heldKV struct {
	endpoint string
	tokens   int
	expires  time.Time
}

func (l *kvLedger) put(key, ep string, tokens int, expires, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.m == nil {
		l.m = map[string]heldKV{}
	}
	l.m[key] = heldKV{endpoint: ep, tokens: tokens, expires: expires}
	if now.Sub(l.swept) >= time.Second {
		l.sweep(now)
	}
}

func (l *kvLedger) take(key string) {
	l.mu.Lock()
	delete(l.m, key)
	l.mu.Unlock()
}

// sweep drops expired entries; l.mu held.
func (l *kvLedger) sweep(now time.Time) {
	l.swept = now
	for k, h := range l.m {
		if !now.Before(h.expires) {
			delete(l.m, k)
		}
	}
}

// DecodeKV returns, for every decode endpoint, the KV it holds for this
// Router's live retained handles, in the endpoints' order. Endpoints that
// were removed but still hold handles follow.
func (r *Router) DecodeKV() []DecodeKV {
	now := r.cfg.clock()
	byEP := map[string]*DecodeKV{}
	var out []DecodeKV
	for _, e := range r.decode.list() {
		out = append(out, DecodeKV{Endpoint: e.url})
	}
	r.kv.mu.Lock()
	r.kv.sweep(now)
	var gone []string
	for _, h := range r.kv.m {
		i := slices.IndexFunc(out, func(d DecodeKV) bool { return d.Endpoint == h.endpoint })
		if i < 0 {
			d, ok := byEP[h.endpoint]
			if !ok {
				d = &DecodeKV{Endpoint: h.endpoint}
				byEP[h.endpoint] = d
				gone = append(gone, h.endpoint)
			}
			d.Handles++
			d.Tokens += int64(h.tokens)
			continue
		}
		out[i].Handles++
		out[i].Tokens += int64(h.tokens)
	}
	r.kv.mu.Unlock()
	slices.Sort(gone)
	for _, ep := range gone {
		out = append(out, *byEP[ep])
	}
	for i := range out {
		out[i].Bytes = out[i].Tokens * r.cfg.kvBytesPerToken
	}
	return out
}

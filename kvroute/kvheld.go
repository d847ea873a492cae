package kvroute

import (
	"hash/maphash"
	"math"
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
	// Bytes is Tokens × WithDecodeMemory's KVBytesPerToken, 0 when that is unset.
	Bytes int64
}

// kvLedger mirrors the Store's live handles: for each store key, where its
// blocks are, how many tokens, until when. It holds 16 bytes per handle in
// a map keyed by a 64-bit hash of the store key (the key itself, about 70
// bytes, is not kept): two keys with the same hash, about one chance in
// 10^9 among 100,000 live handles, share one record, which makes DecodeKV
// count one handle too few until it expires.
//
// Each put looks at a few records (a random run of the map, as Go's map
// iteration starts anywhere) and drops those expired, so that no turn pays
// for a walk of every record; DecodeKV walks them all and drops every
// expired one.
type kvLedger struct {
	mu    sync.Mutex
	seed  maphash.Seed
	m     map[uint64]heldKV
	eps   []string          // interned decode endpoints, by heldKV.ep
	refs  []int             // records per interned endpoint
	epIdx map[string]uint32 // endpoint -> index in eps
	puts  int               // since the endpoints were last re-interned
}

type heldKV struct {
	expires int64 // UnixNano
	tokens  uint32
	ep      uint32
}

func (l *kvLedger) hash(key string) uint64 { return maphash.String(l.seed, key) }

func (l *kvLedger) put(key, ep string, tokens int, expires, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.m == nil {
		l.seed = maphash.MakeSeed()
		l.m = map[uint64]heldKV{}
		l.epIdx = map[string]uint32{}
	}
	i, ok := l.epIdx[ep]
	if !ok {
		i = uint32(len(l.eps))
		l.eps = append(l.eps, ep)
		l.refs = append(l.refs, 0)
		l.epIdx[ep] = i
	}
	h, exp := l.hash(key), expires.UnixNano()
	if old, ok := l.m[h]; ok {
		l.refs[old.ep]--
	}
	l.m[h] = heldKV{expires: exp, tokens: uint32(min(tokens, math.MaxUint32)), ep: i}
	l.refs[i]++
	l.sweep(now.UnixNano(), sweepPerPut)
	if l.puts++; l.puts >= 4096 && len(l.eps) > 64 {
		l.puts = 0
		l.reintern()
	}
}

func (l *kvLedger) take(key string) {
	l.mu.Lock()
	if l.m != nil {
		l.drop(l.hash(key))
	}
	l.mu.Unlock()
}

// sweepPerPut is how many records a put looks at for expired ones: at
// 100,000 live handles and 1,000 puts a second an expired record is found
// within about 3 s.
const sweepPerPut = 32

// sweep drops the expired records among the first n the map's iteration
// gives (all of them for n < 0); l.mu held.
func (l *kvLedger) sweep(now int64, n int) {
	for k, h := range l.m {
		if now >= h.expires {
			l.drop(k)
		}
		if n--; n == 0 {
			return
		}
	}
}

// drop deletes the record under h, if any; l.mu held.
func (l *kvLedger) drop(h uint64) {
	if old, ok := l.m[h]; ok {
		l.refs[old.ep]--
		delete(l.m, h)
	}
}

// reintern interns the endpoints afresh when most of those interned hold
// no record any more (engines replaced one after another); l.mu held.
func (l *kvLedger) reintern() {
	n := 0
	for _, r := range l.refs {
		if r > 0 {
			n++
		}
	}
	if n*2 > len(l.eps) {
		return
	}
	remap := make([]uint32, len(l.eps))
	eps := make([]string, 0, n)
	refs := make([]int, 0, n)
	clear(l.epIdx)
	for i, ep := range l.eps {
		if l.refs[i] > 0 {
			remap[i] = uint32(len(eps))
			l.epIdx[ep] = uint32(len(eps))
			eps = append(eps, ep)
			refs = append(refs, l.refs[i])
		}
	}
	l.eps, l.refs = eps, refs
	for k, h := range l.m {
		h.ep = remap[h.ep]
		l.m[k] = h
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
	r.handles.kv.mu.Lock()
	r.handles.kv.sweep(now.UnixNano(), -1)
	var gone []string
	for _, h := range r.handles.kv.m {
		ep := r.handles.kv.eps[h.ep]
		i := slices.IndexFunc(out, func(d DecodeKV) bool { return d.Endpoint == ep })
		if i < 0 {
			d, ok := byEP[ep]
			if !ok {
				d = &DecodeKV{Endpoint: ep}
				byEP[ep] = d
				gone = append(gone, ep)
			}
			d.Handles++
			d.Tokens += int64(h.tokens)
			continue
		}
		out[i].Handles++
		out[i].Tokens += int64(h.tokens)
	}
	r.handles.kv.mu.Unlock()
	slices.Sort(gone)
	for _, ep := range gone {
		out = append(out, *byEP[ep])
	}
	for i := range out {
		out[i].Bytes = out[i].Tokens * r.cfg.kvBytesPerToken
	}
	return out
}

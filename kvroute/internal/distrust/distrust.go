// Package distrust remembers the prefill engines a conversation must
// avoid. When a prefill engine
// computed other prompt tokens than its render answered within the
// attached prefix (kvroute's prefiller.checkIDs), it had already pulled D's blocks as
// the prefix of its own prompt, and with prefix caching it keeps them under
// the hashes of the tokens it computed: any later request whose prompt
// begins with those tokens, on that engine, reads them. The router cannot
// evict them (vLLM's /reset_prefix_cache is a development endpoint), so the
// conversation's later turns, the ones that extend that prompt, are kept
// off that engine: every turn whose Identifier keys name the conversation
// excludes it from its prefill legs (and runs on the decode engine alone
// when no other prefill engine is left) for poisonTTL after the last turn
// that did. Requests of other conversations (another tenant sending the
// same prompt, or another router sharing the store) are not covered.
package distrust

import (
	"slices"
	"sync"
	"time"
)

// TTL is how long a conversation avoids a prefill engine after its
// last turn that did: a guess at how long the engine's prefix cache keeps
// idle blocks.
const TTL = time.Hour

// MaxKept bounds the conversations remembered; the oldest go first.
const MaxKept = 4096

// Avoided maps retention keys to the prefill engines their conversations
// avoid. The zero value is empty and ready; it is safe for concurrent use.
type Avoided struct {
	mu sync.Mutex
	m  map[string]*entry
}

type entry struct {
	endpoints []string
	until     time.Time
}

// Add makes the conversations of keys avoid endpoint.
func (p *Avoided) Add(keys []string, endpoint string, now time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.m == nil {
		p.m = map[string]*entry{}
	}
	for _, k := range keys {
		e := p.m[k]
		if e == nil {
			p.evict(now)
			e = &entry{}
			p.m[k] = e
		}
		if !slices.Contains(e.endpoints, endpoint) {
			e.endpoints = append(e.endpoints, endpoint)
		}
		e.until = now.Add(TTL)
	}
}

// Avoid returns the endpoints the conversations of keys avoid, and keeps
// them avoided for TTL from now.
func (p *Avoided) Avoid(keys []string, now time.Time) []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []string
	for _, k := range keys {
		e := p.m[k]
		if e == nil {
			continue
		}
		if !now.Before(e.until) {
			delete(p.m, k)
			continue
		}
		e.until = now.Add(TTL)
		for _, ep := range e.endpoints {
			if !slices.Contains(out, ep) {
				out = append(out, ep)
			}
		}
	}
	return out
}

// evict makes room for one entry: the expired ones go, then the one that
// expires first. p.mu held.
func (p *Avoided) evict(now time.Time) {
	if len(p.m) < MaxKept {
		return
	}
	var first string
	var firstUntil time.Time
	for k, e := range p.m {
		if !now.Before(e.until) {
			delete(p.m, k)
			continue
		}
		if first == "" || e.until.Before(firstUntil) {
			first, firstUntil = k, e.until
		}
	}
	if len(p.m) >= MaxKept {
		delete(p.m, first)
	}
}

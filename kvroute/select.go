package kvroute

import (
	"context"
	"slices"
	"sync/atomic"

	"github.com/bidikv/bidikv/transport"
)

// Candidate is an endpoint a Selector may choose.
type Candidate struct {
	// URL is the endpoint's base URL, as configured.
	URL string
	// InFlight is the number of this router's requests now open on it.
	InFlight int
}

// Selection is one choice of endpoint for one leg of a turn.
type Selection struct {
	// Phase is PhasePrefill or PhaseDecode.
	Phase Phase
	// Request is the turn being routed.
	Request *Request
	// Candidates are the endpoints to choose from, in configuration order,
	// less those in Exclude. It is never empty.
	Candidates []Candidate
	// Affinity is, on the decode leg of a hit, the URL of the decode
	// endpoint that held the retained KV: its own prefix cache still covers
	// the conversation, so only the new suffix crosses the network. Empty
	// otherwise.
	Affinity string
	// Exclude lists endpoints that already failed this turn.
	Exclude []string
}

// Selector chooses the endpoint for one leg of a turn. It returns an index
// into s.Candidates. A Selector is called concurrently.
type Selector interface {
	Select(ctx context.Context, s *Selection) (int, error)
}

// SelectorFunc adapts a function to Selector.
type SelectorFunc func(ctx context.Context, s *Selection) (int, error)

// Select calls f(ctx, s).
func (f SelectorFunc) Select(ctx context.Context, s *Selection) (int, error) { return f(ctx, s) }

// LeastLoaded is the default Selector: the affinity endpoint when there is
// one, otherwise the candidate with the fewest in-flight requests, ties
// broken by rotating the starting point.
type LeastLoaded struct {
	next atomic.Uint64
}

// Select implements Selector.
func (l *LeastLoaded) Select(_ context.Context, s *Selection) (int, error) {
	if s.Affinity != "" {
		if i := slices.IndexFunc(s.Candidates, func(c Candidate) bool { return c.URL == s.Affinity }); i >= 0 {
			return i, nil
		}
	}
	n := len(s.Candidates)
	start := int(l.next.Add(1) % uint64(n))
	best := start
	for k := 1; k < n; k++ {
		i := (start + k) % n
		if s.Candidates[i].InFlight < s.Candidates[best].InFlight {
			best = i
		}
	}
	return best, nil
}

// endpoint is a configured upstream with its live load.
type endpoint struct {
	ep       transport.Endpoint
	url      string
	inflight atomic.Int64
}

type pool struct {
	phase     Phase
	endpoints []*endpoint
}

func newPool(phase Phase, addrs []string) (*pool, error) {
	p := &pool{phase: phase}
	for _, a := range addrs {
		ep, err := transport.ParseEndpoint(a)
		if err != nil {
			return nil, err
		}
		p.endpoints = append(p.endpoints, &endpoint{ep: ep, url: ep.String()})
	}
	return p, nil
}

// pick runs the selector over the endpoints not excluded.
func (p *pool) pick(ctx context.Context, sel Selector, req *Request, affinity string, exclude []string) (*endpoint, error) {
	cands := make([]Candidate, 0, len(p.endpoints))
	eps := make([]*endpoint, 0, len(p.endpoints))
	for _, e := range p.endpoints {
		if slices.Contains(exclude, e.url) {
			continue
		}
		cands = append(cands, Candidate{URL: e.url, InFlight: int(e.inflight.Load())})
		eps = append(eps, e)
	}
	if len(cands) == 0 {
		return nil, ErrNoEndpoint
	}
	i, err := sel.Select(ctx, &Selection{Phase: p.phase, Request: req, Candidates: cands, Affinity: affinity, Exclude: exclude})
	if err != nil {
		return nil, err
	}
	if i < 0 || i >= len(eps) {
		return nil, ErrNoEndpoint
	}
	return eps[i], nil
}

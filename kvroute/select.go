package kvroute

import (
	"context"
	"encoding/json"
	"hash/fnv"
	"math/rand/v2"
	"slices"
	"strings"
	"sync/atomic"
)

// defaultAffinityMaxInFlight is the in-flight limit above which the default
// Selector stops sending a conversation's decode leg to the engine that
// holds its KV and balances it instead.
const defaultAffinityMaxInFlight = 64

// Candidate is an endpoint a Selector may choose.
type Candidate struct {
	// URL identifies the endpoint: its base URL, followed by " (rank N)"
	// when it is pinned to a data-parallel rank (transport.Endpoint.String).
	URL string
	// InFlight is the number of this router's requests now open on it.
	InFlight int
	// Weight is the endpoint's relative capacity (transport.Endpoint.Weight,
	// at least 1).
	Weight int
	// Rank is the data-parallel rank the endpoint is pinned to, or
	// transport.NoRank.
	Rank int
	// Healthy is false only when every endpoint of the phase is ejected:
	// the candidates are then all of them, as a last resort.
	Healthy bool

	// A decode engine's memory pressure, as the router last read its
	// /metrics (WithDecodeMemory; zero for prefill engines, for an engine
	// not yet read or of unknown capacity, and with the management off). KVUsage is the share
	// of its KV memory in use, 0 to 1 (vllm:kv_cache_usage_perc: running
	// requests and holds), corrected by the holds this router retained
	// or released since the reading. Waiting is its
	// vllm:num_requests_waiting. Preempting reports that its
	// vllm:num_preemptions_total grew between the last two readings.
	KVUsage    float64
	Waiting    int
	Preempting bool
	// Crowded is KVUsage at or above WithDecodeMemory's HighWatermark, or
	// Preempting: LeastLoaded sends no conversation there while another
	// candidate is not crowded, its affinity included.
	Crowded bool
	// HeldTokens is what this Router's retained handles pin on a decode
	// engine, in whole blocks × its block size (the ledger's
	// budget.Budget.Held, as Router.DecodeKV reports it), and
	// BudgetTokens what they may pin there (WithDecodeMemory's Budget ×
	// its capacity; 0: no budget, its capacity unknown or no hold there
	// yet). Zero for prefill engines and with the management off (a
	// negative Budget). A Selector reads them here; it needs no ledger of
	// its own.
	HeldTokens, BudgetTokens int64
}

// Selection is one choice of endpoint for one leg of a turn.
type Selection struct {
	// Phase is PhasePrefill or PhaseDecode.
	Phase Phase
	// Request is the turn being routed.
	Request *Request
	// Candidates are the endpoints to choose from, in configuration order:
	// the healthy ones less those in Exclude, or, when none is healthy,
	// every endpoint less those in Exclude. It is never empty.
	Candidates []Candidate
	// Affinity is, on the decode leg of a hit, the URL of the decode
	// endpoint that held the retained KV: its own prefix cache still covers
	// the conversation, so only the new suffix crosses the network. On the
	// prefill leg of a turn whose retained KV WithDecodeMemory's
	// management released (to make room, or over the budget), it is
	// the prefill endpoint that served the conversation's last retained
	// turn: its prefix cache holds that prompt. Empty otherwise, and empty
	// when that endpoint is not among the Candidates.
	Affinity string
	// Hint is the client's conversation id (conversationHint), for
	// placement only: a hint never unlocks a retained handle.
	Hint string
	// Exclude lists endpoints that already failed this turn.
	Exclude []string
}

// Selector chooses the endpoint for one leg of a turn. It returns an index
// into s.Candidates. A Selector is called concurrently. It is a public
// seam (ARCHITECTURE.md, Seams), given with WithSelector (ExampleSelector).
type Selector interface {
	Select(ctx context.Context, s *Selection) (int, error)
}

// SelectorFunc adapts a function to Selector.
type SelectorFunc func(ctx context.Context, s *Selection) (int, error)

// Select calls f(ctx, s).
func (f SelectorFunc) Select(ctx context.Context, s *Selection) (int, error) { return f(ctx, s) }

// LeastLoaded is the default Selector.
//
// Decode: the affinity endpoint when there is one, it has fewer than
// MaxInFlight requests open and it is not crowded (Candidate.Crowded: its
// KV memory at or above WithDecodeMemory's HighWatermark, or preempting)
// unless every candidate is; otherwise the candidate with the fewest
// in-flight requests per unit of weight among those not crowded (all of
// them when every one is), ties broken by fewer waiting requests, then
// lower KV usage, then by rotating the starting point. Prefill: the
// affinity endpoint when there is one (Selection.Affinity) and it has
// fewer than MaxInFlight requests open; otherwise the less loaded of two candidates drawn at random
// (power of two choices), which spreads load without herding onto the one
// engine that looked idle. With HashHints, a leg without affinity whose
// request carries a conversation hint goes to the candidate the hint hashes
// to (rendezvous hashing, so adding or removing an engine moves only its own
// share), unless that candidate is over MaxInFlight.
//
// The zero LeastLoaded has no in-flight limit and ignores hints; the
// Router's default is &LeastLoaded{MaxInFlight: defaultAffinityMaxInFlight}.
type LeastLoaded struct {
	// MaxInFlight is the number of in-flight requests at which an affinity
	// or hinted endpoint is passed over; 0 means no limit.
	MaxInFlight int
	// HashHints pins legs without affinity by their conversation hint,
	// else by the agent session id the request's headers carry
	// (SessionHeaders).
	HashHints bool
	// SessionHeaders are the headers in which agents name their session,
	// read in order when a request carries no conversation hint: for
	// placement only (with HashHints), never to find a handle, so a
	// session's first turns, and its turns whose hold was released, go to
	// the engines whose prefix caches hold its history. nil means
	// x-claude-code-session-id (Claude Code), session_id and session-id
	// (Codex), x-codex-turn-metadata (Codex: a JSON object, whose
	// session_id, else thread_id, is read; a turn_id alone names no
	// session), x-session-affinity and x-dynamo-session-id; an empty,
	// non-nil slice reads none. A header whose value is a JSON object is
	// read the same way; one without either field is skipped.
	SessionHeaders []string

	next atomic.Uint64
}

// Select implements Selector.
func (l *LeastLoaded) Select(_ context.Context, s *Selection) (int, error) {
	if s.Affinity != "" {
		if i := slices.IndexFunc(s.Candidates, func(c Candidate) bool { return c.URL == s.Affinity }); i >= 0 && l.under(s.Candidates[i]) &&
			(!s.Candidates[i].Crowded || !roomy(s.Candidates)) {
			return i, nil
		}
	}
	if l.HashHints && s.Affinity == "" {
		if hint := l.hint(s); hint != "" {
			if i := rendezvous(s.Candidates, hint); l.under(s.Candidates[i]) && !s.Candidates[i].Crowded {
				return i, nil
			}
		}
	}
	if s.Phase == PhasePrefill && len(s.Candidates) > 2 {
		a := rand.IntN(len(s.Candidates))
		b := rand.IntN(len(s.Candidates) - 1)
		if b >= a {
			b++
		}
		if lighter(s.Candidates[b], s.Candidates[a]) {
			return b, nil
		}
		return a, nil
	}
	n := len(s.Candidates)
	start := int(l.next.Add(1) % uint64(n))
	best := start
	for k := 1; k < n; k++ {
		i := (start + k) % n
		if lighter(s.Candidates[i], s.Candidates[best]) {
			best = i
		}
	}
	return best, nil
}

// roomy reports whether some candidate is not crowded.
func roomy(cs []Candidate) bool {
	return slices.ContainsFunc(cs, func(c Candidate) bool { return !c.Crowded })
}

func (l *LeastLoaded) under(c Candidate) bool {
	return l.MaxInFlight <= 0 || c.InFlight < l.MaxInFlight
}

// lighter reports whether a is the better place than b: not crowded when
// b is, else less load per unit of weight, else fewer requests waiting.
func lighter(a, b Candidate) bool {
	if a.Crowded != b.Crowded {
		return !a.Crowded
	}
	x, y := int64(a.InFlight)*int64(weight(b)), int64(b.InFlight)*int64(weight(a))
	if x != y {
		return x < y
	}
	if a.Waiting != b.Waiting {
		return a.Waiting < b.Waiting
	}
	return a.KVUsage < b.KVUsage
}

func weight(c Candidate) int {
	if c.Weight < 1 {
		return 1
	}
	return c.Weight
}

// hint is what s is pinned by: its conversation hint, else the first of
// l's session headers its request carries.
func (l *LeastLoaded) hint(s *Selection) string {
	if s.Hint != "" || s.Request == nil {
		return s.Hint
	}
	defaults := [...]string{"X-Claude-Code-Session-Id", "Session_id", "Session-Id", "X-Codex-Turn-Metadata",
		"X-Session-Affinity", "X-Dynamo-Session-Id"}
	names := l.SessionHeaders
	if names == nil {
		names = defaults[:]
	}
	for _, n := range names {
		if v := sessionIn(s.Request.Header.Get(n)); v != "" {
			return "session\x00" + v
		}
	}
	return ""
}

// maxSessionJSON bounds the header value sessionIn decodes as JSON.
const maxSessionJSON = 16 << 10

// sessionIn returns the session a header value names: the value itself,
// or, when it is a JSON object (Codex's x-codex-turn-metadata), its
// session_id, else its thread_id, else "" (a turn_id changes every turn
// and names no session).
func sessionIn(v string) string {
	v = strings.TrimSpace(v)
	if !strings.HasPrefix(v, "{") {
		return v
	}
	var meta struct {
		SessionID string `json:"session_id"`
		ThreadID  string `json:"thread_id"`
	}
	if len(v) > maxSessionJSON || json.Unmarshal([]byte(v), &meta) != nil {
		return ""
	}
	if id := strings.TrimSpace(meta.SessionID); id != "" {
		return id
	}
	return strings.TrimSpace(meta.ThreadID)
}

// rendezvous returns the candidate with the lowest hash of key and its
// URL, scaled down by its weight, so that heavier endpoints win more keys
// and removing one endpoint moves only the keys it had.
func rendezvous(cands []Candidate, key string) int {
	best, bestScore := 0, uint64(0)
	for i, c := range cands {
		h := fnv.New64a()
		_, _ = h.Write([]byte(key))
		_, _ = h.Write([]byte{0})
		_, _ = h.Write([]byte(c.URL))
		score := mix(h.Sum64()) / uint64(weight(c))
		if i == 0 || score < bestScore {
			best, bestScore = i, score
		}
	}
	return best
}

// mix finalises a 64-bit hash (splitmix64) so that similar keys spread.
func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

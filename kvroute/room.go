package kvroute

import (
	"context"
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/capability"
	"github.com/bidikv/bidikv/kvroute/internal/upstream"
	"github.com/bidikv/bidikv/retention/budget"
)

// What room a decode leg may make on arrival (memory.go, arrive). A leg
// is counted as what it can really take on its engine: its prompt and
// what it may generate, clipped to the engine's max_model_len (read from
// its GET /v1/models beside its /metrics; else its KV capacity). A request
// the engine will reject makes none: vLLM answers 400 when a request's
// max_tokens (chat: max_completion_tokens when given) is over
// max_model_len, or its prompt plus max_tokens is (TokenizeParams in
// vllm/renderers/params.py, with max_output_tokens from the request's
// build_tok_params). A turn makes room once, whatever legs it sends
// (turn.roomMade). And what one principal's requests release of other
// tenants' holds is rate-limited (DecodeMemory's RoomRate): a share of
// the engine's capacity per minute; its own tenant's holds are released
// for it without limit. So a client that asks for more than it uses
// (a huge max_tokens, again and again) cannot drain the holds of every
// tenant on an engine.

// liveTokens is what t's decode leg may take on an engine of max_model_len
// maxLen and capacity tokens (0: unknown): its prompt (as P's answer or
// the turn's verification counted it, else its body's bytes /
// bytesPerToken) and what it may generate (max_completion_tokens,
// max_tokens or Responses' max_output_tokens, else defaultGeneration),
// clipped to maxLen, else to capacity. admit is false for a request the
// engine will reject: its limit over maxLen, or with a prompt counted
// exactly, prompt and limit together.
func liveTokens(t *turn, maxLen, capacity int64) (tokens int64, admit bool) {
	prompt, exact := int64(t.prompt), true
	if prompt <= 0 {
		prompt = int64(t.rec.PromptTokens)
	}
	if prompt <= 0 {
		prompt, exact = int64(len(t.req.Body)/bytesPerToken), false
	}
	gen, asked := int64(defaultGeneration), false
	for _, k := range [...]string{"max_completion_tokens", "max_tokens", "max_output_tokens"} {
		if v, ok := t.req.Field(k); ok {
			if n, ok := jsonraw.Int(v); ok && n > 0 {
				gen, asked = n, true
				break
			}
		}
	}
	if maxLen > 0 && asked && (gen > maxLen || (exact && prompt+gen > maxLen)) {
		return 0, false
	}
	tokens = prompt + min(gen, 1<<40)
	if limit := maxLen; limit > 0 || capacity > 0 {
		if limit <= 0 {
			limit = capacity
		}
		tokens = min(tokens, limit)
	}
	return tokens, true
}

// makeRoom chooses the holds to release so that t's decode leg fits on ep,
// an engine of capacity tokens: the ledger's victims for the room the
// engine's live legs need, of which other tenants' holds only up to the
// turn's principal's allowance.
func makeRoom(m *decodeMemory, t *turn, ep *endpoint, capacity int64, now time.Time) []budget.Victim {
	principal := t.req.Principal()
	allow := m.limits.allowance(principal, capacity, now)
	var limited bool
	victims := m.rel.chosen.choose(func() (v []budget.Victim) {
		v, limited = m.ledger.VictimsFor(ep.url, m.room(ep), t.req.tenant, allow, now)
		return v
	})
	if limited {
		m.stats.roomLimited.Add(1)
	}
	var others int64
	for _, v := range victims {
		if v.Other {
			others += int64(v.Tokens)
		}
	}
	m.limits.charge(principal, others, capacity, now)
	return victims
}

// maxRoomPrincipals bounds the principals whose use of RoomRate is
// remembered: those that released other tenants' holds within the last
// minute. Past it, the principal idle longest is forgotten (its allowance
// full again).
const maxRoomPrincipals = 4096

// roomLimits is each principal's allowance for releasing other tenants'
// holds on arrival: a token bucket of capacity shares, refilled at rate a
// minute up to rate (negative: no limit). A principal not in the map has
// a full bucket.
type roomLimits struct {
	rate float64
	mu   sync.Mutex
	m    map[string]roomBucket
}

type roomBucket struct {
	level float64 // shares of capacity left at at
	at    time.Time
}

// level is b's allowance at now, in shares of capacity.
func (l *roomLimits) level(b roomBucket, now time.Time) float64 {
	return min(b.level+l.rate*max(now.Sub(b.at), 0).Minutes(), l.rate)
}

// allowance is what principal may release of other tenants' holds on an
// engine of capacity tokens now; -1: no limit.
func (l *roomLimits) allowance(principal string, capacity int64, now time.Time) int64 {
	if l.rate < 0 || capacity <= 0 {
		return -1
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	lv := l.rate
	if b, ok := l.m[principal]; ok {
		lv = l.level(b, now)
	}
	return int64(max(lv, 0) * float64(capacity))
}

// charge counts tokens of other tenants' holds released for principal on
// an engine of capacity tokens.
func (l *roomLimits) charge(principal string, tokens, capacity int64, now time.Time) {
	if l.rate < 0 || tokens <= 0 || capacity <= 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	b, ok := l.m[principal]
	lv := l.rate
	if ok {
		lv = l.level(b, now)
	} else {
		l.makeSpace(now)
	}
	if l.m == nil {
		l.m = map[string]roomBucket{}
	}
	l.m[principal] = roomBucket{level: lv - float64(tokens)/float64(capacity), at: now}
}

// makeSpace forgets the principals whose bucket is full again, and, the
// map still full, the one idle longest. l.mu held.
func (l *roomLimits) makeSpace(now time.Time) {
	if len(l.m) < maxRoomPrincipals {
		return
	}
	oldest, at := "", now
	for p, b := range l.m {
		if l.level(b, now) >= l.rate {
			delete(l.m, p)
		} else if b.at.Before(at) {
			oldest, at = p, b.at
		}
	}
	if len(l.m) >= maxRoomPrincipals {
		delete(l.m, oldest)
	}
}

// maxModelsBytes bounds a GET /v1/models answer.
const maxModelsBytes = 1 << 20

// readModelLen reads e's max_model_len from its GET /v1/models when it is
// unknown or the engine restarted since it was read (start: its
// process_start_time_seconds now, zero when unknown).
func readModelLen(ctx context.Context, m *decodeMemory, e *endpoint, start time.Time) {
	p := &e.mem
	p.mu.Lock()
	known := p.maxModelLen > 0 && (start.IsZero() || start.Equal(p.lenStart))
	p.mu.Unlock()
	if known {
		return
	}
	var body []byte
	status, err := m.client.Call(ctx, e.ep, upstream.Call{Path: "/v1/models", Timeout: restartCheckTimeout, Limit: maxModelsBytes}, func(r io.Reader) (err error) {
		body, err = io.ReadAll(r)
		return err
	})
	if err != nil || status != http.StatusOK {
		return
	}
	if n, ok := capability.MaxModelLen(body); ok {
		p.mu.Lock()
		p.maxModelLen, p.lenStart = int64(n), start
		p.mu.Unlock()
	}
}

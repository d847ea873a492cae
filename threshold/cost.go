package threshold

import (
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jellydator/ttlcache/v3"
)

// Rates are the engine costs a [CostModel] starts from (its priors) and
// learns. A prefill of n tokens after ctx positions already held costs
//
//	Fixed + PerToken×n + AttentionPerPair×n×(ctx + (n-1)/2)
//
// (every computed token attends to every earlier position); a KV read of n
// tokens costs Fixed + PerToken×n.
type Rates struct {
	// PrefillFixed, PrefillPerToken and PrefillAttention are the prefill
	// engine's prefill (attention in nanoseconds per token pair).
	PrefillFixed     time.Duration
	PrefillPerToken  time.Duration
	PrefillAttention float64
	// PullFixed and PullPerToken are the prefill engine's read of the
	// decode engine's retained blocks.
	PullFixed    time.Duration
	PullPerToken time.Duration
	// DecodeFirstFixed and DecodeReadPerToken are the decode engine's part
	// of a disaggregated turn: its read of the prefill engine's new blocks
	// (per token) and its first step (fixed).
	DecodeFirstFixed   time.Duration
	DecodeReadPerToken time.Duration
	// LocalFixed, LocalPerToken and LocalAttention are a decode engine's
	// own prefill of a plain request, up to its first token: it shares its
	// steps with the decode batch, so it is usually slower per token than
	// the prefill engine's.
	LocalFixed     time.Duration
	LocalPerToken  time.Duration
	LocalAttention float64
	// InFlightCost is added to a decode-local estimate per request already
	// open on the decode engine (its batch slows the prefill). It is a
	// fixed prior, not learned.
	InFlightCost time.Duration
	// PeerFixed and PeerPerToken are the prefill engine's pull of a
	// decode engine's CPU tier (PathPeer): the lookup round trip, then
	// the network copy into its own CPU tier and the host-to-device load
	// per token (priced as the KV read PullFixed and PullPerToken, plus
	// the host-to-device copy: never cheaper than a GPU hold's pull).
	// Fixed priors, not learned.
	PeerFixed    time.Duration
	PeerPerToken time.Duration
	// TierLoadPerToken is a decode engine's reload of its own CPU tier
	// into GPU memory (host to device), per token, before a decode-local
	// turn of a conversation whose hold was released. A fixed prior.
	TierLoadPerToken time.Duration
}

// PeerSaves returns what a prefill of prompt tokens saves by pulling the
// first resident of them from a decode engine's CPU tier (PathPeer)
// instead of computing them: the prefill of those tokens (with their
// attention) less the pull's cost. Negative: the pull costs more.
func (r Rates) PeerSaves(resident, prompt int) time.Duration {
	if resident <= 0 {
		return 0
	}
	prompt = max(prompt, resident)
	rest := prompt - resident
	computed := float64(r.PrefillPerToken)*float64(resident) +
		r.PrefillAttention*(pairs(prompt, 0)-pairs(rest, resident))
	return time.Duration(computed) - r.PeerFixed - time.Duration(resident)*r.PeerPerToken
}

// DefaultRates are priors for a dense ~30B model on one 8-GPU node, in
// the range of the published 1P1D figures; the decode engine's own prefill
// is assumed as fast as the prefill engine's, which is optimistic, so that
// the model tries decode-local turns and learns their true cost.
func DefaultRates() Rates {
	return Rates{
		PrefillFixed:       90 * time.Millisecond,
		PrefillPerToken:    16 * time.Microsecond,
		PrefillAttention:   1,
		PullFixed:          20 * time.Millisecond,
		PullPerToken:       6 * time.Microsecond,
		DecodeFirstFixed:   30 * time.Millisecond,
		DecodeReadPerToken: 6 * time.Microsecond,
		LocalFixed:         20 * time.Millisecond,
		LocalPerToken:      16 * time.Microsecond,
		LocalAttention:     1,
		InFlightCost:       time.Millisecond,
		PeerFixed:          20 * time.Millisecond,
		PeerPerToken:       7 * time.Microsecond,
		TierLoadPerToken:   time.Microsecond,
	}
}

// Defaults of a [CostConfig].
const (
	// DefaultMaxLocalSuffix bounds the suffix of a decode-local turn, in
	// tokens: a longer prefill on a decode engine stalls its decode batch.
	DefaultMaxLocalSuffix = 4096
	// DefaultMaxLocalInFlight bounds the decode-local prefills one decode
	// engine runs at once.
	DefaultMaxLocalInFlight = 2
	// DefaultPriorWeight is how many observations the priors count as.
	DefaultPriorWeight = 1.0
	// DefaultForget is the weight an observation keeps per later one.
	DefaultForget = 0.98
	// DefaultMaxLocalAge is the default CostConfig.MaxLocalAge: a handle
	// older than half the retention TTL is renewed by a pull.
	DefaultMaxLocalAge = 0.5
)

// CostConfig configures a [CostModel]. The zero value of a field means
// its default.
type CostConfig struct {
	// Priors are the rates before any observation (default DefaultRates).
	// A zero Rates means the default; set a field to a small positive
	// value to make it near zero.
	Priors Rates
	// Threshold is the engines' kv_recompute_threshold, for Reuse
	// (default DefaultThreshold; a negative value disables the check).
	Threshold int
	// MaxLocalSuffix bounds a decode-local turn's suffix in tokens
	// (default DefaultMaxLocalSuffix; negative: never decode-local).
	MaxLocalSuffix int
	// MaxLocalInFlight bounds the decode-local prefills per decode engine
	// (default DefaultMaxLocalInFlight; negative: never decode-local).
	MaxLocalInFlight int
	// PriorWeight is how many observations the priors weigh (default
	// DefaultPriorWeight).
	PriorWeight float64
	// Forget is the weight, in (0, 1], an observation keeps per later
	// observation of the same model, so the rates follow the engines'
	// load (default DefaultForget; 1 never forgets).
	Forget float64
	// Static turns learning off: Observe is ignored and the priors hold.
	Static bool
	// NoDeferred compares a decode-local turn by its own time to first
	// token only. By default its suffix's prefill on the prefill engine is
	// added: the turn leaves the retained handle behind, so the next turn
	// that pulls computes that suffix again there.
	NoDeferred bool
	// MaxLocalAge bounds, as a share of Turn.RetentionTTL, the age of a
	// handle a decode-local turn may leave in place (default
	// DefaultMaxLocalAge; negative: no bound). Such a turn does not renew
	// the handle: if the conversation's next turn comes as late after this
	// one as this one came after the handle, the handle must still be
	// live.
	MaxLocalAge float64
}

// ErrInvalidCost is returned by [NewCostModel] for a configuration it
// refuses.
var ErrInvalidCost = errors.New("threshold: invalid cost model")

// CostModel estimates each path's time to first token from the turn's
// token counts and rates learned online from observed turns (the
// decode-local rates per decode engine), and chooses
// the cheapest: decode-local only within its bounds, and counting the
// suffix's later prefill on P (CostConfig.NoDeferred). It is a [Chooser], a
// [Learner] and, for Reuse, the engine's threshold rule. Safe for
// concurrent use.
type CostModel struct {
	cfg    CostConfig
	policy Policy

	mu                  sync.Mutex
	prefill, dec, loc   *linear
	pCoef, dCoef, lCoef []float64
	// Each decode engine's own decode-local rates, once it has been
	// observed; loc pools every engine's, for engines not yet seen. The
	// maxEngines most recently used are kept (least recently used out), so
	// that engines replaced one after another (a Deployment's rollouts
	// under DNS discovery) neither grow the model nor lock newer engines
	// out of rates of their own.
	engines *ttlcache.Cache[string, *engineFit]

	local sync.Map // decode URL -> *atomic.Int64: decode-local prefills running
}

type engineFit struct {
	lin  *linear
	coef []float64
}

const maxEngines = 1024 // decode engines with their own rates, the most recently used

var _ Chooser = (*CostModel)(nil)
var _ Learner = (*CostModel)(nil)

// Feature scales: tokens in thousands, token pairs in millions, times in
// milliseconds, so that the priors and the data weigh alike.
const (
	tokScale  = 1e3
	pairScale = 1e6
	msPerNs   = 1e-6
)

// NewCostModel returns a CostModel for c: a zero field keeps its default.
// It validates c once and returns every problem (joined), each an error
// wrapping ErrInvalidCost that names the field: a negative rate, or a
// PriorWeight or Forget out of range.
func NewCostModel(c CostConfig) (*CostModel, error) {
	if c.Priors == (Rates{}) {
		c.Priors = DefaultRates()
	}
	if d := DefaultRates(); c.Priors.PeerFixed == 0 && c.Priors.PeerPerToken == 0 && c.Priors.TierLoadPerToken == 0 {
		// Priors from before the CPU tier's rates: a tier pull is priced
		// as the pull is, plus the host-to-device copy.
		c.Priors.PeerFixed, c.Priors.TierLoadPerToken = c.Priors.PullFixed, d.TierLoadPerToken
		c.Priors.PeerPerToken = c.Priors.PullPerToken + d.TierLoadPerToken
	}
	p := c.Priors
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalidCost}, args...)...))
	}
	for _, d := range []time.Duration{p.PrefillFixed, p.PrefillPerToken, p.PullFixed, p.PullPerToken,
		p.DecodeFirstFixed, p.DecodeReadPerToken, p.LocalFixed, p.LocalPerToken, p.InFlightCost, p.PeerFixed, p.PeerPerToken, p.TierLoadPerToken} {
		if d < 0 {
			bad("negative rate in Priors (%v)", d)
			break
		}
	}
	if p.PrefillAttention < 0 || p.LocalAttention < 0 {
		bad("negative attention rate in Priors")
	}
	switch {
	case c.PriorWeight == 0:
		c.PriorWeight = DefaultPriorWeight
	case c.PriorWeight < 0 || math.IsNaN(c.PriorWeight):
		bad("PriorWeight %v is negative", c.PriorWeight)
	}
	switch {
	case c.Forget == 0:
		c.Forget = DefaultForget
	case !(c.Forget > 0 && c.Forget <= 1):
		bad("Forget %v is not in (0, 1]", c.Forget)
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	if c.MaxLocalAge == 0 {
		c.MaxLocalAge = DefaultMaxLocalAge
	}
	if c.MaxLocalSuffix == 0 {
		c.MaxLocalSuffix = DefaultMaxLocalSuffix
	}
	if c.MaxLocalInFlight == 0 {
		c.MaxLocalInFlight = DefaultMaxLocalInFlight
	}
	m := &CostModel{cfg: c, engines: ttlcache.New(ttlcache.WithCapacity[string, *engineFit](maxEngines))}
	switch {
	case c.Threshold < 0:
		m.policy = engine{threshold: 0}
	case c.Threshold == 0:
		m.policy = Default()
	default:
		m.policy = engine{threshold: c.Threshold}
	}
	ms := func(d time.Duration) float64 { return float64(d) * msPerNs }
	// Prefill leg: [fixed, pull fixed, pull per 1k, compute per 1k, attention per 1M pairs].
	m.prefill = newLinear([]float64{ms(p.PrefillFixed), ms(p.PullFixed), ms(p.PullPerToken) * tokScale,
		ms(p.PrefillPerToken) * tokScale, p.PrefillAttention * msPerNs * pairScale}, c.PriorWeight, c.Forget)
	// Decode engine after a prefill leg: [first step, read per 1k].
	m.dec = newLinear([]float64{ms(p.DecodeFirstFixed), ms(p.DecodeReadPerToken) * tokScale}, c.PriorWeight, c.Forget)
	// Decode-local: [fixed, per 1k, attention per 1M pairs].
	m.loc = newLinear([]float64{ms(p.LocalFixed), ms(p.LocalPerToken) * tokScale, p.LocalAttention * msPerNs * pairScale},
		c.PriorWeight, c.Forget)
	m.pCoef, m.dCoef, m.lCoef = m.prefill.solve(), m.dec.solve(), m.loc.solve()
	return m, nil
}

// Reuse implements [Policy] with the engine's threshold rule.
func (m *CostModel) Reuse(in Input) bool { return m.policy.Reuse(in) }

// pairs is Σ over n computed tokens of the positions each attends to after
// ctx held ones.
func pairs(n, ctx int) float64 { return float64(n) * (float64(ctx) + float64(n-1)/2) }

func pullX(in Turn) []float64 {
	s := in.Suffix()
	return []float64{1, 1, float64(in.ReusableTokens) / tokScale, float64(s) / tokScale, pairs(s, in.ReusableTokens) / pairScale}
}

func recomputeX(in Turn) []float64 {
	return []float64{1, 0, 0, float64(in.PromptTokens) / tokScale, pairs(in.PromptTokens, 0) / pairScale}
}

// decodeX: after a pull the decode engine reads the suffix (it holds the
// verified prefix); after a recompute, which may land on any decode
// engine, the whole prompt.
func decodeX(in Turn, whole bool) []float64 {
	n := in.Suffix()
	if whole {
		n = in.PromptTokens
	}
	return []float64{1, float64(n) / tokScale}
}

func localX(in Turn) []float64 {
	s := in.Suffix()
	return []float64{1, float64(s) / tokScale, pairs(s, in.ReusableTokens) / pairScale}
}

func dur(ms float64) time.Duration { return time.Duration(math.Round(max(ms, 0) / msPerNs)) }

// Estimate returns the estimated engine time to first token of each path
// for in, without choosing or reserving anything.
func (m *CostModel) Estimate(in Turn) (pull, local, recompute time.Duration) {
	m.mu.Lock()
	pull = dur(dot(m.pCoef, pullX(in)) + dot(m.dCoef, decodeX(in, false)))
	recompute = dur(dot(m.pCoef, recomputeX(in)) + dot(m.dCoef, decodeX(in, true)))
	lc := m.lCoef
	if it := m.engines.Get(in.Decode); it != nil {
		lc = it.Value().coef
	}
	local = dur(dot(lc, localX(in))) + time.Duration(max(in.DecodeInFlight, 0))*m.cfg.Priors.InFlightCost
	m.mu.Unlock()
	if in.FromCPU {
		pr, n := m.cfg.Priors, time.Duration(max(in.ReusableTokens, 0))
		pull += pr.PeerFixed - pr.PullFixed + n*(pr.PeerPerToken-pr.PullPerToken)
		local += n * pr.TierLoadPerToken
	}
	return pull, local, recompute
}

// Choose implements [Chooser]: the cheapest estimate (decode-local's
// with its deferred cost, see CostConfig.NoDeferred), decode-local only
// when the suffix is within MaxLocalSuffix, the handle is young enough
// (MaxLocalAge) and the decode engine runs fewer than MaxLocalInFlight
// decode-local prefills (reserving one until Release). A turn with unknown token counts takes PathPull.
func (m *CostModel) Choose(in Turn) Choice {
	if in.PromptTokens <= 0 || in.ReusableTokens <= 0 {
		return Choice{Path: PathPull}
	}
	pull, local, rec := m.Estimate(in)
	c := Choice{Path: PathPull, Estimate: pull, Pull: pull, Local: local, Recompute: rec}
	if rec < pull {
		c.Path, c.Estimate = PathRecompute, rec
	}
	if local+m.deferred(in) >= c.Estimate {
		return c
	}
	if m.cfg.MaxLocalSuffix < 0 || m.cfg.MaxLocalInFlight < 0 || in.Suffix() > m.cfg.MaxLocalSuffix {
		c.Refusal = RefuseLocalSuffix
		return c
	}
	if m.cfg.MaxLocalAge >= 0 && in.RetentionTTL > 0 && float64(in.HandleAge) > m.cfg.MaxLocalAge*float64(in.RetentionTTL) {
		c.Refusal = RefuseLocalAge
		return c
	}
	v, _ := m.local.LoadOrStore(in.Decode, new(atomic.Int64))
	n := v.(*atomic.Int64)
	for {
		cur := n.Load()
		if cur >= int64(m.cfg.MaxLocalInFlight) {
			c.Refusal = RefuseLocalBusy
			return c
		}
		if n.CompareAndSwap(cur, cur+1) {
			break
		}
	}
	c.Path, c.Estimate = PathLocal, local
	c.release, c.done = n, new(atomic.Bool)
	return c
}

// deferred is what a decode-local turn adds to a later pull: its suffix's
// prefill on the prefill engine, less the fixed cost the pull pays anyway.
func (m *CostModel) deferred(in Turn) time.Duration {
	if m.cfg.NoDeferred {
		return 0
	}
	s := in.Suffix()
	m.mu.Lock()
	defer m.mu.Unlock()
	p := m.pCoef
	return dur(p[3]*float64(s)/tokScale + p[4]*pairs(s, in.ReusableTokens)/pairScale)
}

// LocalInFlight returns the decode-local prefills now reserved on the
// decode engine decode.
func (m *CostModel) LocalInFlight(decode string) int {
	if v, ok := m.local.Load(decode); ok {
		return int(v.(*atomic.Int64).Load())
	}
	return 0
}

// Observe implements [Learner]: it folds the turn's times into the rates
// of the legs it ran. Observations without token counts or times are
// ignored, and so is everything when CostConfig.Static is set.
func (m *CostModel) Observe(o Observation) {
	in := Turn{PromptTokens: o.PromptTokens, ReusableTokens: o.ReusableTokens, Decode: o.Decode}
	if m.cfg.Static || in.PromptTokens <= 0 || o.DecodeFirst <= 0 {
		return
	}
	ms := func(d time.Duration) float64 { return float64(d) * msPerNs }
	m.mu.Lock()
	defer m.mu.Unlock()
	switch o.Path {
	case PathLocal:
		if in.ReusableTokens <= 0 {
			return
		}
		x, y := localX(in), ms(o.DecodeFirst)
		var f *engineFit
		if it := m.engines.Get(o.Decode); it != nil {
			f = it.Value()
		} else {
			// A new engine starts from what the others taught.
			f = &engineFit{lin: m.loc.clone()}
			m.engines.Set(o.Decode, f, ttlcache.NoTTL)
		}
		m.loc.add(x, y)
		m.lCoef = m.loc.solve()
		f.lin.add(x, y)
		f.coef = f.lin.solve()
	case PathPull, PathRecompute:
		if o.Prefill <= 0 || (o.Path == PathPull && in.ReusableTokens <= 0) {
			return
		}
		x := recomputeX(in)
		if o.Path == PathPull {
			x = pullX(in)
		}
		m.prefill.add(x, ms(o.Prefill))
		m.dec.add(decodeX(in, o.Path == PathRecompute), ms(o.DecodeFirst))
		m.pCoef, m.dCoef = m.prefill.solve(), m.dec.solve()
	}
}

// Rates returns the rates the model estimates with now; the decode-local
// ones pooled over every decode engine (each engine's own are used for its
// turns).
func (m *CostModel) Rates() Rates {
	m.mu.Lock()
	defer m.mu.Unlock()
	p, d, l := m.pCoef, m.dCoef, m.lCoef
	return Rates{
		PrefillFixed: dur(p[0]), PullFixed: dur(p[1]), PullPerToken: dur(p[2] / tokScale),
		PrefillPerToken: dur(p[3] / tokScale), PrefillAttention: p[4] / msPerNs / pairScale,
		DecodeFirstFixed: dur(d[0]), DecodeReadPerToken: dur(d[1] / tokScale),
		LocalFixed: dur(l[0]), LocalPerToken: dur(l[1] / tokScale), LocalAttention: l[2] / msPerNs / pairScale,
		InFlightCost: m.cfg.Priors.InFlightCost, PeerFixed: m.cfg.Priors.PeerFixed, PeerPerToken: m.cfg.Priors.PeerPerToken,
		TierLoadPerToken: m.cfg.Priors.TierLoadPerToken,
	}
}

func dot(a, b []float64) float64 {
	s := 0.0
	for i := range a {
		s += a[i] * b[i]
	}
	return s
}

// linear is ridge regression towards a prior, with exponential forgetting
// of the data: it minimises w·|θ-θ0|² + Σ_k γ^(N-k) (y_k - x_k·θ)².
type linear struct {
	prior  []float64
	w, fgt float64
	a      [][]float64 // Σ γ x xᵀ
	b      []float64   // Σ γ x y
}

func newLinear(prior []float64, w, forget float64) *linear {
	n := len(prior)
	l := &linear{prior: prior, w: w, fgt: forget, a: make([][]float64, n), b: make([]float64, n)}
	for i := range l.a {
		l.a[i] = make([]float64, n)
	}
	return l
}

func (l *linear) clone() *linear {
	c := newLinear(l.prior, l.w, l.fgt)
	for i := range l.a {
		copy(c.a[i], l.a[i])
	}
	copy(c.b, l.b)
	return c
}

func (l *linear) add(x []float64, y float64) {
	for i := range l.a {
		l.b[i] = l.fgt*l.b[i] + x[i]*y
		for j := range l.a[i] {
			l.a[i][j] = l.fgt*l.a[i][j] + x[i]*x[j]
		}
	}
}

// solve returns θ, every coefficient clamped at 0 (no rate is negative).
func (l *linear) solve() []float64 {
	n := len(l.prior)
	m := make([][]float64, n)
	for i := range m {
		m[i] = make([]float64, n+1)
		copy(m[i], l.a[i])
		m[i][i] += l.w
		m[i][n] = l.b[i] + l.w*l.prior[i]
	}
	// Gaussian elimination with partial pivoting; the matrix is positive
	// definite (w > 0), so no pivot is zero.
	for c := range n {
		p := c
		for r := c + 1; r < n; r++ {
			if math.Abs(m[r][c]) > math.Abs(m[p][c]) {
				p = r
			}
		}
		m[c], m[p] = m[p], m[c]
		for r := c + 1; r < n; r++ {
			f := m[r][c] / m[c][c]
			for k := c; k <= n; k++ {
				m[r][k] -= f * m[c][k]
			}
		}
	}
	out := make([]float64, n)
	for r := n - 1; r >= 0; r-- {
		s := m[r][n]
		for k := r + 1; k < n; k++ {
			s -= m[r][k] * out[k]
		}
		out[r] = s / m[r][r]
	}
	for i := range out {
		if !(out[i] > 0) {
			out[i] = 0
		}
	}
	return out
}

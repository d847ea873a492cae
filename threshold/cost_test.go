package threshold_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/threshold"
)

// breakEvenRates have no attention terms, so both estimates are linear in
// the suffix s (R = 20,000 reusable tokens):
//
//	pull(s)  = 90 + 20 + 20000×5µs + 10 ms + s×(10+5) µs = 220 ms + 15 µs×s
//	local(s) = 20 ms + 40 µs×s
//
// and they meet at s = 200 ms / 25 µs = 8,000 tokens. With the deferred
// cost (the suffix's prefill on P, 10 µs×s, that a later pull pays) local
// compares as 20 ms + 50 µs×s and they meet at 200/35 = 5,714.3 tokens.
func breakEvenRates() threshold.Rates {
	return threshold.Rates{
		PrefillFixed: 90 * time.Millisecond, PrefillPerToken: 10 * time.Microsecond,
		PullFixed: 20 * time.Millisecond, PullPerToken: 5 * time.Microsecond,
		DecodeFirstFixed: 10 * time.Millisecond, DecodeReadPerToken: 5 * time.Microsecond,
		LocalFixed: 20 * time.Millisecond, LocalPerToken: 40 * time.Microsecond,
	}
}

// TestChooseFlipsAtBreakEven: below the modelled break-even suffix the
// turn goes decode-local, above it pulls; the estimates match the formula.
func TestChooseFlipsAtBreakEven(t *testing.T) {
	for _, tt := range []struct {
		name       string
		noDeferred bool
		breakEven  int // the last suffix that goes decode-local
	}{{"deferred", false, 5714}, {"no deferred", true, 7999}} {
		t.Run(tt.name, func(t *testing.T) {
			m, err := threshold.NewCostModel(threshold.CostConfig{Priors: breakEvenRates(), MaxLocalSuffix: 10000, Static: true, NoDeferred: tt.noDeferred})
			require.NoError(t, err)
			const reusable = 20000
			for _, s := range []struct {
				suffix int
				want   threshold.Path
			}{{1, threshold.PathLocal}, {300, threshold.PathLocal}, {tt.breakEven, threshold.PathLocal},
				{tt.breakEven + 1, threshold.PathPull}, {9000, threshold.PathPull}} {
				in := threshold.Turn{PromptTokens: reusable + s.suffix, ReusableTokens: reusable, Decode: "d"}
				c := m.Choose(in)
				assert.Equal(t, s.want, c.Path, "suffix %d", s.suffix)
				assert.Equal(t, 220*time.Millisecond+time.Duration(s.suffix)*15*time.Microsecond, c.Pull, "suffix %d", s.suffix)
				assert.Equal(t, 20*time.Millisecond+time.Duration(s.suffix)*40*time.Microsecond, c.Local, "suffix %d", s.suffix)
				assert.Empty(t, c.Refusal)
				c.Release()
			}
		})
	}
}

// TestChooseSuffixBound: a suffix over MaxLocalSuffix never goes
// decode-local, however cheap; the refusal says why.
func TestChooseSuffixBound(t *testing.T) {
	m, err := threshold.NewCostModel(threshold.CostConfig{Priors: breakEvenRates(), MaxLocalSuffix: 500, Static: true})
	require.NoError(t, err)
	c := m.Choose(threshold.Turn{PromptTokens: 20500, ReusableTokens: 20000, Decode: "d"})
	assert.Equal(t, threshold.PathLocal, c.Path)
	c.Release()
	c = m.Choose(threshold.Turn{PromptTokens: 20501, ReusableTokens: 20000, Decode: "d"})
	assert.Equal(t, threshold.PathPull, c.Path)
	assert.Equal(t, threshold.RefuseLocalSuffix, c.Refusal)
	assert.Less(t, c.Local, c.Pull)
}

// TestChooseAgeBound: a handle older than MaxLocalAge of the retention
// TTL is renewed by a pull, since a decode-local turn would leave it to
// expire before the next turn.
func TestChooseAgeBound(t *testing.T) {
	m, err := threshold.NewCostModel(threshold.CostConfig{Priors: breakEvenRates(), Static: true})
	require.NoError(t, err)
	in := threshold.Turn{PromptTokens: 20300, ReusableTokens: 20000, Decode: "d", RetentionTTL: 450 * time.Second}
	in.HandleAge = 225 * time.Second
	c := m.Choose(in)
	assert.Equal(t, threshold.PathLocal, c.Path)
	c.Release()
	in.HandleAge = 226 * time.Second
	c = m.Choose(in)
	assert.Equal(t, threshold.PathPull, c.Path)
	assert.Equal(t, threshold.RefuseLocalAge, c.Refusal)
}

// TestChooseBurstBounded: a burst of cheap decode-local turns on one
// decode engine gets MaxLocalInFlight slots; the rest pull until a slot is
// released. Another engine has its own slots; Release is idempotent.
func TestChooseBurstBounded(t *testing.T) {
	m, err := threshold.NewCostModel(threshold.CostConfig{Priors: breakEvenRates(), MaxLocalInFlight: 2, Static: true})
	require.NoError(t, err)
	in := threshold.Turn{PromptTokens: 20300, ReusableTokens: 20000, Decode: "d1"}
	var local []threshold.Choice
	busy := 0
	for range 5 {
		c := m.Choose(in)
		switch c.Path {
		case threshold.PathLocal:
			local = append(local, c)
		default:
			assert.Equal(t, threshold.RefuseLocalBusy, c.Refusal)
			busy++
		}
	}
	assert.Len(t, local, 2)
	assert.Equal(t, 3, busy)
	assert.Equal(t, 2, m.LocalInFlight("d1"))

	other := m.Choose(threshold.Turn{PromptTokens: 20300, ReusableTokens: 20000, Decode: "d2"})
	assert.Equal(t, threshold.PathLocal, other.Path, "another engine's slots are its own")
	other.Release()

	local[0].Release()
	local[0].Release() // idempotent
	assert.Equal(t, 1, m.LocalInFlight("d1"))
	c := m.Choose(in)
	assert.Equal(t, threshold.PathLocal, c.Path)
	c.Release()
	local[1].Release()
	assert.Zero(t, m.LocalInFlight("d1"))
}

// TestCostModelLearns: priors that think the decode engine prefills as
// fast as the prefill engine are wrong by a factor of 3 per token; after
// observing turns of the true engines the break-even suffix is the true
// one within 10%, where the priors put it far higher.
func TestCostModelLearns(t *testing.T) {
	truth := breakEvenRates()
	truth.LocalPerToken = 40 * time.Microsecond
	prior := truth
	prior.LocalPerToken = 13 * time.Microsecond // below pull's 15 µs: the priors never pull
	m, err := threshold.NewCostModel(threshold.CostConfig{Priors: prior, MaxLocalSuffix: 1 << 20, NoDeferred: true})
	require.NoError(t, err)
	const reusable = 20000
	breakEven := func() int {
		for s := 100; s < 1<<20; s += 100 {
			pull, local, _ := m.Estimate(threshold.Turn{PromptTokens: reusable + s, ReusableTokens: reusable})
			if local >= pull {
				return s
			}
		}
		return 1 << 20
	}
	require.Greater(t, breakEven(), 100000)
	ms := func(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }
	for i := range 40 {
		s := 200 + 400*(i%10)
		in := threshold.Observation{Decode: "d", PromptTokens: reusable + s, ReusableTokens: reusable}
		local := in
		local.Path, local.DecodeFirst = threshold.PathLocal, ms(20+0.040*float64(s))
		m.Observe(local)
		pull := in
		pull.Path, pull.Prefill, pull.DecodeFirst = threshold.PathPull, ms(90+20+0.005*reusable+0.010*float64(s)), ms(10+0.005*float64(s))
		m.Observe(pull)
	}
	assert.InEpsilon(t, 8000, breakEven(), 0.10)
	// With R fixed, per-token and attention cost are confounded; the
	// estimate where turns were observed is what must be right.
	_, local, _ := m.Estimate(threshold.Turn{PromptTokens: reusable + 2000, ReusableTokens: reusable})
	assert.InEpsilon(t, 100*time.Millisecond, local, 0.05)
}

func TestNewCostModelRejects(t *testing.T) {
	for _, c := range []threshold.CostConfig{
		{PriorWeight: -1},
		{Forget: 1.5},
		{Forget: -0.1},
		{Priors: threshold.Rates{LocalFixed: -time.Millisecond}},
		{Priors: threshold.Rates{LocalAttention: -1}},
	} {
		_, err := threshold.NewCostModel(c)
		assert.ErrorIs(t, err, threshold.ErrInvalidCost, "%+v", c)
	}
}

// TestCostModelUnknownTokens: without token counts the turn pulls, as
// without a Chooser, and Reuse is the engine's threshold rule.
func TestCostModelUnknownTokens(t *testing.T) {
	m, err := threshold.NewCostModel(threshold.CostConfig{})
	require.NoError(t, err)
	assert.Equal(t, threshold.Choice{Path: threshold.PathPull}, m.Choose(threshold.Turn{ReusableTokens: 100}))
	assert.False(t, m.Reuse(threshold.Input{RemoteTokens: threshold.DefaultThreshold - 1}))
	assert.True(t, m.Reuse(threshold.Input{RemoteTokens: threshold.DefaultThreshold}))
}

// TestCostModelPerEngine: a slow decode engine's decode-local turns teach
// its own rates, not those of a fast one.
func TestCostModelPerEngine(t *testing.T) {
	m, err := threshold.NewCostModel(threshold.CostConfig{Priors: breakEvenRates(), NoDeferred: true})
	require.NoError(t, err)
	ms := func(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }
	for i := range 30 {
		s := 200 + 100*(i%10)
		m.Observe(threshold.Observation{Path: threshold.PathLocal, Decode: "fast", PromptTokens: 20000 + s, ReusableTokens: 20000, DecodeFirst: ms(20 + 0.040*float64(s))})
		m.Observe(threshold.Observation{Path: threshold.PathLocal, Decode: "slow", PromptTokens: 20000 + s, ReusableTokens: 20000, DecodeFirst: ms(60 + 0.400*float64(s))})
	}
	in := threshold.Turn{PromptTokens: 20500, ReusableTokens: 20000}
	in.Decode = "fast"
	_, fast, _ := m.Estimate(in)
	in.Decode = "slow"
	_, slow, _ := m.Estimate(in)
	assert.InEpsilon(t, 40*time.Millisecond, fast, 0.1)
	assert.InEpsilon(t, 260*time.Millisecond, slow, 0.1)
	assert.Equal(t, threshold.PathLocal, m.Choose(threshold.Turn{PromptTokens: 20500, ReusableTokens: 20000, Decode: "fast"}).Path)
	assert.Equal(t, threshold.PathPull, m.Choose(threshold.Turn{PromptTokens: 20500, ReusableTokens: 20000, Decode: "slow"}).Path)
}

// TestCostModelEngineChurn replaces decode engines one after another, as
// rollouts under DNS discovery do: an engine first seen after more than a
// thousand others still gets rates of its own (the least recently used
// engine's are dropped instead), and the one used all along keeps its own.
func TestCostModelEngineChurn(t *testing.T) {
	m, err := threshold.NewCostModel(threshold.CostConfig{Priors: breakEvenRates(), NoDeferred: true})
	require.NoError(t, err)
	ms := func(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }
	estimate := func(decode string) time.Duration {
		_, local, _ := m.Estimate(threshold.Turn{PromptTokens: 20500, ReusableTokens: 20000, Decode: decode})
		return local
	}
	for i := range 30 { // 260 ms at s=500
		s := 200 + 100*(i%10)
		m.Observe(threshold.Observation{Path: threshold.PathLocal, Decode: "steady", PromptTokens: 20000 + s,
			ReusableTokens: 20000, DecodeFirst: ms(60 + 0.400*float64(s))})
	}
	pod := 0
	churn := func() { // a turn on a pod never seen before, slow
		m.Observe(threshold.Observation{Path: threshold.PathLocal, Decode: fmt.Sprintf("pod-%d", pod), PromptTokens: 20500,
			ReusableTokens: 20000, DecodeFirst: ms(500)})
		pod++
	}
	for i := range 1500 {
		churn()
		if i%100 == 0 {
			estimate("steady") // in use all along
		}
	}
	for i := range 60 { // the newest engine, fast, among more churn
		s := 200 + 100*(i%10)
		m.Observe(threshold.Observation{Path: threshold.PathLocal, Decode: "newest", PromptTokens: 20000 + s,
			ReusableTokens: 20000, DecodeFirst: ms(20 + 0.040*float64(s))})
		churn()
	}
	// The newest engine starts from the pooled rates (about 500 ms here)
	// and moves towards its own 40 ms; an engine never seen keeps the
	// pooled estimate.
	newest, unseen := estimate("newest"), estimate("never-seen")
	assert.Less(t, float64(newest), 0.9*float64(unseen), "an engine seen after 1,500 others learns its own rates (%v, pooled %v)", newest, unseen)
	assert.InEpsilon(t, 260*time.Millisecond, estimate("steady"), 0.15, "the engine in use kept its rates")
}

// NewCostModel reports every bad field at once, each naming the field and
// wrapping ErrInvalidCost, as kvroute.New reports its options.
func TestNewCostModelReportsEveryField(t *testing.T) {
	_, err := threshold.NewCostModel(threshold.CostConfig{PriorWeight: -1, Forget: 2})
	require.Error(t, err)
	assert.ErrorIs(t, err, threshold.ErrInvalidCost)
	assert.Contains(t, err.Error(), "PriorWeight")
	assert.Contains(t, err.Error(), "Forget")
}

// A turn whose reusable tokens are in the decode engine's CPU tier costs
// a peer pull more than a GPU pull (the network copy and the load), a
// decode-local turn the reload; recomputing is unchanged; PeerSaves is
// positive for a long history and negative for a short one.
func TestCostModelFromCPU(t *testing.T) {
	m, err := threshold.NewCostModel(threshold.CostConfig{})
	if err != nil {
		t.Fatal(err)
	}
	in := threshold.Turn{PromptTokens: 30000, ReusableTokens: 29000, Decode: "d"}
	pull, local, rec := m.Estimate(in)
	in.FromCPU = true
	peer, tierLocal, rec2 := m.Estimate(in)
	r := threshold.DefaultRates()
	if want := pull + r.PeerFixed - r.PullFixed + 29000*(r.PeerPerToken-r.PullPerToken); peer != want {
		t.Fatalf("peer %v, want %v", peer, want)
	}
	if tierLocal != local+29000*r.TierLoadPerToken || rec2 != rec {
		t.Fatalf("local %v (GPU %v), recompute %v (%v)", tierLocal, local, rec2, rec)
	}
	if r.PeerSaves(29000, 30000) <= 0 || r.PeerSaves(500, 600) >= 0 {
		t.Fatalf("PeerSaves %v at 29k, %v at 500", r.PeerSaves(29000, 30000), r.PeerSaves(500, 600))
	}
	old := threshold.DefaultRates()
	old.PeerFixed, old.PeerPerToken, old.TierLoadPerToken = 0, 0, 0
	m2, err := threshold.NewCostModel(threshold.CostConfig{Priors: old})
	if err != nil {
		t.Fatal(err)
	}
	if got := m2.Rates(); got.PeerFixed != old.PullFixed || got.PeerPerToken <= old.PullPerToken {
		t.Fatalf("priors without the tier's rates: %+v", got)
	}
}

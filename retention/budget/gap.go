package budget

import (
	"fmt"
	"iter"
	"math"
	"sync"
	"time"
)

// Model learns the distribution of the pause between a turn and its
// conversation's next turn, and the chance that there is no next turn.
//
// Each observation is a conversation's turn: it ends either with the next
// turn's arrival after some gap (an event), or without one, after a time
// it was watched (censored: the hold expired or was released and nothing
// came back within the horizon). Gaps are counted in a log-spaced histogram
// (three bins an octave, 1 s to 2 h 16 min), and the model is a
// discrete-time survival curve: in each bin, the chance of a return given
// none so far, estimated as returns over the observations still waiting
// there (censored ones count the part of the bin they waited, the
// actuarial rule). Observations still open (a live hold, or an ended one
// still watched) count as waiting up to their current age, so that quick
// returns, which close early, do not make returns look likelier than they
// are.
//
// Observations are weighted by their creation time with the half-life
// ([WithHalfLife]): recent behaviour weighs more. They are learned in
// cells by feature: for each class, turn group (1, 2, 3-4, 5-8, 9+) and
// whether the reply ended in tool calls; and overall, by turn group and
// tool calls, and by tool calls alone. A cell's chance in each bin is
// shrunk toward its parent's (class → overall by turn → overall → a
// built-in prior) with the weight of ten observations, so a class with few
// observations follows the overall figures and a bin with few
// observations follows the coarser cell.
//
// Probabilities are recomputed from the counts at [Model.Refresh]; they
// are those of the last refresh in between. A Model is safe for concurrent
// use.
type Model struct {
	mu       sync.Mutex
	cfg      config
	t0       int64 // UnixNano epoch of the weights
	started  bool  // t0 is set
	classes  map[string]uint32
	names    []string
	cells    []cell
	prior    [2][nBins + 1]float64 // survival of the prior, without and with tool calls
	pend     []float64             // scratch for Refresh: 2×nBins per cell
	at       int64                 // UnixNano of the last refresh
	fresh    bool                  // a refresh has run
	overflow int64                 // observations of classes past WithMaxClasses
}

// cell is one feature combination's counts and, after a refresh, its
// survival curve.
type cell struct {
	ev   [nBins]float64     // returns whose gap fell in the bin, weighted
	cz   [nBins]float64     // censored observations whose wait ended in the bin, weighted
	czf  [nBins]float64     // the part of that bin they waited, weighted
	obs  float64            // closed observations, weighted
	ret  float64            // returns among them, weighted
	open float64            // open observations at the last refresh, in weights of then
	now  float64            // obs in weights of the last refresh
	surv [nBins + 1]float64 // P(no return by the bin's lower edge), at the last refresh
}

// priorWeight is how many observations a cell's parent counts as in each
// bin.
const priorWeight = 10

// Cell layout: 0-1 overall by tool calls; 2-11 overall by turn group and
// tool calls; then ten per class.
const (
	toolCells  = 2
	groupCells = 2 * nTurnGroups
	firstClass = toolCells + groupCells
)

// parent is the next coarser cell of id, or -1 for the prior.
func parent(id int) int {
	switch {
	case id >= firstClass:
		return toolCells + (id-firstClass)%groupCells
	case id >= toolCells:
		return (id - toolCells) % 2
	}
	return -1
}

func toolBit(t bool) int {
	if t {
		return 1
	}
	return 0
}

// NewModel returns a Model. It accepts the options marked "Model too"
// ([WithHorizon], [WithHalfLife], [WithMaxClasses], [WithRefresh]) and
// fails, wrapping [ErrInvalidConfig], on an out-of-range one or on an
// option only a [Budget] has.
func NewModel(opts ...Option) (*Model, error) {
	c := defaultConfig()
	for _, o := range opts {
		o.apply(&c)
	}
	if len(c.budgetOnly) > 0 {
		return nil, fmt.Errorf("%w: NewModel: %s configures a Budget (use New)", ErrInvalidConfig, c.budgetOnly[0])
	}
	if err := c.validate(); err != nil {
		return nil, err
	}
	return newModel(c), nil
}

func newModel(c config) *Model {
	m := &Model{cfg: c, classes: map[string]uint32{}, cells: make([]cell, firstClass)}
	// The prior, before any observation: without tool calls, 40% of
	// conversations come back, their gaps spread evenly in log time from
	// 4 s to 68 min; after tool calls, 90%, from 1 s to 2 min.
	m.prior[0] = priorSurvival(0.4, 2, 12)
	m.prior[1] = priorSurvival(0.9, 0, 7)
	for id := range m.cells {
		m.cells[id].surv = m.parentSurv(id)
	}
	return m
}

// priorSurvival is the survival curve of a return with probability p and
// a gap log-uniform between 2^lo and 2^hi seconds.
func priorSurvival(p float64, lo, hi float64) [nBins + 1]float64 {
	var s [nBins + 1]float64
	for i := range s {
		x := 0.0
		if e := edge(i); e > 0 {
			x = min(max((math.Log2(e)-lo)/(hi-lo), 0), 1)
		}
		s[i] = 1 - p*x
	}
	return s
}

func (m *Model) parentSurv(id int) [nBins + 1]float64 {
	if p := parent(id); p >= 0 {
		return m.cells[p].surv
	}
	return m.prior[id]
}

// cellOf returns the most specific cell of f; with intern, a class not yet
// seen gets its cells while WithMaxClasses allows. m.mu held.
func (m *Model) cellOf(f Features, intern bool) int {
	g := toolCells + 2*turnGroup(f.Turn) + toolBit(f.ToolCalls)
	if f.Class == "" {
		return g
	}
	ci, ok := m.classes[f.Class]
	if !ok {
		if !intern || len(m.names) >= m.cfg.maxClasses {
			if intern {
				m.overflow++
			}
			return g
		}
		ci = uint32(len(m.names))
		m.classes[f.Class] = ci
		m.names = append(m.names, f.Class)
		base := len(m.cells)
		m.cells = append(m.cells, make([]cell, groupCells)...)
		for id := base; id < len(m.cells); id++ {
			m.cells[id].surv = m.parentSurv(id)
		}
	}
	return firstClass + int(ci)*groupCells + (g - toolCells)
}

// weight is the weight of an observation created at created (UnixNano),
// moving the epoch forward when weights would grow too large. m.mu held.
func (m *Model) weight(created int64) float64 {
	if !m.started {
		m.t0, m.started = created, true
	}
	x := float64(created-m.t0) / float64(m.cfg.halfLife)
	if x > 64 {
		m.rescale(created)
		x = 0
	}
	return math.Exp2(x)
}

// rescale moves the weights' epoch to t. m.mu held.
func (m *Model) rescale(t int64) {
	f := math.Exp2(-float64(t-m.t0) / float64(m.cfg.halfLife))
	for i := range m.cells {
		c := &m.cells[i]
		for b := range nBins {
			c.ev[b] *= f
			c.cz[b] *= f
			c.czf[b] *= f
		}
		c.obs *= f
		c.ret *= f
	}
	m.t0 = t
}

// Observe records that the conversation of a turn ended at created came
// back gap later.
func (m *Model) Observe(f Features, created time.Time, gap time.Duration) {
	m.mu.Lock()
	m.close(m.cellOf(f, true), created.UnixNano(), seconds(gap), true)
	m.mu.Unlock()
}

// Censor records that the conversation of a turn ended at created had not
// come back waited later, and is watched no longer.
func (m *Model) Censor(f Features, created time.Time, waited time.Duration) {
	m.mu.Lock()
	m.close(m.cellOf(f, true), created.UnixNano(), seconds(waited), false)
	m.mu.Unlock()
}

// close records a closed observation in cell id and its parents. m.mu
// held.
func (m *Model) close(id int, created int64, age float64, returned bool) {
	w := m.weight(created)
	b, fr := binOf(age)
	for ; id >= 0; id = parent(id) {
		c := &m.cells[id]
		c.obs += w
		if returned {
			c.ev[b] += w
			c.ret += w
		} else {
			c.cz[b] += w
			c.czf[b] += w * fr
		}
	}
}

// Refresh recomputes the probabilities at now from the counts and from
// the observations still open: each turn that has ended and whose next
// turn has neither come nor been given up on, by its features and end
// time.
func (m *Model) Refresh(now time.Time, open iter.Seq2[Features, time.Time]) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.refresh(now.UnixNano(), func(add func(id int, created int64)) {
		for f, created := range open {
			add(m.cellOf(f, false), created.UnixNano())
		}
	})
}

// stale reports whether the probabilities are older than WithRefresh.
// m.mu held.
func (m *Model) stale(now int64) bool {
	return !m.fresh || now-m.at >= int64(m.cfg.refresh) || now < m.at
}

// refresh recomputes every cell's survival curve at now; open calls add
// for each open observation. m.mu held.
func (m *Model) refresh(now int64, open func(add func(id int, created int64))) {
	if !m.started {
		m.t0, m.started = now, true
	}
	if float64(now-m.t0)/float64(m.cfg.halfLife) > 64 {
		m.rescale(now)
	}
	n := len(m.cells) * 2 * nBins
	if cap(m.pend) < n {
		m.pend = make([]float64, n)
	}
	pend := m.pend[:n]
	clear(pend)
	for i := range m.cells {
		m.cells[i].open = 0
	}
	hl := float64(m.cfg.halfLife)
	z := math.Exp2(-float64(now-m.t0) / hl)
	open(func(id int, created int64) {
		w := math.Exp2(float64(created-m.t0) / hl)
		b, fr := binOf(float64(now-created) / 1e9)
		for ; id >= 0; id = parent(id) {
			p := pend[id*2*nBins:]
			p[b] += w
			p[nBins+b] += w * fr
			m.cells[id].open += w * z
		}
	})
	for id := range m.cells { // parents come before their children
		c := &m.cells[id]
		ps := m.parentSurv(id)
		p := pend[id*2*nBins:]
		var exposure [nBins]float64
		after := 0.0 // weight of observations that ended in a later bin
		for b := nBins - 1; b >= 0; b-- {
			exposure[b] = after + c.ev[b] + c.czf[b] + p[nBins+b]
			after += c.ev[b] + c.cz[b] + p[b]
		}
		c.now = c.obs * z
		c.surv[0] = 1
		for b := range nBins {
			hp := 0.0
			if ps[b] > 0 {
				hp = 1 - ps[b+1]/ps[b]
			}
			h := (c.ev[b]*z + priorWeight*hp) / (exposure[b]*z + priorWeight)
			c.surv[b+1] = c.surv[b] * (1 - min(max(h, 0), 1))
		}
	}
	m.at, m.fresh = now, true
}

// Probability is the chance that the next turn of a conversation with
// features f arrives after waited and by until (both since its last turn
// ended), given that it has not arrived by waited: 1 − S(until)/S(waited)
// on the survival curve of the last refresh. It is 0 when until is not
// after waited.
func (m *Model) Probability(f Features, waited, until time.Duration) float64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.probability(m.cellOf(f, false), seconds(waited), seconds(until))
}

// probability is Probability for cell id, in seconds. m.mu held.
func (m *Model) probability(id int, waited, until float64) float64 {
	if until <= waited {
		return 0
	}
	s := &m.cells[id].surv
	sw := survAt(s, waited)
	if sw <= 0 {
		return 0
	}
	return min(max(1-survAt(s, until)/sw, 0), 1)
}

// survAt interpolates the survival curve s at age a seconds.
func survAt(s *[nBins + 1]float64, a float64) float64 {
	b, fr := binOf(a)
	return s[b] + (s[b+1]-s[b])*fr
}

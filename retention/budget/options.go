package budget

import (
	"fmt"
	"slices"
	"time"
)

// Defaults of the options.
const (
	// DefaultFraction is the share of a decode engine's KV capacity that
	// holds may take before [Budget.Victims] releases any: half. The rest
	// is for the requests running on the engine; with free memory holding
	// costs nothing, so the budget only matters once holds crowd out live
	// work. The trace replay (examples/bench --replay-trace, BENCHMARKS.md
	// section 8) shows why half is enough: with half of the memory that
	// holding everything takes, the managed holds keep 77% of its reused
	// tokens (with a fifth, 42%).
	DefaultFraction = 0.5
	// DefaultBlockSize is the tokens per KV block when an engine has not
	// reported its own: vLLM's default on GPUs, 16.
	DefaultBlockSize = 16
	// DefaultHorizon is how long an ended hold waits for its conversation's
	// next turn before it counts as never returning: 30 minutes.
	DefaultHorizon = 30 * time.Minute
	// DefaultHalfLife is how fast old observations fade from the gap
	// model: an observation weighs half as much an hour later.
	DefaultHalfLife = time.Hour
	// DefaultMaxClasses bounds the classes learned separately: 256.
	DefaultMaxClasses = 256
	// DefaultRefresh is how often the gap model's probabilities are
	// recomputed from its counts: every 10 s of the callers' clock.
	DefaultRefresh = 10 * time.Second
)

// Option configures a [Budget] built by [New], or a [Model] built by
// [NewModel] (the options marked "Model too").
type Option interface {
	apply(*config)
}

type config struct {
	fraction   float64
	capacity   int64
	blockSize  int
	horizon    time.Duration
	halfLife   time.Duration
	maxClasses int
	refresh    time.Duration
	value      ValueFunc
	grace      time.Duration
	journal    Journal // WithJournal's
	source     string
	budgetOnly []string // budget-only options given, for NewModel's error
	inherited  []string // those of budgetOnly an Inherit gave, not the maker
}

func defaultConfig() config {
	return config{
		fraction:   DefaultFraction,
		blockSize:  DefaultBlockSize,
		horizon:    DefaultHorizon,
		halfLife:   DefaultHalfLife,
		maxClasses: DefaultMaxClasses,
		refresh:    DefaultRefresh,
	}
}

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

// budgetOption marks an option NewModel refuses.
func budgetOption(name string, f func(*config)) Option {
	return optionFunc(func(c *config) {
		f(c)
		c.budgetOnly = append(c.budgetOnly, name)
	})
}

// WithFraction sets the share of an engine's capacity its holds may take:
// [Budget.Victims] releases nothing while the engine's held tokens (in
// whole blocks) plus the incoming ones fit in fraction × capacity. The
// default is [DefaultFraction] (0.5); f must be in (0, 1] (New fails
// otherwise). Budget only.
func WithFraction(f float64) Option {
	return budgetOption("WithFraction", func(c *config) { c.fraction = f })
}

// WithCapacity sets the KV capacity, in tokens, of every engine that has
// not reported its own through [Budget.SetCapacity]. The default, 0, means
// unknown: an engine without a capacity has no budget and none of its
// holds is ever released. Negative is invalid. Budget only.
func WithCapacity(tokens int64) Option {
	return budgetOption("WithCapacity", func(c *config) { c.capacity = tokens })
}

// WithBlockSize sets the tokens per KV block of engines that have not
// reported theirs: a hold of n tokens pins ceil(n/size) blocks. The
// default is [DefaultBlockSize] (16); size must be positive. Budget only.
func WithBlockSize(size int) Option {
	return budgetOption("WithBlockSize", func(c *config) { c.blockSize = size })
}

// WithHorizon sets how long a hold that ended without its conversation's
// next turn (expired, released) is remembered: a turn that comes back
// within the horizon still counts as a gap, and one that has not come back
// by then counts as never returning. It costs about 70 bytes per ended
// hold remembered. The default is [DefaultHorizon] (30 min); d must be
// positive and at most [MaxHorizon]. Model too (its snapshot's quantiles
// are of gaps within the horizon).
func WithHorizon(d time.Duration) Option {
	return optionFunc(func(c *config) { c.horizon = d })
}

// WithHalfLife sets how fast observations fade from the gap model: one
// observed d ago weighs half as much as one observed now, so recent
// behaviour wins. The default is [DefaultHalfLife] (1 h); d must be at
// least a second. Model too.
func WithHalfLife(d time.Duration) Option {
	return optionFunc(func(c *config) { c.halfLife = d })
}

// WithMaxClasses bounds the classes ([Features.Class]) learned separately;
// a class seen after the bound is reached is learned only in the overall
// figures (counted in [Stats.ClassesOverflow]). The default is
// [DefaultMaxClasses] (256); n must be positive. Each class costs about
// 13 KB. Model too.
func WithMaxClasses(n int) Option {
	return optionFunc(func(c *config) { c.maxClasses = n })
}

// WithRefresh sets how often, on the callers' clock, the gap model
// recomputes its probabilities from its counts (a walk over every live and
// remembered hold). The default is [DefaultRefresh] (10 s); d must be
// positive. Model too.
func WithRefresh(d time.Duration) Option {
	return optionFunc(func(c *config) { c.refresh = d })
}

// ValueFunc values a live hold for [Budget.Victims]: the holds of least
// value per block are released first. model is the gap model's value (the
// saved prefill seconds × the chance that the conversation's next turn
// comes before the hold expires, given how long it has waited, per block);
// waited is the hold's age at the choice. It is called with the Budget's
// lock held and must not call the Budget.
type ValueFunc func(h Held, waited time.Duration, model float64) float64

// WithValue makes Victims rank holds by f instead of the gap model: for a
// caller that knows more of its conversations than their pauses (an agent
// framework that knows a session ended or a tool is running), or to
// measure a policy against one that knows the future. nil keeps the gap model's value. Budget
// only. It is kvroute's decode-memory release order: a Budget built with
// it and given as kvroute.DecodeMemory.Ledger releases the holds over
// the budget in f's order (kvroute's ExampleDecodeMemory).
func WithValue(f ValueFunc) Option {
	return budgetOption("WithValue", func(c *config) { c.value = f })
}

// WithGrace keeps a hold in the ledger, counted against its engine,
// for up to d past its Expires: the time between the end of the hold's
// use (the router's retention TTL) and the end of the engine's own hold
// (vLLM's decoder_kv_blocks_ttl), during which the engine still pins the
// blocks. [Budget.Expired] hands such overdue holds to the caller to
// release; one it never releases ends d after its Expires. Either way it
// is observed as a hold that ended at its Expires. The default, 0, ends a
// hold at its Expires; negative is invalid. Budget only.
func WithGrace(d time.Duration) Option {
	return budgetOption("WithGrace", func(c *config) { c.grace = d })
}

// WithJournal shares the ledger with the Budgets of other processes
// through j (retention/redisstore's Journal beside a Redis store; a
// [MemoryJournal] in tests): router replicas in separate processes then
// budget against the same holds, capacities and learned pauses, and see
// one another's running requests ([Budget.Running]). Every change a
// caller makes (Add, Return, End, the victims and overdue holds ended,
// SetCapacity) is queued, never sent on the caller's path: [Budget.Sync]
// appends the queue to j and applies the other processes' changes, and
// its caller calls it every second or so (kvroute's background runner
// does), so the others' changes are seen that much later. The queue
// keeps at most [JournalQueue] changes; more are dropped (counted in
// [JournalStats.Dropped]).
//
// source names this process in the journal, unique among the processes
// sharing it; empty: a random one, different for each Budget (a process
// that restarts is another source). Its own changes read back are
// skipped. The default is no journal: the Budget is its process's own.
// Budget only.
func WithJournal(j Journal, source string) Option {
	return budgetOption("WithJournal", func(c *config) { c.journal, c.source = j, source })
}

// validate reports the first out-of-range option, naming it and its
// default.
func (c config) validate() error {
	switch {
	case !(c.fraction > 0 && c.fraction <= 1):
		return fmt.Errorf("%w: WithFraction(%v): must be in (0, 1] (default %v)", ErrInvalidConfig, c.fraction, DefaultFraction)
	case c.capacity < 0:
		return fmt.Errorf("%w: WithCapacity(%d): must not be negative (default 0: unknown, no budget)", ErrInvalidConfig, c.capacity)
	case c.blockSize <= 0:
		return fmt.Errorf("%w: WithBlockSize(%d): must be positive (default %d)", ErrInvalidConfig, c.blockSize, DefaultBlockSize)
	case c.horizon <= 0 || c.horizon > MaxHorizon:
		return fmt.Errorf("%w: WithHorizon(%v): must be positive and at most %v (default %v)", ErrInvalidConfig, c.horizon, MaxHorizon, DefaultHorizon)
	case c.halfLife < time.Second:
		return fmt.Errorf("%w: WithHalfLife(%v): must be at least 1s (default %v)", ErrInvalidConfig, c.halfLife, DefaultHalfLife)
	case c.maxClasses <= 0:
		return fmt.Errorf("%w: WithMaxClasses(%d): must be positive (default %d)", ErrInvalidConfig, c.maxClasses, DefaultMaxClasses)
	case c.refresh <= 0:
		return fmt.Errorf("%w: WithRefresh(%v): must be positive (default %v)", ErrInvalidConfig, c.refresh, DefaultRefresh)
	case c.grace < 0:
		return fmt.Errorf("%w: WithGrace(%v): must not be negative (default 0: a hold ends at its Expires)", ErrInvalidConfig, c.grace)
	}
	return nil
}

// Given reports whether b's maker gave the Budget option named name
// ("WithFraction", "WithCapacity", "WithBlockSize", "WithValue",
// "WithGrace" or "WithJournal") to [New], rather than leaving its default; an option
// [Budget.Inherit] gave is not the maker's.
func (b *Budget) Given(name string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Contains(b.cfg.budgetOnly, name) && !slices.Contains(b.cfg.inherited, name)
}

// Inherit gives b each Budget option of opts ([WithFraction],
// [WithCapacity], [WithBlockSize], [WithValue], [WithGrace],
// [WithJournal]) that its maker did not give ([Budget.Given]), and keeps those it did: a program
// that builds a Budget to read it and hands it to a router has the
// router's settings fill in what it left at the defaults (kvroute's
// DecodeMemory.Ledger inherits the router's Budget and Capacity so).
//
// A Budget may be shared by several callers (router replicas in one
// process, each calling Inherit with its own settings): an option an
// earlier Inherit gave is kept when a later one agrees, and a later one
// that gives it another value fails, wrapping [ErrInvalidConfig] and
// naming both values (two [WithValue] functions agree when they are the
// same function). Holds already added keep the block count of their time.
// An option out of range or a [Model] option fails, wrapping
// [ErrInvalidConfig]. A failing Inherit changes nothing.
func (b *Budget) Inherit(opts ...Option) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	c := b.cfg
	c.budgetOnly, c.inherited = slices.Clone(c.budgetOnly), slices.Clone(c.inherited)
	for _, o := range opts {
		probe := defaultConfig()
		o.apply(&probe)
		if len(probe.budgetOnly) != 1 {
			return fmt.Errorf("%w: Inherit takes Budget options only (WithFraction, WithCapacity, WithBlockSize, WithValue, WithGrace, WithJournal)", ErrInvalidConfig)
		}
		name := probe.budgetOnly[0]
		switch {
		case slices.Contains(c.inherited, name):
			if have, want := c.setting(name), probe.setting(name); have != want {
				return fmt.Errorf("%w: Inherit: %s conflicts with %s, which an earlier Inherit gave: the callers sharing a Budget must agree", ErrInvalidConfig, want, have)
			}
		case slices.Contains(c.budgetOnly, name): // the maker's
		default:
			o.apply(&c)
			c.inherited = append(c.inherited, name)
		}
	}
	if err := c.validate(); err != nil {
		return err
	}
	if c.journal != nil && b.jr == nil {
		b.jr = newJournal(c)
	}
	b.cfg = c
	return nil
}

// setting is the Budget option named name as c has it, for Inherit's
// comparison and error.
func (c config) setting(name string) string {
	switch name {
	case "WithFraction":
		return fmt.Sprintf("WithFraction(%v)", c.fraction)
	case "WithCapacity":
		return fmt.Sprintf("WithCapacity(%d)", c.capacity)
	case "WithBlockSize":
		return fmt.Sprintf("WithBlockSize(%d)", c.blockSize)
	case "WithGrace":
		return fmt.Sprintf("WithGrace(%v)", c.grace)
	case "WithValue":
		if c.value == nil {
			return "WithValue(nil)"
		}
		return fmt.Sprintf("WithValue(func %p)", c.value)
	case "WithJournal":
		return fmt.Sprintf("WithJournal(%s, %q)", journalName(c.journal), c.source)
	}
	return name
}

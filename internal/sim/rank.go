package sim

import (
	"context"
	"fmt"
	"math/big"
	"net/http"
	"slices"
	"strings"
	"time"
)

// RankHeader is the request header by which vLLM's OpenAI server pins a
// request to a data-parallel rank (read case-insensitively, as any header).
const RankHeader = "X-data-parallel-rank"

// rank is one data-parallel engine core: its NIXL engine id, its block pool,
// the handles it holds for remote readers and its scheduler's queues
// (sched.go).
type rank struct {
	id     string
	pool   *pool
	tier   *cpuTier         // the CPU tier (nil: none)
	held   map[string]*held // by request id, ended ones too (a late read names them)
	active map[string]*held // the holds that keep blocks
	holds  uint64           // holds made

	waiting     []*turn // first come, first served; preempted requests go first
	loaded      []*turn // read from a remote, waiting for a running slot (skipped_waiting)
	running     []*turn // in the order they were scheduled
	loading     int     // admitted requests not yet running
	pulls       int     // of them, those reading from a remote (WAITING_FOR_REMOTE_KVS)
	preemptions int
	expiryStop  func() bool // the armed hold-expiry timer
	expiryAt    time.Time
	stepEnd     time.Time   // after a preemption, nothing is admitted before it
	stepStop    func() bool // the timer that schedules at stepEnd
}

// unqueue takes t out of r's waiting queues.
func (r *rank) unqueue(t *turn) {
	r.waiting = slices.DeleteFunc(r.waiting, func(w *turn) bool { return w == t })
	r.loaded = slices.DeleteFunc(r.loaded, func(w *turn) bool { return w == t })
}

func (c *Config) dp() int { return max(c.DPSize, 1) }

// rankPeer is rank k's side channel.
type rankPeer struct {
	e *Engine
	k int
}

func (p *rankPeer) Meta(ctx context.Context) (string, float64, error) { return p.e.meta(ctx, p.k) }

func (p *rankPeer) Read(ctx context.Context, engineID, requestID string, blocks []int, tokens int) ([][]uint64, error) {
	return p.e.read(ctx, p.k, engineID, requestID, blocks, tokens)
}

func (p *rankPeer) Notify(ctx context.Context, engineID, requestID string) error {
	return p.e.notify(ctx, p.k, engineID, requestID)
}

func (p *rankPeer) Heartbeat(ctx context.Context, engineID, requestID string) error {
	return p.e.heartbeat(ctx, p.k, engineID, requestID)
}

// pickRank chooses the rank of a request: the one its X-data-parallel-rank
// header names, or the next in turn. vLLM ignores a header that int() cannot
// parse and rejects a rank outside [0, DPSize) when the engine core client
// validates the request (VLLMValidationError: 400). A one-rank engine
// ignores the header unless StrictRank.
func (e *Engine) pickRank(h http.Header) (int, *apiError) {
	n := e.cfg.dp()
	if vals := h.Values(RankHeader); len(vals) > 0 && (n > 1 || e.cfg.StrictRank) {
		// Starlette's headers.get returns the first value
		if v, ok := pyInt(vals[0]); ok {
			if !v.IsInt64() || v.Int64() < 0 || v.Int64() >= int64(n) {
				return 0, &apiError{status: http.StatusBadRequest,
					msg: fmt.Sprintf("data_parallel_rank %s is out of range [0, %d).", v, n)}
			}
			return int(v.Int64()), nil
		}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	k := e.nextRank % n
	e.nextRank = (e.nextRank + 1) % n
	return k, nil
}

// pyInt parses s as Python's int(s) does for ASCII input: surrounding
// whitespace, an optional sign, decimal digits with single underscores
// between them.
func pyInt(s string) (*big.Int, bool) {
	s = strings.TrimSpace(s)
	digits := strings.TrimLeft(s, "+-")
	if len(s)-len(digits) > 1 || digits == "" || digits[0] == '_' || digits[len(digits)-1] == '_' ||
		strings.Contains(digits, "__") {
		return nil, false
	}
	for _, c := range digits {
		if (c < '0' || c > '9') && c != '_' {
			return nil, false
		}
	}
	v, ok := new(big.Int).SetString(s[:len(s)-len(digits)]+strings.ReplaceAll(digits, "_", ""), 10)
	return v, ok
}

// end releases hold h's blocks; state says why.
func (r *rank) end(h *held, state heldState) {
	h.seq.release()
	h.state = state
	delete(r.active, h.id)
}

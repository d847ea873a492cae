package kvroute

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"time"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/kvhandle"
)

// Engines' KV block sizes. A handle's remote_block_ids name blocks of the
// engine that emitted it, one inner list per KV-cache group, and how many
// blocks cover remote_num_tokens depends on that engine's block size:
// vLLM's default on CUDA is 16, MLA models and several attention backends
// run 64 or 32, and hybrid models raise it to fit their state pages. So
// the block-count check of every handle (kvhandle.Check), the partial
// reads (kvhandle.Cut), the fingerprint's blocks and the ledger's block
// counts use the block size of the engine the handle names, which the
// router reads from the engine's GET /metrics: vllm:cache_config_info's
// effective_attention_block_size (the full-attention groups' size, set by
// vLLM's EngineCore once the KV cache is made), else its block_size
// (CacheConfig.metrics_info). It reads it when a turn first uses the
// engine (the leg's check waits for that read, once), again after a
// restart, and again when a handle does not fit it.
//
//   - WithVerification's BlockSize is the size of an engine that reports
//     none (no vllm:cache_config_info: vLLM run with --disable-log-stats,
//     or unreachable /metrics). An engine that reports another size is
//     used at its own, and the difference is logged once.
//   - An engine whose size is unknown (it reports none and none is
//     configured): its handles' block counts are not checked, and none of
//     its handles is read in part (MissPartialRefused).
//   - A handle that does not fit its engine's size (fewer blocks than
//     remote_num_tokens needs: the engine reports a size its handles do not
//     follow, or the configured size is not the engine's) is never used:
//     a prefill engine's turn is served by the decode engine alone, as a
//     plain request (WithFailover's LocalPrefill), and a decode engine's is
//     not retained; counted (Stats.UnvalidatedHandles, with
//     InvalidHandles), logged once per engine and size. The engine then
//     serves without reuse (EndpointStatus.NoReuse; a prefill engine gets
//     no turns while another can take them, else the decode engine serves
//     them alone) until it reports another size, a handle of its fits, or
//     shapeNoReuse passes.

// Intervals of the block size reads and of serving without reuse.
const (
	shapeRetry   = 5 * time.Second // after a failed read, or a handle that did not fit
	shapeNoInfo  = time.Minute     // after an answer without vllm:cache_config_info
	shapeNoReuse = time.Minute     // an engine whose handles did not fit serves without reuse
)

// Where an engine's block size comes from (EndpointStatus.BlockSizeSource).
const (
	sizeFromEngine     = "engine"
	sizeFromConfigured = "configured"
)

// shapes is the Router's knowledge of its engines' block sizes.
type shapes struct {
	configured int    // WithVerification's BlockSize; 0: none
	meter      *meter // the one reader of /metrics (pressure.go)
	clock      func() time.Time
	stats      *counters
	log        *logger
	// learnt is told a decode engine's block size, read (the ledger's
	// block counts).
	learnt func(url string, size int)
}

// due reports whether e's block size is to be read now.
func (s *shapes) due(e *endpoint, now time.Time) bool {
	return e.kv.Due(now, shapeRetry, shapeNoInfo)
}

// size returns the block size of e's handles (0: unknown), reading e's
// /metrics first when it is due; turns that need it at once share one
// read.
func (s *shapes) size(ctx context.Context, e *endpoint) int {
	if e == nil {
		return s.configured
	}
	if s.due(e, s.clock()) {
		// The read is shared: one turn going away does not cut it.
		_ = s.meter.read(ctx, e)
	}
	return s.known(e)
}

// known returns the block size of e's handles without reading: the one e
// reported, else the configured one, else 0.
func (s *shapes) known(e *endpoint) int {
	if e == nil {
		return s.configured
	}
	if size, _ := e.kv.Size(); size > 0 {
		return size
	}
	return s.configured
}

// record records a reading of e's /metrics (ok: it answered, with the
// block size size; 0 when it has none) made now.
func (s *shapes) record(e *endpoint, size int, ok bool) {
	e.kv.Record(s.clock(), size, ok)
	if size > 0 && s.configured > 0 && size != s.configured {
		s.log.once(context.Background(), "block_size:"+e.url+":"+strconv.Itoa(size),
			"kvroute: an engine reports another block size than WithVerification's BlockSize; its own is used for its handles",
			slog.String("endpoint", e.url), slog.Int("engine_block_size", size), slog.Int("configured", s.configured))
	}
	if size > 0 && e.phase == PhaseDecode && s.learnt != nil {
		s.learnt(e.url, size)
	}
}

// check checks handle, emitted by e, at e's block size (reading it
// first when it is due), its block list read already as known says:
// kvhandle.CheckKnown's answer. A handle that does not
// fit the size is recorded (misfits); one that passes records e's KV
// groups.
func (s *shapes) check(ctx context.Context, e *endpoint, handle []byte, known jsonraw.Known) (kvhandle.Info, error) {
	size := s.size(ctx, e)
	hi, err := kvhandle.CheckKnown(handle, size, known)
	switch {
	case err == nil && size > 0:
		s.fits(e, hi.Groups)
	case errors.Is(err, kvhandle.ErrBlockCount):
		s.misfits(e, size, err)
	}
	return hi, err
}

// fits records that a handle of e fitted its block size, with groups KV
// groups: e serves with reuse.
func (s *shapes) fits(e *endpoint, groups int) {
	if e == nil {
		return
	}
	e.kv.Fits(groups)
}

// misfits records that a handle of e did not fit size, its block size:
// counted, logged once per engine and size, and e's size is read again at
// its next use (when its last read is older than shapeRetry).
func (s *shapes) misfits(e *endpoint, size int, err error) {
	s.stats.unvalidatedHandles.Add(1)
	s.stats.invalidHandles.Add(1)
	if e == nil {
		return
	}
	e.kv.Misfits(size, err.Error(), s.clock(), shapeRetry)
	s.log.once(context.Background(), "misfit:"+e.url+":"+strconv.Itoa(size),
		"kvroute: an engine's KV handle holds fewer blocks than its block size needs; the turn is served without reuse, and the engine serves without reuse until it reports another block size or a minute passes",
		slog.String("phase", string(e.phase)), slog.String("endpoint", e.url), slog.Int("block_size", size), slog.String("err", err.Error()))
}

// noReuse returns why e serves without reuse now ("" when it does not):
// a handle of e did not fit the block size e still has, within
// shapeNoReuse.
func (s *shapes) noReuse(e *endpoint) string {
	return e.kv.NoReuse(s.known(e), s.clock(), shapeNoReuse)
}

// forget drops what is known of the engine at url (a restart: it may run
// with another block size now).
func (s *shapes) forget(e *endpoint) {
	if e == nil {
		return
	}
	e.kv.Forget()
}

// status fills st with e's block size, where it comes from, its KV groups
// and why it serves without reuse.
func (s *shapes) status(e *endpoint, st *EndpointStatus) {
	reported, groups := e.kv.Size()
	switch {
	case reported > 0:
		st.BlockSize, st.BlockSizeSource = reported, sizeFromEngine
	case s.configured > 0:
		st.BlockSize, st.BlockSizeSource = s.configured, sizeFromConfigured
	}
	st.KVGroups = groups
	st.NoReuse = s.noReuse(e)
}

// avoided returns the URLs of the engines of p that serve without reuse now.
func (s *shapes) avoided(p *pool) []string {
	var out []string
	for _, e := range p.list() {
		if s.noReuse(e) != "" {
			out = append(out, e.url)
		}
	}
	return out
}

package kvroute

import "github.com/bidikv/bidikv/kvroute/internal/streamsynth"

// VerificationMode selects how the router proves that a retained handle's
// KV is the KV the next prompt needs (package doc, Verification).
type VerificationMode string

// The verification modes, each one file (verify_*.go) registered in
// verifications.
const (
	// VerifyTokens compares tokens: the decode leg asks the engine for token
	// ids (return_token_ids), a compact fingerprint of the sequence D's
	// blocks hold is kept with the handle, and before a prefill leg the new
	// prompt is rendered by an engine (POST .../render, or /tokenize) and
	// compared with it. Only the verified common prefix is attached. It is
	// exact: no answer can differ from a single engine's. The default.
	VerifyTokens VerificationMode = "tokens"
	// VerifyContent compares content: a handle is used only when the request
	// resends exactly the stored conversation and reply (ContinuationKeys'
	// digests), and turns whose next render may differ (reasoning output,
	// stop strings, ...) are not retained. It needs no engine support, but it
	// cannot see what a chat template or tokenizer does to the text (see the
	// README's Limitations).
	VerifyContent VerificationMode = "content"
)

// defaultBlockSize is Verification.BlockSize's default (vLLM's
// --block-size on CUDA), and the fingerprint's block size when partial
// reads are off.
const defaultBlockSize = 16

// Verification is how reuse is verified.
type Verification struct {
	// Mode is VerifyTokens (the default) or VerifyContent. In token mode,
	// a turn whose engine sends no token ids or serves no render endpoint
	// falls back to content verification with all of its refusals; the
	// fallback is logged once and counted in Stats.TokenFallbacks.
	Mode VerificationMode
	// BlockSize is the decode engines' KV block size (vLLM's --block-size),
	// which token verification needs to attach only a verified prefix of a
	// handle: remote_num_tokens is lowered to a multiple of it and every KV
	// group's remote_block_ids is cut from the front (default 16, vLLM's
	// --block-size on CUDA). A handle whose block count does not fit the size
	// is never cut (counted in Stats.PartialRefused).
	BlockSize int
}

// WithVerification sets how reuse is verified. A zero field keeps its
// default; a negative BlockSize disables partial reads (a handle is then
// attached only when the new prompt begins with its whole sequence). A
// Mode that is not a registered mode is an error.
func WithVerification(v Verification) Option {
	return optionFunc(func(c *config) { c.verify = v })
}

func resolveVerification(c *config) {
	v := c.verify
	c.verification = v.Mode
	if c.verification == "" {
		c.verification = VerifyTokens
	}
	if _, ok := verifications[c.verification]; !ok {
		c.fail("WithVerification", "Mode %q is not a mode; use kvroute.VerifyTokens or kvroute.VerifyContent", v.Mode)
	}
	switch {
	case v.BlockSize < 0:
		c.blockSize = 0
	case v.BlockSize == 0:
		c.blockSize = defaultBlockSize
	default:
		c.blockSize = v.BlockSize
	}
}

// DecodeMemory is what the router does with the decode engines' KV memory
// beyond the pulls: answer turns from it (decode-local turns), keep it for
// streaming clients whose streams carry no handle (buffered streams), and
// how it reports it (DecodeKV).
type DecodeMemory struct {
	// Local lets a turn whose retained handle was verified by tokens run
	// decode-local (package doc, Decode-local turns): as a plain request
	// to the decode engine that holds the conversation, which computes
	// only the new suffix from its own prefix cache. The
	// WithThresholdPolicy policy decides per turn when it is a
	// threshold.Chooser (threshold.CostModel is one); otherwise a
	// threshold.CostModel with its defaults and WithThreshold does. Turn
	// it on only when the decode engines run with prefix caching (vLLM's
	// default, --enable-prefix-caching): the router cannot see it, and a
	// decode engine without it recomputes the whole prompt (the answer is
	// still right, but slow, until the cost model learns it). The
	// decode-local leg goes to the engine that holds the handle, whatever
	// the Selector would pick; when that engine is ejected the turn pulls
	// as usual. A learning Chooser (threshold.Learner) is told each
	// streaming turn's observed times on the router's clock. It needs
	// WithVerification's Mode VerifyTokens (the default): with another
	// mode New returns an error. Default false.
	Local bool
	// KVBytesPerToken is the bytes of KV one token takes on the decode
	// engines (layers × KV heads × head dim × 2 × dtype bytes), for
	// DecodeKV.Bytes. Default 0: unknown, Bytes stays 0.
	KVBytesPerToken int64
	// BufferStreams lists the APIs, by path (PathChatCompletions,
	// PathCompletions, PathMessages), whose streamed turns run their decode
	// leg non-streaming when the decode engine's streams of that API carry
	// no handle (package doc, Wire protocol, step 5): the answer's body carries
	// D's handle, which is retained, and the router writes the answer to
	// the client as the API's own stream once it has arrived. The trade:
	// the first token arrives with the last (the turn's TTFT is its whole
	// decode), and every later turn reuses KV; it suits headless agents,
	// whose whole turn's time is what counts. A Messages stream is always
	// buffered (vLLM's never carry a handle). A chat or completions stream
	// is buffered once a stream of that API from its decode engine ended
	// without a handle, and never once one carried a handle (vLLM PR
	// #40186); until then one stream per engine and API at a time goes as
	// the client asked, to show it (on stock engines that turn is not
	// retained), and the others are buffered. PathResponses is an error:
	// its streams carry the handle on response.completed. Default nil:
	// none, every stream is passed through as the engine sends it.
	BufferStreams []string
}

// WithDecodeMemory sets what the router does with the decode engines' KV
// memory. The zero DecodeMemory is the default; a negative
// KVBytesPerToken, and a BufferStreams path without a synthesized stream,
// are errors.
func WithDecodeMemory(m DecodeMemory) Option {
	return optionFunc(func(c *config) { c.decodeMemory = m })
}

func resolveDecodeMemory(c *config) {
	m := c.decodeMemory
	c.positive("WithDecodeMemory", "KVBytesPerToken", m.KVBytesPerToken)
	c.decodeLocal, c.kvBytesPerToken = m.Local, m.KVBytesPerToken
	c.bufferStreams = nil
	for _, p := range m.BufferStreams {
		a, ok := streamsynth.ForPath(p)
		switch {
		case p == PathResponses:
			c.fail("WithDecodeMemory", "BufferStreams: %s streams carry the handle on response.completed (vLLM PR #37424) and are never buffered", p)
		case !ok:
			c.fail("WithDecodeMemory", "BufferStreams: %q is not an API with a buffered stream; use %s, %s or %s", p, PathChatCompletions, PathCompletions, PathMessages)
		default:
			if c.bufferStreams == nil {
				c.bufferStreams = map[string]streamsynth.API{}
			}
			c.bufferStreams[p] = a
		}
	}
}
